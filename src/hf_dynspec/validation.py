"""Checks that turn unsupported inputs into clear errors before any decoding starts."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation.logits_process import UnbatchedClassifierFreeGuidanceLogitsProcessor

from .devices import unloaded_parameters
from .eagle3 import StateHead

logger = logging.getLogger(__name__)

# transformers' assisted-generation draft-length settings, which the loop's policies replace.
DRAFT_LENGTH_SETTINGS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")


def validate_inputs(
    model: PreTrainedModel,
    draft: PreTrainedModel | None,
    input_ids: torch.LongTensor,
    generation_config: GenerationConfig,
    logits_processor: Iterable,
    model_kwargs: dict,
    synced_gpus: bool,
    streamer=None,
    same_vocabulary: bool = True,
    suffix: bool = False,
    rollouts: bool = False,
    coupled: bool = False,
) -> None:
    """Raise `ValueError` naming the problem and the fix for anything the loop cannot decode exactly
    (`same_vocabulary=False`: the draft has another tokenizer, and its tokens are translated; `suffix`: the config
    proposes from suffix trees, which need no assistant model; `rollouts`: from the rollout cache, beside the
    assistant model if one is given; `coupled`: coupled sampling, which drafts with prompt lookup when the call brings
    no proposer)."""
    _check_mode(generation_config, synced_gpus)
    if draft is not None and not isinstance(draft, PreTrainedModel):
        raise ValueError(
            f"`assistant_model` must be a loaded transformers model, got {type(draft).__name__}; load it first, e.g. "
            "AutoModelForCausalLM.from_pretrained(<draft id>)."
        )
    if streamer is not None and input_ids.shape[0] != 1:
        raise ValueError(
            f"A streamer was given with batch size {input_ids.shape[0]}; the speculative loop streams batch size 1 "
            "only (rows advance by different numbers of tokens per step). Generate without a streamer, or per row."
        )
    _check_proposer(draft, generation_config, suffix, rollouts, coupled)
    _check_assistant_settings(generation_config)
    _check_model(model, "target model")
    if isinstance(draft, StateHead):
        draft.bind(model)  # the head reads the target's states and embeddings: it must fit them
    if draft is not None:
        _check_model(draft, "draft model")
        if same_vocabulary:
            check_vocabularies(model, draft)
    _check_inputs(input_ids, model_kwargs, generation_config)
    _check_pad(model, generation_config)
    _check_logits_processors(logits_processor)


def check_vocabularies(model: PreTrainedModel, draft: PreTrainedModel) -> None:
    """Draft and target must score the same vocabulary."""
    target_vocab = model.config.get_text_config().vocab_size
    draft_vocab = draft.config.get_text_config().vocab_size
    if target_vocab != draft_vocab:
        raise ValueError(
            f"The draft model's vocabulary ({draft_vocab} entries) differs from the target's ({target_vocab}). "
            "A draft with another tokenizer needs both tokenizers: pass `tokenizer=<target tokenizer>` and "
            "`assistant_tokenizer=<draft tokenizer>` to `hf_dynspec.generate` (or to a model made with "
            "`hf_dynspec.enable`)."
        )


def _check_mode(generation_config: GenerationConfig, synced_gpus: bool) -> None:
    if (generation_config.num_beams or 1) != 1:
        raise ValueError(
            f"Beam search (num_beams={generation_config.num_beams}) cannot be combined with speculative decoding; "
            "set num_beams=1 or drop the assistant model."
        )
    if (generation_config.num_return_sequences or 1) != 1:
        raise ValueError(
            f"num_return_sequences={generation_config.num_return_sequences} cannot reach the speculative loop itself; "
            "with do_sample=True, call hf_dynspec.generate (or an enabled model), which repeats each prompt in the "
            "batch, or repeat the prompts yourself (each row samples independently)."
        )
    if synced_gpus:
        raise ValueError("synced_gpus=True (DeepSpeed ZeRO-3 / FSDP) is not supported by the speculative loop.")
    unsupported = [
        flag
        for flag in ("output_attentions", "output_hidden_states")
        if getattr(generation_config, flag, False)
    ]
    if unsupported:
        raise ValueError(
            f"{unsupported} are not supported by the speculative loop (its target forwards cover several tokens of "
            "each row, drafts included); drop them (output_scores and output_logits work), or use plain generate."
        )
    if generation_config.use_cache is False:
        raise ValueError("use_cache=False: speculative decoding needs the KV cache; remove use_cache=False.")


def _check_proposer(
    draft: PreTrainedModel | None, generation_config: GenerationConfig, suffix: bool, rollouts: bool, coupled: bool
) -> None:
    lookup = generation_config.prompt_lookup_num_tokens
    if rollouts and lookup is not None:
        raise ValueError(
            "DynSpecConfig(reuse_rollouts=True) proposes from the rollout cache (beside the assistant model, if one is "
            "given); drop `prompt_lookup_num_tokens`."
        )
    if suffix and lookup is not None:
        raise ValueError(
            "DynSpecConfig(proposer='suffix') proposes from suffix trees, which cover the prompt as prompt lookup "
            "does; drop `prompt_lookup_num_tokens` (or use proposer='auto' for prompt lookup)."
        )
    if draft is None and lookup is None and not (suffix or rollouts or coupled):
        raise ValueError(
            "The speculative loop needs a proposer: pass `assistant_model=<draft model>` or "
            "`prompt_lookup_num_tokens=<n>` to generate."
        )
    if draft is not None and lookup is not None:
        raise ValueError(
            "Both `assistant_model` and `prompt_lookup_num_tokens` were given; choose one proposer (drop "
            "`prompt_lookup_num_tokens` to draft with the assistant model)."
        )


def _check_assistant_settings(generation_config: GenerationConfig) -> None:
    """Reject transformers' lossy or self-drafting assisted modes; warn that its draft-length settings do not apply."""
    if getattr(generation_config, "assistant_early_exit", None) is not None:
        raise ValueError(
            f"assistant_early_exit={generation_config.assistant_early_exit} (drafting with the target's own first "
            "layers) is not supported by the speculative loop; pass a separate `assistant_model` instead."
        )
    if getattr(generation_config, "assistant_ensemble_weight", None) is not None:
        raise ValueError(
            f"assistant_ensemble_weight={generation_config.assistant_ensemble_weight} asks for a lossy ensemble of "
            "draft and target; the speculative loop only samples from the target's own distribution. Drop "
            "`assistant_ensemble_weight`, or use plain transformers generate for the ensemble."
        )
    defaults = getattr(GenerationConfig, "_get_default_generation_params", dict)()  # what generate fills in if unset
    changed = {
        name: getattr(generation_config, name, None)
        for name in DRAFT_LENGTH_SETTINGS
        if getattr(generation_config, name, None) not in (None, defaults.get(name))
    }
    if changed:
        logger.warning_once(
            "%s: transformers' assisted-generation settings do not apply to hf_dynspec's loop, whose draft-length "
            "policy chooses each row's length (at most `DynSpecConfig.num_speculative_tokens`). Set that, or choose "
            "the `heuristic` or `confidence` policy for transformers' rules.",
            ", ".join(f"{name}={value!r}" for name, value in changed.items()),
        )


def _check_model(model: PreTrainedModel, who: str) -> None:
    unloaded = unloaded_parameters(model)
    if unloaded:
        raise ValueError(
            f"The {who} has {len(unloaded)} parameters on the meta device with no accelerate hook to load them "
            f"({', '.join(unloaded[:3])}{', ...' if len(unloaded) > 3 else ''}), so it cannot run. Load its weights, "
            "e.g. from_pretrained(..., device_map=...) with max_memory / offload_folder for offload, or dispatch it "
            "with accelerate's dispatch_model or cpu_offload."
        )
    if model.config.is_encoder_decoder:
        raise ValueError(f"The {who} is an encoder-decoder model; hf_dynspec supports decoder-only models.")
    if getattr(model, "_is_stateful", False):
        raise ValueError(
            f"The {who} ({type(model).__name__}) is stateful (recurrent state), so its cache cannot drop rejected "
            "tokens; speculative decoding needs a model whose KV cache can be cropped."
        )
    if not model._supports_default_dynamic_cache():
        raise ValueError(
            f"The {who} ({type(model).__name__}) does not support transformers' dynamic KV cache, which the "
            "speculative loop crops and compacts; use a model with standard KV caching."
        )


def _check_inputs(input_ids: torch.LongTensor, model_kwargs: dict, generation_config: GenerationConfig) -> None:
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise ValueError(
            "The speculative loop needs `input_ids` of shape (batch, prompt_length) with at least one token "
            "(prompts given only as `inputs_embeds` are not supported)."
        )
    mask = model_kwargs.get("attention_mask")
    if mask is not None and bool((mask[:, -1] == 0).any()):
        raise ValueError(
            "Right padding detected (attention_mask ends with 0 in some rows). Decoder-only generation needs left "
            "padding: load the tokenizer with padding_side='left'."
        )
    if generation_config.max_length is None:
        raise ValueError("max_length is unset: call the loop through `generate`, which prepares it, or set it.")
    if generation_config.max_length <= input_ids.shape[1]:
        raise ValueError(
            f"max_length ({generation_config.max_length}) leaves no room after the {input_ids.shape[1]}-token "
            "prompt; set max_new_tokens >= 1."
        )


def _check_pad(model: PreTrainedModel, generation_config: GenerationConfig) -> None:
    """The pad id fills draft slots a row leaves empty, which the models read: it must be a token of the vocabulary."""
    pad = generation_config._pad_token_tensor
    vocab = model.config.get_text_config().vocab_size
    if pad is not None and not 0 <= int(pad) < vocab:
        raise ValueError(
            f"pad_token_id={int(pad)} is not a token of the target's vocabulary (0 to {vocab - 1}); the speculative loop "
            "feeds it to the models in place of draft tokens a row does not have. Set pad_token_id to a token of the "
            "vocabulary (commonly the EOS id), or resize the model's embeddings to the tokenizer."
        )


STATEFUL_PROCESSORS = (UnbatchedClassifierFreeGuidanceLogitsProcessor,)
"""Logits processors that keep state across calls (classifier-free guidance runs the model on its own cache): the loop
scores many candidate prefixes per step, which would corrupt that state."""


def _check_logits_processors(processors: Iterable) -> None:
    """Raise a clear error for logits processors the loop cannot apply to speculative prefixes."""
    stateful = sorted({type(p).__name__ for p in processors if isinstance(p, STATEFUL_PROCESSORS)})
    if stateful:
        raise ValueError(
            f"{stateful} keep state from one call to the next (classifier-free guidance, `guidance_scale`, runs the "
            "model on a cache of its own), while the speculative loop scores several draft prefixes per step; the "
            "output would not match plain decoding. Generate without `guidance_scale`, or with plain `generate`."
        )
