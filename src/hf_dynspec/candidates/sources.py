"""The model-free sources both engines build by name: one line each.

A source is a `free.ModelFreeSource` in a module of its own; registering it here makes it available to `generate`'s
loop (through `free.ModelFreeProposer`, alone or beside the draft model in `hybrid.HybridProposer`) and to continuous
batching (`hf_dynspec.continuous.proposers.ModelFreeRequests`, alone or in `HybridRequests`) at once.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

from ..config import DynSpecConfig
from .free import ModelFreeSource
from .prompt_lookup import LookupSource
from .rollout import RolloutSettings, RolloutSource, rollout_cache_for
from .suffix import SuffixSettings, SuffixSource, suffix_cache_for


@dataclass(frozen=True)
class SourceContext:
    """What a source may be built from."""

    model: object  # the target model, whose caches (suffix trees, rollouts) persist across calls
    config: DynSpecConfig
    stream_of: Callable[[Hashable, list[int]], int] | None = None  # a row's coupled-sampling stream (rollouts)
    across_ranks: bool = False  # rows of other ranks of a data-parallel run share the source's caches (rollouts)


SOURCES: dict[str, Callable[[SourceContext], ModelFreeSource]] = {
    "lookup": lambda c: LookupSource(c.config.prompt_lookup_max_ngram, c.config.prompt_lookup_min_ngram),
    "suffix": lambda c: SuffixSource(suffix_cache_for(c.model, SuffixSettings.from_config(c.config))),
    "rollout": lambda c: RolloutSource(
        rollout_cache_for(c.model, RolloutSettings.from_config(c.config)), c.stream_of, c.config.coupling_keys,
        c.across_ranks,
    ),
}
"""Name -> how to build the source from a `SourceContext`."""


def source_name(config: DynSpecConfig) -> str:
    """The model-free source `config` asks for: the rollout cache (`reuse_rollouts`), suffix trees
    (`proposer="suffix"`), else prompt lookup."""
    if config.reuse_rollouts:
        return "rollout"
    return "suffix" if config.proposer == "suffix" else "lookup"


def build_source(name: str, context: SourceContext) -> ModelFreeSource:
    """The source registered as `name`, built from `context`."""
    if name not in SOURCES:
        raise ValueError(f"Unknown model-free source {name!r}; registered: {sorted(SOURCES)}.")
    return SOURCES[name](context)
