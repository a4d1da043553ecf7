"""Entry points: `hf_dynspec.generate(model, ...)`, and `enable` / `disable` for plain `model.generate`."""

from __future__ import annotations

import functools
import inspect
import types
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel, PreTrainedTokenizerBase

from .candidates.rollout import clear_rollout_caches
from .config import DynSpecConfig
from .loop import speculative_loop
from .validation import check_vocabularies


def generate(model: PreTrainedModel, inputs=None, **kwargs):
    """Run transformers' `generate` on `model` with the speculative loop.

    Takes every argument `model.generate` takes, plus `dynspec_config` and `dynspec_policy`. `assistant_model` and
    `streamer` are handed to the loop explicitly (transformers does not forward them to a callable
    `custom_generate`), and so are `tokenizer` and `assistant_tokenizer` for a draft with another tokenizer. With
    sampling, `num_return_sequences=n` repeats each prompt `n` times in the batch (rows `i * n` to `i * n + n - 1`
    continue prompt `i`, as in plain `generate`), and each row samples on its own. A PEFT model (target or draft)
    generates through its base model, whose layers hold the adapters (see [`enable`]).
    """
    if kwargs.get("custom_generate") is not None:
        raise ValueError("`custom_generate` is set by hf_dynspec.generate itself; remove it from the call.")
    kwargs.pop("custom_generate", None)
    model = _generating_model(model, "model")
    if kwargs.get("assistant_model") is not None:
        kwargs["assistant_model"] = _generating_model(kwargs["assistant_model"], "assistant_model")
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


@dataclass
class Binding:
    """What [`enable`] bound to a model: the draft and settings of every `generate` call that brings no proposer."""

    assistant_model: PreTrainedModel | None = None
    dynspec_config: DynSpecConfig | dict | str | None = None
    tokenizer: PreTrainedTokenizerBase | None = None
    assistant_tokenizer: PreTrainedTokenizerBase | None = None

    def call_kwargs(self, model: PreTrainedModel, kwargs: dict[str, Any]) -> dict[str, Any]:
        """`kwargs` of a `generate` call with what the call does not bring itself: the config always, the draft (and
        its tokenizers) only when the call names no proposer of its own (`assistant_model`,
        `prompt_lookup_num_tokens`) and the loop can serve it (no beam search; several sequences per prompt only
        with sampling: other calls run transformers' own loop)."""
        kwargs = dict(kwargs)
        if self.dynspec_config is not None and kwargs.get("dynspec_config") is None:
            kwargs["dynspec_config"] = self.dynspec_config
        if self.assistant_model is None or _brings_proposer(model, kwargs) or not _loop_serves(model, kwargs):
            return kwargs
        kwargs["assistant_model"] = self.assistant_model
        for name in ("tokenizer", "assistant_tokenizer"):
            if getattr(self, name) is not None and kwargs.get(name) is None:
                kwargs[name] = getattr(self, name)
        return kwargs


def _setting(model: PreTrainedModel, kwargs: dict[str, Any], name: str) -> Any:
    """A generation setting of a call: its keyword, else its `generation_config`'s, else the model's."""
    if kwargs.get(name) is not None:
        return kwargs[name]
    return getattr(kwargs.get("generation_config") or model.generation_config, name, None)


def _brings_proposer(model: PreTrainedModel, kwargs: dict[str, Any]) -> bool:
    return kwargs.get("assistant_model") is not None or _setting(model, kwargs, "prompt_lookup_num_tokens") is not None


def _loop_serves(model: PreTrainedModel, kwargs: dict[str, Any]) -> bool:
    """Whether the loop takes a call of these settings (beam search it does not; several sequences per prompt with
    sampling only)."""
    if (_setting(model, kwargs, "num_beams") or 1) > 1:
        return False
    return (_setting(model, kwargs, "num_return_sequences") or 1) == 1 or bool(_setting(model, kwargs, "do_sample"))


def _config_proposes(model: PreTrainedModel, kwargs: dict[str, Any]) -> bool:
    """Whether the call's loop settings (its `dynspec_config`, else its generation config's) need the loop without an
    assistant model or `prompt_lookup_num_tokens`: the suffix proposer, the rollout cache, coupled sampling, or a
    draft head it names."""
    value = kwargs.get("dynspec_config")
    if value is None:
        value = DynSpecConfig.from_generation_config(kwargs.get("generation_config") or model.generation_config)
    return value is not None and _loop_proposes(DynSpecConfig.coerce(value))


def _loop_proposes(config: DynSpecConfig) -> bool:
    """Whether `config` speculates (or samples) in the loop with no assistant model named."""
    named = config.draft_head is not None
    return config.proposer == "suffix" or config.reuse_rollouts or config.sampling == "coupled" or named


def _wants_speculation(model: PreTrainedModel, kwargs: dict) -> bool:
    if kwargs.get("custom_generate") is not None:
        return False
    return _brings_proposer(model, kwargs) or (_config_proposes(model, kwargs) and _loop_serves(model, kwargs))


def enable(
    model: PreTrainedModel,
    assistant_model: PreTrainedModel | None = None,
    *,
    dynspec_config: DynSpecConfig | dict | str | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    assistant_tokenizer: PreTrainedTokenizerBase | None = None,
) -> PreTrainedModel:
    """Route `model.generate` (and `model.init_continuous_batching`) through hf_dynspec, optionally with a draft bound
    to the model.

    Without `assistant_model`, calls that bring a proposer (`assistant_model=draft` or `prompt_lookup_num_tokens=n`,
    or a `dynspec_config` bound or given with `proposer='suffix'`) speculate and every other call runs transformers'
    original `generate`. With it, every later call that brings no proposer of its own speculates with the bound draft,
    so callers that pass only a `GenerationConfig` (TRL's trainers, lm-evaluation-harness, pipelines) speculate too. A call's own `assistant_model`,
    `prompt_lookup_num_tokens` or `dynspec_config` wins over what is bound; calls the loop cannot serve (beam search,
    several greedy sequences per prompt) and calls with their own `custom_generate` run transformers' `generate`.

    Continuous batching (`model.generate_batch`, `model.init_continuous_batching()`, TRL's
    `use_transformers_continuous_batching`, `transformers serve --continuous-batching`) speculates with
    `prompt_lookup_num_tokens` of the generation config, else with what is bound: the draft, or a `dynspec_config`
    with proposer='suffix' (see `hf_dynspec.continuous`; a draft with suffix proposals runs in `generate` only).

    A PEFT model (`PeftModel` with LoRA or other adapters that change weights, not prompt learning) is enabled on its
    base model, whose layers hold the adapters, so `peft_model.generate` reaches the loop through peft's own
    `generate`. The model's train or eval mode is left as it is, and nothing is cached from its weights, so it may be
    trained between calls. Enabling an enabled model again updates what is bound (an `assistant_model` of `None`
    keeps the bound draft); binding another draft than the bound one needs [`disable`] first.

    Args:
        model: the target model (or a PEFT model around it).
        assistant_model: a draft to bind (a PEFT draft is used through its base model, adapters included).
        dynspec_config: the loop's settings for calls that bring none.
        tokenizer: the target's tokenizer, for a bound draft with another tokenizer.
        assistant_tokenizer: the bound draft's tokenizer, when it differs from the target's.
    """
    target, draft = _generating_model(model, "model"), _generating_model(assistant_model, "assistant_model")
    if draft is not None:
        if assistant_tokenizer is None:
            check_vocabularies(target, draft)
        elif tokenizer is None:
            raise ValueError("enable(..., assistant_tokenizer=...) binds a draft with another tokenizer: pass the "
                             "target's tokenizer as `tokenizer` too.")
    binding = getattr(target, "_dynspec_binding", None)
    if binding is None:
        _wrap_generate(target)
        binding = target._dynspec_binding = Binding()
    if draft is not None and binding.assistant_model not in (None, draft):
        raise ValueError(
            "This model is already enabled with another draft; call hf_dynspec.disable(model) before binding a new one."
        )
    binding.assistant_model = draft if draft is not None else binding.assistant_model
    for name, value in (("dynspec_config", dynspec_config), ("tokenizer", tokenizer),
                        ("assistant_tokenizer", assistant_tokenizer)):
        if value is not None:
            setattr(binding, name, value)
    return model


def _wrap_generate(target: PreTrainedModel) -> None:
    """Replace `target.generate` and `target.init_continuous_batching` (this object only) with ones that consult the
    model's binding. They are methods bound to `target`, so a `copy.deepcopy` of the model (a trainer's reference
    model) generates with the copy. transformers' `generate_batch` and `transformers serve` start their continuous
    batching through `init_continuous_batching`, so they speculate too."""
    target._dynspec_original_generate = target.generate
    target.generate = types.MethodType(_dynspec_generate, target)
    if hasattr(target, "init_continuous_batching"):
        target.init_continuous_batching = types.MethodType(_dynspec_init_continuous_batching, target)


def _dynspec_generate(self: PreTrainedModel, *args, **kwargs):
    """`generate` of an enabled model: the loop when the call (or the binding) brings a proposer, else the original."""
    bound = self._dynspec_binding.call_kwargs(self, kwargs)
    if _wants_speculation(self, bound):
        return generate(self, *args, **bound)
    return self._dynspec_original_generate(*args, **kwargs)


def _dynspec_init_continuous_batching(
    self: PreTrainedModel,
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: Any = None,
    workload_hints: Any = None,
):
    """`init_continuous_batching` of an enabled model: a speculating manager (`hf_dynspec.continuous`) when the
    generation config names prompt lookup (`prompt_lookup_num_tokens`), or the binding a draft model or a suffix
    config; else transformers' own. A manager cached on the model (`persistent_manager=True`) is reused as
    transformers reuses it."""
    original = type(self).init_continuous_batching
    lookup = _setting(self, {"generation_config": generation_config}, "prompt_lookup_num_tokens")
    binding = self._dynspec_binding
    config = binding.dynspec_config
    model_free = config is not None and _loop_proposes(DynSpecConfig.coerce(config))
    draft = binding.assistant_model if lookup is None else None
    cached = getattr(self, "_cached_continuous_batching_manager", None) is not None
    if cached or (lookup is None and not model_free and draft is None):
        return original(self, generation_config, continuous_batching_config, workload_hints)
    from .continuous import init_continuous_batching

    return init_continuous_batching(
        self, draft, prompt_lookup_num_tokens=lookup, dynspec_config=config, generation_config=generation_config,
        continuous_batching_config=continuous_batching_config, workload_hints=workload_hints,
    )


def disable(model: PreTrainedModel) -> PreTrainedModel:
    """Restore the `generate` that [`enable`] replaced, and unbind its draft."""
    target = _generating_model(model, "model")
    original = getattr(target, "_dynspec_original_generate", None)
    if original is None:
        return model
    if "generate" in target.__dict__:
        del target.__dict__["generate"]
    if getattr(original, "__self__", None) is not target:
        target.generate = original  # it was an instance attribute before enable (e.g. a Hub custom_generate)
    target.__dict__.pop("init_continuous_batching", None)
    target._dynspec_original_generate = None
    target._dynspec_binding = None
    return model


def clear_rollouts(model: PreTrainedModel) -> PreTrainedModel:
    """Empty the rollout caches of `model` (`DynSpecConfig.reuse_rollouts`; a PEFT model's are its base model's):
    later calls propose nothing from earlier samples until they have stored new ones."""
    clear_rollout_caches(_generating_model(model, "model"))
    return model


def _generating_model(model: Any, role: str) -> Any:
    """The transformers model that generates for `model`: a PEFT model's base model (its layers hold the adapters),
    `model` itself otherwise; a clear error for PEFT prompt learning, whose virtual tokens only peft's own forward
    adds."""
    get_base_model = getattr(model, "get_base_model", None)
    if model is None or get_base_model is None or not hasattr(model, "peft_config"):
        return model
    if model.active_peft_config.is_prompt_learning:
        raise ValueError(
            f"`{role}` is a PEFT model with a prompt-learning adapter ({type(model.active_peft_config).__name__}), "
            "whose virtual tokens hf_dynspec's loop does not add; use an adapter that changes weights (LoRA and the "
            "like) or generate without hf_dynspec."
        )
    return get_base_model()
