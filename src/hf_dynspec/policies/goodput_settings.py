"""The `goodput` policy's settings (`policy_options`) and what they build: its cost model and its early stop."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..budget import LossBudget
from ..cost_models import OnlineCostModel, Profile, ProfileCostModel, StepCostModel
from ..estimators import check_int, check_open_unit, check_positive
from .confidence import ConfidenceSettings, ConfidenceStopper

COST_MODELS = ("online", "profile")
MARGINAL_STOP = "marginal"


@dataclass
class GoodputSettings:
    """`policy_options` of the `goodput` policy."""

    cost_model: str = field(
        default="online",
        metadata={"help": "'online' (learn step costs from the loop's timings) or 'profile' (a saved calibration)."},
    )
    profile: str | dict | None = field(
        default=None,
        metadata={"help": "Calibration profile (path or dict): required by 'profile', the starting point of 'online'."},
    )
    prior_acceptance: float = field(default=0.6, metadata={"help": "Acceptance assumed before anything is observed."})
    prior_weight: float = field(default=4.0, metadata={"help": "Weight of the prior, in draft tokens."})
    acceptance_decay: float = field(
        default=0.95, metadata={"help": "Per-step decay of a row's acceptance counts (drafting or not) and the pooled ones."}
    )
    window: int = field(default=9, metadata={"help": "Online costs: recent samples kept per knot (the fastest counts)."})
    tolerance: float = field(
        default=0.25, metadata={"help": "Online costs: a point counts as measured within a factor 1 + tolerance."}
    )
    explore_interval: int = field(default=16, metadata={"help": "Online costs: steps between gap measurements."})
    warmup_steps: int = field(default=1, metadata={"help": "Online costs: first observed steps to ignore."})
    confirm_samples: int = field(
        default=3, metadata={"help": "Online costs: samples before a knot may cost more than its neighbours predict."}
    )
    probe_z: float = field(
        default=2.0,
        metadata={"help": "Standard deviations added to acceptance by the optimistic search, which names the option "
                  "worth measuring (and the rows an online cost model may explore)."},
    )
    confidence_z: float = field(
        default=1.0,
        metadata={"help": "Standard deviations taken off acceptance when judging whether speculation repays a step "
                  "that the loss budget alone would not allow."},
    )
    stale_after: int = field(
        default=64, metadata={"help": "Online costs: steps after which a knot's samples no longer confirm it."}
    )
    min_gain: float = field(default=0.0, metadata={"help": "Relative margin speculation must win by over plain steps."})
    loss_budget: float | None = field(
        default=0.05,
        metadata={"help": "Largest fraction of plain decoding's time speculation may lose, over every call the policy "
                  "serves (0 <= x < 1); None: no budget (the search alone decides)."},
    )
    lookup_prior_acceptance: float = field(
        default=0.5, metadata={"help": "Hybrid proposer: prompt-lookup acceptance assumed before anything is observed."}
    )
    copy_anchor: int = field(
        default=4,
        metadata={"help": "Hybrid proposer: a lookup continuation whose row already shares at least this many final "
                  "tokens with its source is a copy, with an acceptance estimate of its own (0: no such class)."},
    )
    copy_prior_acceptance: float = field(
        default=0.9, metadata={"help": "Hybrid proposer: acceptance of copies assumed before any is observed."}
    )
    tree_slack: float = field(
        default=0.15,
        metadata={"help": "Token trees: nodes are added while the verify forward costs at most this fraction more "
                  "than for a chain of the chosen depth (the target's nearly free slots)."},
    )
    early_stop: dict | bool | str | None = field(
        default=None,
        metadata={"help": "'marginal': each row drafts while its next token's expected tokens per second beat the "
                  "step's (see `continue_drafting`); true or a dict of `confidence` options: the confidence "
                  "threshold stop; off if None."},
    )

    def __post_init__(self) -> None:
        if self.cost_model not in COST_MODELS:
            raise ValueError(f"`cost_model` must be one of {list(COST_MODELS)}, got {self.cost_model!r}.")
        if self.cost_model == "profile" and self.profile is None:
            raise ValueError("`cost_model='profile'` needs `profile` (a path or dict written by `hf-dynspec calibrate`).")
        if self.profile is not None and not isinstance(self.profile, (str, Path, dict)):
            raise ValueError(f"`profile` must be a path or a dict, got {type(self.profile).__name__}.")
        check_open_unit("prior_acceptance", self.prior_acceptance)
        check_open_unit("lookup_prior_acceptance", self.lookup_prior_acceptance)
        check_open_unit("copy_prior_acceptance", self.copy_prior_acceptance)
        check_int("copy_anchor", self.copy_anchor, 0)
        check_positive("prior_weight", self.prior_weight)
        decay = self.acceptance_decay
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 < decay <= 1:
            raise ValueError(f"`acceptance_decay` must be a number in (0, 1], got {decay!r}.")
        check_int("window", self.window, 1)
        check_positive("tolerance", self.tolerance)
        check_int("explore_interval", self.explore_interval, 1)
        check_int("warmup_steps", self.warmup_steps, 0)
        check_int("confirm_samples", self.confirm_samples, 1)
        _check_number("min_gain", self.min_gain, 0.0)
        _check_number("probe_z", self.probe_z, 0.0)
        _check_number("confidence_z", self.confidence_z, 0.0)
        _check_number("tree_slack", self.tree_slack, 0.0)
        check_int("stale_after", self.stale_after, 1)
        LossBudget(self.loss_budget)  # validates
        stop = self.early_stop
        if stop is not None and stop != MARGINAL_STOP and not isinstance(stop, (bool, dict)):
            raise ValueError(
                f"`early_stop` must be None, '{MARGINAL_STOP}', a bool or a dict of confidence options, got {stop!r}."
            )

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> GoodputSettings:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"Unknown `goodput` policy option(s) {unknown}; valid options are {sorted(known)}.")
        return cls(**options)


def build_cost_model(settings: GoodputSettings) -> StepCostModel:
    """The cost model `settings` ask for: a saved calibration, or one learned online (from the calibration if any)."""
    profile = Profile.load(settings.profile) if settings.profile is not None else None
    if settings.cost_model == "profile":
        return ProfileCostModel(profile)
    return OnlineCostModel(
        window=settings.window,
        tolerance=settings.tolerance,
        explore_interval=settings.explore_interval,
        warmup_steps=settings.warmup_steps,
        confirm_samples=settings.confirm_samples,
        profile=profile,
        stale_after=settings.stale_after,
    )


def build_stopper(early_stop: dict | bool | str | None) -> ConfidenceStopper | None:
    """The confidence stopper `early_stop` asks for (`None`: no early stop)."""
    if early_stop is None or early_stop is False:
        return None
    if early_stop is True:
        return ConfidenceStopper()
    if early_stop == MARGINAL_STOP:
        return ConfidenceStopper(ConfidenceSettings(adaptive=False))  # records judged tokens for the calibration
    known = {f.name for f in fields(ConfidenceSettings)}
    unknown = sorted(set(early_stop) - known)
    if unknown:
        raise ValueError(f"Unknown `early_stop` option(s) {unknown}; valid options are {sorted(known)}.")
    return ConfidenceStopper(ConfidenceSettings(**early_stop))


def _check_number(name: str, value: Any, minimum: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < minimum:
        raise ValueError(f"`{name}` must be a finite number >= {minimum}, got {value!r}.")
