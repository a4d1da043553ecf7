"""What `generate` hands the loop, resolved: its settings, a draft's tokenizers, the criteria the loop applies itself,
and the arguments transformers does not forward to a callable `custom_generate`."""

from __future__ import annotations

import inspect
import sys

import torch
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from .config import DynSpecConfig


def resolve_config(value: DynSpecConfig | dict | str | None, generation_config: GenerationConfig) -> DynSpecConfig:
    """An explicit config wins; otherwise the model's generation config's `dynspec` entry; otherwise defaults."""
    if value is None:
        from_model = DynSpecConfig.from_generation_config(generation_config)
        if from_model is not None:
            return from_model
        lookup = generation_config.prompt_lookup_num_tokens
        return DynSpecConfig(num_speculative_tokens=int(lookup)) if lookup else DynSpecConfig()
    return DynSpecConfig.coerce(value)


def translation_for(
    draft: PreTrainedModel | None,
    tokenizer: PreTrainedTokenizerBase | None,
    assistant_tokenizer: PreTrainedTokenizerBase | None,
    config: DynSpecConfig,
) -> tuple[PreTrainedTokenizerBase, PreTrainedTokenizerBase] | None:
    """`(target tokenizer, draft tokenizer)` when the call asks for a draft with another tokenizer, else `None`;
    a clear error for what such a draft cannot do."""
    if assistant_tokenizer is None:
        return None
    if draft is None or tokenizer is None:
        raise ValueError(
            "`assistant_tokenizer` drafts with a model that has another tokenizer: pass the draft as `assistant_model` "
            "and the target's tokenizer as `tokenizer` too."
        )
    if config.tree_node_budget or config.proposer in ("hybrid", "suffix"):
        raise ValueError(
            "A draft with another tokenizer proposes chains only: set `tree_node_budget=0` and proposer='auto' "
            "in the DynSpecConfig."
        )
    return tokenizer, assistant_tokenizer


def applied_by_loop(criterion: object, generation_config: GenerationConfig) -> bool:
    """Whether `criterion` is one of the length and EOS criteria `generate` builds from `generation_config`, which the
    loop applies itself, row by row: a `MaxLengthCriteria` no tighter than `max_length`, an `EosTokenCriteria` of
    EOS ids the generation config has. A user's own, tighter ones run as extra criteria."""
    if isinstance(criterion, MaxLengthCriteria):
        return criterion.max_length >= generation_config.max_length
    if isinstance(criterion, EosTokenCriteria):
        eos = generation_config._eos_token_tensor
        ids = torch.as_tensor(criterion.eos_token_id).reshape(-1)
        return eos is not None and bool(torch.isin(ids.to(eos.device), eos.reshape(-1)).all())
    return False


_GENERATE_CODE = inspect.unwrap(GenerationMixin.generate).__code__


def recover_generate_arguments(assistant_model, streamer):
    """Find `assistant_model` and `streamer` in the calling `generate` when they did not reach the loop.

    When `custom_generate` is a callable, transformers' `generate` validates and prepares `assistant_model` and
    `streamer` but does not forward them to the callable. They are read from the `generate` call that invoked this
    loop; `hf_dynspec.generate` and the Hub folder pass them explicitly instead.
    """
    if assistant_model is not None and streamer is not None:
        return assistant_model, streamer
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            break
        if frame.f_code is _GENERATE_CODE:
            assistant_model = assistant_model if assistant_model is not None else frame.f_locals.get("assistant_model")
            streamer = streamer if streamer is not None else frame.f_locals.get("streamer")
            break
        frame = frame.f_back
    return assistant_model, streamer
