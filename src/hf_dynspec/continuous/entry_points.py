"""The entry points of speculation under continuous batching: `init_continuous_batching` and `generate_batch`.

They choose the requests' proposer from the arguments (a draft model, prompt lookup, a model-free source of
`candidates.sources`, or a source beside the draft model), the policy (`policies.learned_policy`, kept per target
across managers) and coupled sampling's streams, and hand them to a `SpeculativeManager`.
"""

from __future__ import annotations

from typing import Any

from transformers import ContinuousBatchingConfig, GenerationConfig, PreTrainedModel

from ..candidates.sources import SourceContext, build_source, source_name
from ..config import DynSpecConfig
from ..coupling import StreamBook, call_seed
from ..eagle3 import StateHead
from ..heads import head_for
from ..policies import learned_policy
from ..validation import check_vocabularies
from .engine import GenerationOutput, workload_hints
from .hybrid import HybridRequests
from .manager import SpeculativeManager, check_attention
from .paged_draft import PagedDraftRequests, paged_implementation
from .paged_head import PagedHeadRequests
from .proposers import ModelFreeRequests, RequestProposer
from .speculator import Speculator


def init_continuous_batching(
    model: PreTrainedModel,
    assistant_model: PreTrainedModel | None = None,
    *,
    prompt_lookup_num_tokens: int | None = None,
    dynspec_config: DynSpecConfig | dict | str | None = None,
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    workload_hints: Any = None,
) -> SpeculativeManager:
    """A continuous-batching manager for `model` whose steps speculate: `model.init_continuous_batching`'s manager
    (start it, add requests, read results, stop it), with every decoding request's draft length chosen each step.

    Drafts come from `assistant_model` (a draft model sharing the target's vocabulary, in a paged cache of its own:
    `PagedDraftRequests`), from prompt lookup (`prompt_lookup_num_tokens`, the most draft tokens a request proposes in
    a step) or, with `DynSpecConfig(proposer="suffix")`, from suffix trees over every request's prompt and output
    (the `suffix` extra). With `assistant_model`, each request drafts each step a copy from its context (suffix trees
    with the `suffix` extra or `proposer="suffix"`, prompt lookup with `proposer="hybrid"` or without the extra) or
    from the draft model, as the policy decides; `proposer="draft"` drafts from the draft model alone. Greedy outputs
    equal those of `model.generate_batch`; sampled ones follow the same distribution.

    Example:

    ```python
    >>> import hf_dynspec
    >>> manager = hf_dynspec.init_continuous_batching(model, draft)
    >>> manager.start()
    >>> request_id = manager.add_request(input_ids, max_new_tokens=64)
    >>> output = next(manager.request_id_iter(request_id))
    >>> manager.stop()
    ```
    """
    config = DynSpecConfig.coerce(dynspec_config)
    generation_config = generation_config if generation_config is not None else model.generation_config
    if getattr(generation_config, "num_beams", 1) not in (None, 1):
        raise ValueError("Continuous batching does not run beam search: set `num_beams=1`.")
    if config.reuse_rollouts and prompt_lookup_num_tokens is not None:
        raise ValueError(
            "DynSpecConfig(reuse_rollouts=True) proposes from the rollout cache (beside the assistant model, if one is "
            "given); drop `prompt_lookup_num_tokens`."
        )
    proposer, max_draft = _request_proposer(model, config, prompt_lookup_num_tokens, assistant_model)
    policy = learned_policy(model, proposer.model, config, None, engine="continuous_batching")
    if config.tree_node_budget:
        _check_tree_attention(model)
    coupled = config.sampling == "coupled"
    streams = StreamBook(call_seed(config.seed, config.reuse_rollouts), config.coupling_keys) if coupled else None
    speculator = Speculator(model, proposer, policy, max_draft, config.tree_node_budget, streams)
    if config.reuse_rollouts:
        _reuse_rollouts(speculator, model, config)
    return SpeculativeManager(
        model,
        generation_config,
        continuous_batching_config if continuous_batching_config is not None else ContinuousBatchingConfig(),
        workload_hints,
        speculator=speculator,
    )


def _reuse_rollouts(speculator: Speculator, model: PreTrainedModel, config: DynSpecConfig) -> None:
    """Give the speculator's proposer the rollout cache: alone, or beside a draft model (`HybridRequests`)."""
    if config.tree_node_budget or config.proposer != "auto":
        raise ValueError(
            "DynSpecConfig(reuse_rollouts=True) proposes chains from the rollout cache, beside the assistant model "
            "when one is given: set `tree_node_budget=0` and proposer='auto'."
        )
    proposer = speculator.proposer
    source = build_source("rollout", SourceContext(model, config, speculator.streams.assign))
    rollouts = ModelFreeRequests(source, config.prompt_lookup_max_tokens)
    if isinstance(proposer, PagedDraftRequests):
        speculator.proposer = HybridRequests(rollouts, proposer, config.prompt_lookup_max_tokens)
    else:
        speculator.proposer = rollouts
        speculator.max_draft_tokens = config.num_speculative_tokens


def _request_proposer(
    model: PreTrainedModel,
    config: DynSpecConfig,
    prompt_lookup_num_tokens: int | None,
    assistant_model: PreTrainedModel | None,
) -> tuple[RequestProposer, int]:
    """The proposer the arguments ask for, and the most draft tokens a request proposes in a step."""
    if assistant_model is None and config.draft_head is not None:
        assistant_model = head_for(model, config.draft_head)
    if assistant_model is not None:
        return _draft_proposer(model, config, prompt_lookup_num_tokens, assistant_model), config.num_speculative_tokens
    if config.proposer == "suffix":
        if prompt_lookup_num_tokens is not None:
            raise ValueError(
                "DynSpecConfig(proposer='suffix') drafts from suffix trees: drop `prompt_lookup_num_tokens`."
            )
        return ModelFreeRequests(build_source("suffix", SourceContext(model, config))), config.num_speculative_tokens
    if config.proposer != "auto":
        raise ValueError(
            f"DynSpecConfig(proposer={config.proposer!r}) needs a draft model: pass `assistant_model`, or use "
            "proposer='auto' with `prompt_lookup_num_tokens`, or proposer='suffix'."
        )
    if prompt_lookup_num_tokens is None and (config.reuse_rollouts or config.sampling == "coupled"):
        prompt_lookup_num_tokens = config.prompt_lookup_max_tokens  # a proposer of the config's own
    if prompt_lookup_num_tokens is None:
        raise ValueError(
            "Say where draft tokens come from: `assistant_model` (a draft model), `prompt_lookup_num_tokens=N` "
            "(prompt lookup, up to N tokens a step), or `dynspec_config=DynSpecConfig(proposer='suffix')`."
        )
    if not isinstance(prompt_lookup_num_tokens, int) or prompt_lookup_num_tokens < 1:
        raise ValueError(f"`prompt_lookup_num_tokens` must be a positive integer, got {prompt_lookup_num_tokens!r}.")
    lookup = ModelFreeRequests(build_source("lookup", SourceContext(model, config)))
    return lookup, min(config.num_speculative_tokens, prompt_lookup_num_tokens)


def _draft_proposer(
    model: PreTrainedModel,
    config: DynSpecConfig,
    prompt_lookup_num_tokens: int | None,
    assistant_model: PreTrainedModel,
) -> PagedDraftRequests | HybridRequests:
    """A draft model's proposer: alone with proposer='draft' or token trees; otherwise beside prompt lookup or suffix
    trees (`HybridRequests`; `candidates.sources.source_name` says which)."""
    if prompt_lookup_num_tokens is not None:
        raise ValueError(
            "Under continuous batching a draft model takes no `prompt_lookup_num_tokens`: drop it, and use "
            "DynSpecConfig(proposer='hybrid') for prompt lookup beside the draft model (up to "
            "`prompt_lookup_max_tokens` tokens a step)."
        )
    check_vocabularies(model, assistant_model)
    check_attention(assistant_model)
    paged_implementation(assistant_model)
    if isinstance(assistant_model, StateHead):
        draft = PagedHeadRequests(assistant_model, model, config.tree_branching, config.tree_min_node_probability)
    else:
        draft = PagedDraftRequests(assistant_model, config.tree_branching, config.tree_min_node_probability)
    alone = config.proposer == "draft" or config.tree_node_budget or config.reuse_rollouts  # rollouts join later
    if alone or config.num_speculative_tokens == 0:
        return draft
    free = ModelFreeRequests(build_source(source_name(config), SourceContext(model, config)))
    return HybridRequests(free, draft, config.prompt_lookup_max_tokens)


def generate_batch(
    model: PreTrainedModel,
    inputs: list[list[int]],
    *,
    assistant_model: PreTrainedModel | None = None,
    prompt_lookup_num_tokens: int | None = None,
    dynspec_config: DynSpecConfig | dict | str | None = None,
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    **kwargs: Any,
) -> dict[str, GenerationOutput]:
    """`model.generate_batch(inputs, ...)` with speculation: request id -> `GenerationOutput`, in input order.

    Takes `model.generate_batch`'s other arguments (`max_new_tokens`, `record_timestamps`, `progress_bar`,
    `persistent_manager`, ...) and the proposer arguments of `init_continuous_batching`.
    """
    if not inputs:
        return {}
    generation_config = generation_config if generation_config is not None else model.generation_config
    manager = init_continuous_batching(
        model,
        assistant_model,
        prompt_lookup_num_tokens=prompt_lookup_num_tokens,
        dynspec_config=dynspec_config,
        generation_config=generation_config,
        continuous_batching_config=continuous_batching_config,
        workload_hints=_workload_hints(inputs, generation_config, kwargs.get("max_new_tokens")),
    )
    # `model.generate_batch` runs the manager cached on the model: lend it ours for the call.
    cached = getattr(model, "_cached_continuous_batching_manager", None)
    model._cached_continuous_batching_manager = manager
    try:
        return model.generate_batch(inputs, generation_config=generation_config, **kwargs)
    finally:
        kept = kwargs.get("persistent_manager", False)
        if not kept:
            if cached is None:
                model.__dict__.pop("_cached_continuous_batching_manager", None)
            else:
                model._cached_continuous_batching_manager = cached


def _workload_hints(inputs: list[list[int]], generation_config: GenerationConfig, max_new_tokens: int | None) -> Any:
    """transformers' sizing hints for `inputs`, as `model.generate_batch` gives them."""
    new_tokens = max_new_tokens if max_new_tokens is not None else generation_config.max_new_tokens
    returns = generation_config.num_return_sequences or 1
    return workload_hints(max(len(ids) for ids in inputs), new_tokens if new_tokens is not None else 0, len(inputs) * returns)


def _check_tree_attention(model: PreTrainedModel) -> None:
    """Token trees need an attention that takes a mask (eager or SDPA over the paged cache)."""
    implementation = str(model.config._attn_implementation)
    if "flash" in implementation or "flex" in implementation:
        raise ValueError(
            f"Token trees under continuous batching need an attention implementation that takes a mask, and "
            f"{implementation!r} runs causal sequences only: load the model with attn_implementation='sdpa' or "
            "'eager', or set `tree_node_budget=0` for chains."
        )
