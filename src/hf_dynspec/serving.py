"""Serving with speculation: transformers' OpenAI-compatible server (`transformers serve`) over an enabled model.

`transformers serve MODEL --continuous-batching` answers `/v1/chat/completions`, `/v1/completions` and
`/v1/responses` from a continuous-batching manager it starts with `model.init_continuous_batching`. `serve` runs
that same server, its handlers and schema unchanged, with the model enabled (`hf_dynspec.enable`) as it is loaded:
its manager is then hf_dynspec's (`hf_dynspec.continuous`), and every decoding request drafts from a draft model,
prompt lookup or suffix trees as the policy chooses, step by step. Without `--continuous-batching` the server's
`generate` calls speculate through the same binding. From transformers 5.25 the server loads each model in a process
of its own, from a `ModelLoader` it pickles there: `SpeculatingLoader` is that loader, enabling what it loads; with
5.20-5.24 the model loads in the server's process (`speculating_loads`).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from transformers import PreTrainedModel
from transformers.utils import logging

from .config import DynSpecConfig
from .continuous import SpeculationStats
from .integration import enable

try:  # transformers >= 5.25 loads the served model in a process of its own, through a `ModelLoader`
    from transformers.cli.serve import Serve as _Serve
    from transformers.cli.serving.model_manager import ModelLoader as _ModelLoader
except ImportError:  # older releases (in-process loading), or no serving extras
    _ModelLoader = None


def serve(
    model: str,
    *,
    assistant_model: str | None = None,
    prompt_lookup_num_tokens: int | None = None,
    dynspec_config: DynSpecConfig | dict | str | None = None,
    stats_interval: float = 10.0,
    **serve_options: Any,
):
    """Run `transformers serve model` with speculation, until the server stops (Ctrl+C or SIGTERM), as
    `transformers serve` runs; returns transformers' `Serve`. (transformers 5.20-5.24 only: `non_blocking=True`
    returns once the server listens, and `kill_server()` stops it.)

    Args:
        model: the model to load and serve: a name of `hf_dynspec.evaluation.models.REGISTRY` (the default target's
            GGUF file, assembled from its pip packages), or what `transformers serve MODEL` takes (a Hub id, a local
            folder, `<folder or repo>:<file>.gguf`).
        assistant_model: a draft model sharing the target's vocabulary (a registry name, a local folder or a Hub id),
            loaded in the served model's dtype and device.
        prompt_lookup_num_tokens: draft up to this many tokens a step by prompt lookup.
        dynspec_config: the speculation settings; `DynSpecConfig(proposer="suffix")` drafts from suffix trees.
        stats_interval: seconds between the lines saying what speculation did (requests, draft tokens, acceptance),
            logged at info beside transformers' own stats lines (`log_level="info"`) while requests arrive.
        serve_options: `transformers serve`'s options by their Python names (`continuous_batching=True`, `port`,
            `device`, `dtype`, `cb_num_blocks`, `cb_max_batch_tokens`, `log_level`, ...).
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
    if not stats_interval > 0:
        raise ValueError(f"`stats_interval` must be a positive number of seconds, got {stats_interval!r}.")
    name, eos_token_ids = served_model(model)
    speculation = Speculation(prompt_lookup_num_tokens, config, eos_token_ids, assistant_model, stats_interval)
    if _ModelLoader is not None:
        return SpeculativeServe(speculation, force_model=name, **serve_options)
    from transformers.cli.serve import Serve

    with speculating_loads(speculation):
        return Serve(force_model=name, **serve_options)


@dataclass(frozen=True)
class Speculation:
    """How the served model speculates; it travels to the process the server loads the model in (pickled)."""

    prompt_lookup_num_tokens: int | None
    config: DynSpecConfig
    eos_token_ids: tuple[int, ...] = ()
    assistant_model: str | None = None
    stats_interval: float = 10.0

    def apply(self, model: PreTrainedModel) -> None:
        """Enable `model` (just loaded by the server) with these settings, and log what its managers speculate."""
        if self.eos_token_ids:
            model.generation_config.eos_token_id = list(self.eos_token_ids)
        if self.prompt_lookup_num_tokens is not None:
            model.generation_config.prompt_lookup_num_tokens = self.prompt_lookup_num_tokens
        draft = load_draft(self.assistant_model, model) if self.assistant_model is not None else None
        enable(model, draft, dynspec_config=self.config)
        _log_speculation(model, self.stats_interval)


def _log_speculation(model: PreTrainedModel, interval: float) -> None:
    """Every `interval` seconds in which requests decoded, a line at info saying what the speculating managers
    `model.init_continuous_batching` made so far did. It goes through transformers' serving logger, whose level the
    server's `log_level` sets."""
    managers: list[Any] = []
    init = model.init_continuous_batching

    def recording(*args: Any, **kwargs: Any) -> Any:
        manager = init(*args, **kwargs)
        managers.append(manager)
        return manager

    model.init_continuous_batching = recording
    logger = logging.get_logger("transformers.cli.serving.speculation")

    def report() -> None:
        last = None
        while True:
            time.sleep(interval)
            stats = [manager.speculation for manager in managers if hasattr(manager, "speculation")]
            if not stats or stats[-1] == last:
                continue
            last = replace(stats[-1])
            logger.info(speculation_line(last))

    threading.Thread(target=report, name="speculation-stats", daemon=True).start()


def speculation_line(stats: SpeculationStats) -> str:
    """What a speculating manager did, in one line."""
    per_step = stats.emitted_tokens / stats.decode_steps if stats.decode_steps else 0.0
    return (
        f"Speculation: {stats.requests} requests, {stats.draft_tokens} draft tokens "
        f"({stats.free_tokens} model-free), {stats.accepted_tokens} accepted ({100 * stats.acceptance_rate:.0f}%), "
        f"{per_step:.2f} tokens per decoding step"
    )


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
def speculating_loads(speculation: Speculation) -> Iterator[None]:
    """transformers 5.20-5.24, which load the served model in the server's own process: while open, every model
    its serving loads is enabled by `speculation` (the server preloads its model, so the models it serves are)."""
    from transformers.cli.serving.model_manager import ModelManager

    original = ModelManager.load_model_and_processor
    enabled: weakref.WeakSet = weakref.WeakSet()  # requests load the model again, and get the one loaded before

    def load(self, *args, **kwargs):
        model, processor = original(self, *args, **kwargs)
        if model not in enabled:
            speculation.apply(model)
            enabled.add(model)
        return model, processor

    ModelManager.load_model_and_processor = load
    try:
        yield
    finally:
        ModelManager.load_model_and_processor = original


def load_draft(name: str, model: PreTrainedModel) -> PreTrainedModel:
    """The draft `name` (a registry name, a local folder or a Hub id) in `model`'s dtype, on its device. A registry
    name may end in a variant (`qwen2.5-coder-0.5b@4bit`: bitsandbytes 4-bit, computing in `model`'s dtype)."""
    from transformers import AutoModelForCausalLM

    from .evaluation.models import REGISTRY, LoadOptions, load_model, resolve_model, split_variant

    base, variant = split_variant(name)
    if base in REGISTRY:  # placed on the model's device as it loads (bitsandbytes models cannot move afterwards)
        options = LoadOptions(dtype=str(model.dtype).removeprefix("torch."), device=str(model.device))
        return load_model(resolve_model(base), options.with_variant(variant))
    draft = AutoModelForCausalLM.from_pretrained(name, dtype=model.dtype)
    return draft.to(model.device).eval()


if _ModelLoader is not None:  # transformers >= 5.25: the served model loads in a process of its own

    class SpeculatingLoader(_ModelLoader):
        """transformers' `ModelLoader`, enabling each model it loads by `speculation`. The server pickles its loader
        into the model's process, so that this class, not a patched method, reaches it."""

        speculation: Speculation

        @classmethod
        def adopt(cls, loader: Any, speculation: Speculation) -> SpeculatingLoader:
            adopted = cls.__new__(cls)
            adopted.__dict__.update(vars(loader))
            adopted.speculation = speculation
            return adopted

        def load_model_and_processor(self, model_id: str, on_progress: Any = None) -> tuple[PreTrainedModel, Any]:
            model, processor = super().load_model_and_processor(model_id, on_progress)
            self.speculation.apply(model)
            return model, processor

    class SpeculativeServe(_Serve):
        """`transformers serve` whose models load enabled: its loader becomes a `SpeculatingLoader` before it
        serves, with one API server or several."""

        def __init__(self, speculation: Speculation, **options: Any) -> None:
            self.speculation = speculation
            super().__init__(**options)

        def run(self, *args: Any, **kwargs: Any) -> None:
            self._speculate()
            super().run(*args, **kwargs)

        def run_api_servers(self, count: int) -> None:
            self._speculate()
            super().run_api_servers(count)

        def _speculate(self) -> None:
            if not isinstance(self.loader, SpeculatingLoader):
                self.loader = SpeculatingLoader.adopt(self.loader, self.speculation)
