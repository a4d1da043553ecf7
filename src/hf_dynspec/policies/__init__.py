"""Policies that choose each row's draft length every step.

`build_policy(config)` turns a [`DynSpecConfig`] into a policy object; `POLICIES` maps names to builders, each taking
the config and a copy of `config.policy_options`:

| name          | decides from                                            | `policy_options`                               |
|---------------|---------------------------------------------------------|------------------------------------------------|
| `static`      | nothing: always the maximum                             | none                                           |
| `threshold`   | the number of active rows                               | `batch_size_threshold`, `num_speculative_tokens` |
| `batch_table` | the number of active rows, through a vLLM table          | vLLM's speculative config, or `vllm_config`; `outside_ranges` |
| `goodput`     | acceptance per row, step costs, remaining budgets        | see `GoodputSettings`                          |
| `confidence`  | the draft's probability of each token it proposes        | see `ConfidenceSettings`, `num_speculative_tokens` |
| `heuristic`   | each row's last step (transformers' +2 / -1)             | `initial_tokens`                               |

The full description is in `docs/policies.md`.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from ..config import DynSpecConfig
from .base import DraftLengthPolicy, PolicyInput, PrefillFeedback, StepFeedback, parameter_ratio
from .batch_table import SCHEDULE_KEY, BatchTablePolicy
from .confidence import ConfidencePolicy, ConfidenceSettings, ConfidenceStopper
from .goodput import GoodputPolicy
from .goodput_settings import GoodputSettings
from .heuristic import HeuristicPolicy
from .search import best_draft_lengths
from .static import StaticPolicy
from .threshold import ThresholdPolicy

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def _check_keys(policy: str, options: dict[str, Any], known: set[str]) -> None:
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"Unknown `policy_options` {unknown} for the {policy!r} policy; valid options are {sorted(known)}.")


def _build_static(config: DynSpecConfig, options: dict[str, Any]) -> DraftLengthPolicy:
    if options:
        raise ValueError(f"The 'static' policy takes no `policy_options`, got {sorted(options)}.")
    return StaticPolicy(config.num_speculative_tokens)


def _build_threshold(config: DynSpecConfig, options: dict[str, Any]) -> DraftLengthPolicy:
    _check_keys("threshold", options, {"batch_size_threshold", "num_speculative_tokens"})
    if "batch_size_threshold" not in options:
        raise ValueError("The 'threshold' policy needs `policy_options={'batch_size_threshold': N}`.")
    return ThresholdPolicy(options["batch_size_threshold"], options.get("num_speculative_tokens"))


def _build_batch_table(config: DynSpecConfig, options: dict[str, Any]) -> DraftLengthPolicy:
    """`policy_options` is vLLM's speculative config itself, or `{"vllm_config": dict | path | JSON text}`."""
    outside = options.pop("outside_ranges", "maximum")
    if "vllm_config" in options:
        _check_keys("batch_table", options, {"vllm_config"})
        policy = BatchTablePolicy.from_vllm_config(options["vllm_config"], outside)
    elif SCHEDULE_KEY in options:
        policy = BatchTablePolicy.from_vllm_config(options, outside)
    else:
        raise ValueError(
            f"The 'batch_table' policy needs vLLM's speculative config in `policy_options` (with `num_speculative_tokens`"
            f" and `{SCHEDULE_KEY}`) or `policy_options={{'vllm_config': <dict, JSON file or JSON text>}}`."
        )
    if policy.num_speculative_tokens > config.num_speculative_tokens:
        raise ValueError(
            f"The batch table's maximum (num_speculative_tokens={policy.num_speculative_tokens}) exceeds "
            f"DynSpecConfig.num_speculative_tokens={config.num_speculative_tokens}; set "
            f"DynSpecConfig(num_speculative_tokens={policy.num_speculative_tokens}) so the loop can draft that many."
        )
    return policy


def _build_goodput(config: DynSpecConfig, options: dict[str, Any]) -> DraftLengthPolicy:
    return GoodputPolicy(GoodputSettings.from_options(options))


def _build_confidence(config: DynSpecConfig, options: dict[str, Any]) -> DraftLengthPolicy:
    known = {f.name for f in fields(ConfidenceSettings)}
    _check_keys("confidence", options, known | {"num_speculative_tokens"})
    length = options.pop("num_speculative_tokens", None)
    return ConfidencePolicy(ConfidenceSettings(**options), length)


def _build_heuristic(config: DynSpecConfig, options: dict[str, Any]) -> DraftLengthPolicy:
    _check_keys("heuristic", options, {"initial_tokens"})
    return HeuristicPolicy(options.get("initial_tokens"))


POLICIES: dict[str, Callable[[DynSpecConfig, dict[str, Any]], DraftLengthPolicy]] = {
    "static": _build_static,
    "threshold": _build_threshold,
    "batch_table": _build_batch_table,
    "goodput": _build_goodput,
    "confidence": _build_confidence,
    "heuristic": _build_heuristic,
}


def build_policy(config: DynSpecConfig, policy: DraftLengthPolicy | None = None) -> DraftLengthPolicy:
    """The policy named by `config.policy`, built with `config.policy_options` (or `policy` itself if given)."""
    if policy is not None:
        if not isinstance(policy, DraftLengthPolicy):
            raise ValueError(f"`dynspec_policy` must be a DraftLengthPolicy, got {type(policy).__name__}.")
        return policy
    if config.policy not in POLICIES:
        raise ValueError(f"Unknown policy {config.policy!r} in DynSpecConfig.policy; choose one of {sorted(POLICIES)}.")
    return POLICIES[config.policy](config, dict(config.policy_options))


_LEARNED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Per target model: the `goodput` policies built from a config, keyed by the config and the draft model, so that a
policy's cost model and pooled acceptance survive from one `generate` call to the next (as transformers' assisted
generation keeps its heuristic draft length on the draft's generation config)."""


def learned_policy(
    model: PreTrainedModel,
    draft: PreTrainedModel | None,
    config: DynSpecConfig,
    policy: DraftLengthPolicy | None,
    engine: str = "generate",
) -> DraftLengthPolicy:
    """`policy` if given; a learning policy remembered for this (target, draft, config, engine); else a new one.
    `engine` keeps apart policies whose steps cost differently: `generate`'s loop and continuous batching."""
    if policy is not None or config.policy != "goodput":
        return build_policy(config, policy)
    learned = _LEARNED.setdefault(model, {})
    key = (id(draft), json.dumps(config.to_dict(), sort_keys=True, default=str), engine)
    if key not in learned:
        learned[key] = build_policy(config)
    return learned[key]


__all__ = [
    "DraftLengthPolicy",
    "PolicyInput",
    "PrefillFeedback",
    "StepFeedback",
    "StaticPolicy",
    "ThresholdPolicy",
    "BatchTablePolicy",
    "GoodputPolicy",
    "GoodputSettings",
    "ConfidencePolicy",
    "ConfidenceSettings",
    "ConfidenceStopper",
    "HeuristicPolicy",
    "best_draft_lengths",
    "POLICIES",
    "build_policy",
    "learned_policy",
    "parameter_ratio",
]
