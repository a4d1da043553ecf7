"""Serving with speculation: transformers' OpenAI-compatible server (`transformers serve`) over an enabled model.

`transformers serve MODEL --continuous-batching` answers `/v1/chat/completions`, `/v1/completions` and
`/v1/responses` from a continuous-batching manager it starts with `model.init_continuous_batching`. `serve` runs
that same server, its handlers and schema unchanged, with the model enabled (`hf_dynspec.enable`) as it is loaded:
its manager is then hf_dynspec's (`hf_dynspec.continuous`), and every decoding request drafts from a draft model,
prompt lookup or suffix trees as the policy chooses, step by step. Without `--continuous-batching` the server's
`generate` calls speculate through the same binding.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from transformers import PreTrainedModel

from .config import DynSpecConfig
from .integration import enable


def serve(
    model: str,
    *,
    assistant_model: str | None = None,
    prompt_lookup_num_tokens: int | None = None,
    dynspec_config: DynSpecConfig | dict | str | None = None,
    **serve_options: Any,
):
    """Run `transformers serve model` with speculation; returns transformers' `Serve` (with `non_blocking=True` it
    returns once the server listens; `kill_server()` stops it).

    Args:
        model: the model to load and serve: a name of `hf_dynspec.evaluation.models.REGISTRY` (the default target's
            GGUF file, assembled from its pip packages), or what `transformers serve MODEL` takes (a Hub id, a local
            folder, `<folder or repo>:<file>.gguf`).
        assistant_model: a draft model sharing the target's vocabulary (a registry name, a local folder or a Hub id),
            loaded in the served model's dtype and device.
        prompt_lookup_num_tokens: draft up to this many tokens a step by prompt lookup.
        dynspec_config: the speculation settings; `DynSpecConfig(proposer="suffix")` drafts from suffix trees.
        serve_options: `transformers serve`'s options by their Python names (`continuous_batching=True`, `port`,
            `device`, `dtype`, `cb_num_blocks`, `cb_max_batch_tokens`, ...).
    """
    config = DynSpecConfig.coerce(dynspec_config)
    if assistant_model is None and prompt_lookup_num_tokens is None and config.proposer != "suffix":
        raise ValueError(
            "Say where draft tokens come from: `assistant_model` (a draft model), `prompt_lookup_num_tokens=N`, or a "
            "`dynspec_config` with proposer='suffix'."
        )
    if prompt_lookup_num_tokens is not None and (
        not isinstance(prompt_lookup_num_tokens, int) or prompt_lookup_num_tokens < 1
    ):
        raise ValueError(f"`prompt_lookup_num_tokens` must be a positive integer, got {prompt_lookup_num_tokens!r}.")
    from transformers.cli.serve import Serve

    name, eos_token_ids = served_model(model)
    with speculating_loads(prompt_lookup_num_tokens, config, eos_token_ids, assistant_model):
        return Serve(force_model=name, **serve_options)


def served_model(model: str) -> tuple[str, tuple[int, ...]]:
    """The name `transformers serve` loads for `model` (registry names become `<folder>:<file>.gguf`), and the EOS
    ids the registry gives it (empty for other models)."""
    from .evaluation.models import REGISTRY, resolve_model

    if model not in REGISTRY:
        return model, ()
    location = resolve_model(model)
    name = f"{location.path}:{location.gguf_file}" if location.gguf_file else location.path
    return name, location.eos_token_ids


@contextmanager
def speculating_loads(
    prompt_lookup_num_tokens: int | None,
    config: DynSpecConfig,
    eos_token_ids: tuple[int, ...] = (),
    assistant_model: str | None = None,
) -> Iterator[None]:
    """While open, every model transformers' serving loads is enabled with these settings and the draft
    `assistant_model` (loaded in the model's dtype and device); the server preloads its model, so the models it
    serves are enabled. `eos_token_ids`, when given, become the model's EOS ids."""
    from transformers.cli.serving.model_manager import ModelManager

    original = ModelManager.load_model_and_processor

    def load(self, *args, **kwargs):
        model, processor = original(self, *args, **kwargs)
        if eos_token_ids:
            model.generation_config.eos_token_id = list(eos_token_ids)
        if prompt_lookup_num_tokens is not None:
            model.generation_config.prompt_lookup_num_tokens = prompt_lookup_num_tokens
        draft = load_draft(assistant_model, model) if assistant_model is not None else None
        enable(model, draft, dynspec_config=config)
        return model, processor

    ModelManager.load_model_and_processor = load
    try:
        yield
    finally:
        ModelManager.load_model_and_processor = original


def load_draft(name: str, model: PreTrainedModel) -> PreTrainedModel:
    """The draft `name` (a registry name, a local folder or a Hub id) in `model`'s dtype, on its device."""
    from transformers import AutoModelForCausalLM

    from .evaluation.models import REGISTRY, load_model, resolve_model

    if name in REGISTRY:
        draft = load_model(resolve_model(name), model.dtype)
    else:
        draft = AutoModelForCausalLM.from_pretrained(name, dtype=model.dtype)
    return draft.to(model.device).eval()
