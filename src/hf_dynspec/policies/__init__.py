"""Policies that choose each row's draft length every step.

`build_policy(config)` turns a [`DynSpecConfig`] into a policy object; `POLICIES` maps names to builders.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..config import DynSpecConfig
from .base import DraftLengthPolicy, PolicyInput, StepFeedback
from .static import StaticPolicy


def _build_static(config: DynSpecConfig, options: dict[str, Any]) -> DraftLengthPolicy:
    if options:
        raise ValueError(f"The 'static' policy takes no `policy_options`, got {sorted(options)}.")
    return StaticPolicy(config.num_speculative_tokens)


POLICIES: dict[str, Callable[[DynSpecConfig, dict[str, Any]], DraftLengthPolicy]] = {
    "static": _build_static,
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


__all__ = ["DraftLengthPolicy", "PolicyInput", "StepFeedback", "StaticPolicy", "POLICIES", "build_policy"]
