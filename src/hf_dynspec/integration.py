"""Entry points: `hf_dynspec.generate(model, ...)`, and `enable` / `disable` for plain `model.generate`."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from transformers import GenerationMixin, PreTrainedModel

from .loop import speculative_loop
from .validation import check_vocabularies


def generate(model: PreTrainedModel, inputs=None, **kwargs):
    """Run transformers' `generate` on `model` with the speculative loop.

    Takes every argument `model.generate` takes, plus `dynspec_config` and `dynspec_policy`. `assistant_model` and
    `streamer` are handed to the loop explicitly (transformers does not forward them to a callable
    `custom_generate`), and so are `tokenizer` and `assistant_tokenizer` for a draft with another tokenizer. With
    sampling, `num_return_sequences=n` repeats each prompt `n` times in the batch (rows `i * n` to `i * n + n - 1`
    continue prompt `i`, as in plain `generate`), and each row samples on its own.
    """
    if kwargs.get("custom_generate") is not None:
        raise ValueError("`custom_generate` is set by hf_dynspec.generate itself; remove it from the call.")
    kwargs.pop("custom_generate", None)
    assistant_model, assistant_tokenizer = kwargs.get("assistant_model"), kwargs.pop("assistant_tokenizer", None)
    if assistant_model is not None and assistant_tokenizer is None:
        check_vocabularies(model, assistant_model)
    loop = functools.partial(
        speculative_loop, assistant_model=assistant_model, streamer=kwargs.get("streamer"),
        tokenizer=kwargs.get("tokenizer"), assistant_tokenizer=assistant_tokenizer,
    )
    inputs, kwargs = _expand_return_sequences(model, inputs, kwargs)
    return GenerationMixin.generate(model, inputs, custom_generate=loop, **kwargs)


_GENERATE_ARGUMENTS = frozenset(inspect.signature(GenerationMixin.generate).parameters)
"""Named arguments of `generate`; every other tensor of a call is a model input with a batch dimension."""


def _expand_return_sequences(model: PreTrainedModel, inputs: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """`num_return_sequences=n > 1` with sampling: the prompts and every other model input repeated `n` times along
    the batch (transformers' own `_expand_inputs_for_generation`), and `num_return_sequences=1` for the loop.

    transformers' `generate` expands its inputs the same way for its own loops, but refuses `n > 1` whenever an
    assistant is given. Greedy calls pass through unchanged, so transformers' own error for greedy decoding with
    `n > 1` still applies."""
    config = kwargs.get("generation_config") or model.generation_config
    copies = kwargs.get("num_return_sequences", config.num_return_sequences) or 1
    if copies == 1 or not kwargs.get("do_sample", config.do_sample):
        return inputs, kwargs
    model_inputs = {k: v for k, v in kwargs.items() if k not in _GENERATE_ARGUMENTS and isinstance(v, torch.Tensor)}
    if isinstance(inputs, torch.Tensor):
        model_inputs["input_ids"] = inputs
    input_ids = model_inputs.pop("input_ids", None)
    input_ids, expanded = model._expand_inputs_for_generation(
        expand_size=copies, is_encoder_decoder=model.config.is_encoder_decoder, input_ids=input_ids, **model_inputs
    )
    kwargs = {**kwargs, **expanded, "num_return_sequences": 1}
    if isinstance(inputs, torch.Tensor):
        return input_ids, kwargs
    if input_ids is not None:
        kwargs["input_ids"] = input_ids
    return inputs, kwargs


def _wants_speculation(model: PreTrainedModel, kwargs: dict) -> bool:
    if kwargs.get("custom_generate") is not None:
        return False
    generation_config = kwargs.get("generation_config") or model.generation_config
    lookup = kwargs.get("prompt_lookup_num_tokens", generation_config.prompt_lookup_num_tokens)
    return kwargs.get("assistant_model") is not None or lookup is not None


def enable(model: PreTrainedModel) -> PreTrainedModel:
    """Route `model.generate(..., assistant_model=draft)` (or `prompt_lookup_num_tokens=n`) through hf_dynspec.

    Only this model object changes (its `generate` attribute); calls without a proposer, or with their own
    `custom_generate`, run transformers' original `generate`. Undo with [`disable`].
    """
    if getattr(model, "_dynspec_original_generate", None) is not None:
        return model
    original = model.generate

    @functools.wraps(original)
    def dynspec_generate(*args, **kwargs):
        if _wants_speculation(model, kwargs):
            return generate(model, *args, **kwargs)
        return original(*args, **kwargs)

    model._dynspec_original_generate = original
    model.generate = dynspec_generate
    return model


def disable(model: PreTrainedModel) -> PreTrainedModel:
    """Restore the `generate` that [`enable`] replaced."""
    original = getattr(model, "_dynspec_original_generate", None)
    if original is None:
        return model
    if "generate" in model.__dict__:
        del model.__dict__["generate"]
    if getattr(original, "__self__", None) is not model:
        model.generate = original  # it was an instance attribute before enable (e.g. a Hub custom_generate)
    model._dynspec_original_generate = None
    return model
