"""The model-free sources both engines build by name: one line each.

A source is a `free.ModelFreeSource` in a module of its own; registering it here makes it available to `generate`'s
loop (through `free.ModelFreeProposer`, alone or beside the draft model in `hybrid.HybridProposer`) and to continuous
batching (`hf_dynspec.continuous.proposers.ModelFreeRequests`, alone or in `HybridRequests`) at once.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from ..config import DynSpecConfig
from .free import ModelFreeSource
from .prompt_lookup import LookupSource
from .rollout import RolloutSettings, RolloutSource, rollout_cache_for
from .suffix import SuffixCache, SuffixSettings, SuffixSource, suffix_cache_for


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
    "call_suffix": lambda c: SuffixSource(SuffixCache(SuffixSettings.from_config(c.config))),
    "rollout": lambda c: RolloutSource(
        rollout_cache_for(c.model, RolloutSettings.from_config(c.config)), c.stream_of, c.config.coupling_keys,
        c.across_ranks,
    ),
}
"""Name -> how to build the source from a `SourceContext`. `suffix` keeps its trees across calls, per target model
(`suffix.suffix_cache_for`); `call_suffix`, the default's copies, only over the call's own rows (the manager's
requests under continuous batching), so that a call's proposals, and with a seed its samples, do not depend on
earlier calls."""


def suffix_installed() -> bool:
    """Whether suffix trees can be built (the `suffix` extra: arctic-inference)."""
    return importlib.util.find_spec("arctic_inference") is not None


def source_name(config: DynSpecConfig) -> str:
    """The model-free source `config` asks for beside (or instead of) the draft model: the rollout cache
    (`reuse_rollouts`), suffix trees (`proposer="suffix"`; over the call's own rows for the default `"auto"` when the
    `suffix` extra is installed), else prompt lookup."""
    if config.reuse_rollouts:
        return "rollout"
    if config.proposer == "suffix":
        return "suffix"
    return "call_suffix" if config.proposer == "auto" and suffix_installed() else "lookup"


def build_source(name: str, context: SourceContext) -> ModelFreeSource:
    """The source registered as `name`, built from `context`."""
    if name not in SOURCES:
        raise ValueError(f"Unknown model-free source {name!r}; registered: {sorted(SOURCES)}.")
    return SOURCES[name](context)
