"""What the `goodput` policy knows of costs: the time of a step, from a calibration or learned online.

Costs (`StepCostModel`): the time of one step as a function of the batch size and the per-row draft lengths. The built
in models price what the loop really does: the draft runs `K = max_i k_i` forwards over the whole batch and the target
verifies `N = batch * (1 + K)` tokens (`K = 0` is a plain decoding step and the draft does not run):

    step_seconds(b, k) = verify(b * (1 + K)) + K * draft(b)

`verify` is piecewise linear in `N`, the number of tokens the target processes, and `draft` (one draft forward) is
piecewise linear in the batch size. `ProfileCostModel` builds both from a saved calibration [`Profile`];
`OnlineCostModel` learns them from the loop's own timings (the fastest recent sample per knot, made nondecreasing by
isotonic regression) and asks the policy to measure the points it lacks.
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .estimators import check_int, check_positive

if TYPE_CHECKING:
    from .policies.base import StepFeedback

PROFILE_FORMAT = "hf_dynspec.profile"
PROFILE_VERSION = 1


def isotonic_increasing(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Weighted least-squares nondecreasing fit of `values` (pool-adjacent-violators); shapes `[n]` -> `[n]`."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for value, weight in zip(values.tolist(), weights.tolist()):
        blocks.append([value, weight, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, c2 = blocks.pop()
            v1, w1, c1 = blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, c1 + c2])
    return np.array([value for value, _, count in blocks for _ in range(count)], dtype=np.float64)


@dataclass(frozen=True)
class PiecewiseLinear:
    """A nondecreasing function through knots `(xs[j], ys[j])`, linear between them.

    Below the first knot the value scales in proportion to `x` (`ys[0] * x / xs[0]`). Above the last knot it follows
    the line to `far`, a point measured far beyond the knots, when there is one; otherwise it continues along the
    last segment's slope, or stays flat when there is a single knot.
    """

    xs: np.ndarray  # [n] increasing, positive
    ys: np.ndarray  # [n] nondecreasing
    far: tuple[float, float] | None = None  # (x, value) beyond the last knot, or None

    @classmethod
    def fit(
        cls, points: dict[int, tuple[float, int]], far: tuple[float, float] | None = None
    ) -> PiecewiseLinear | None:
        """From `{x: (value, weight)}`: knots at the `x`s, values made nondecreasing by isotonic regression."""
        if not points:
            return None
        xs = np.array(sorted(points), dtype=np.float64)
        values = np.array([points[int(x)][0] for x in xs], dtype=np.float64)
        weights = np.array([points[int(x)][1] for x in xs], dtype=np.float64)
        return cls(xs, isotonic_increasing(values, weights), far)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        out = np.interp(x, self.xs, self.ys)
        below = x < self.xs[0]
        out[below] = self.ys[0] * x[below] / self.xs[0]
        above = x > self.xs[-1]
        out[above] = self.ys[-1] + self.tail_slope() * (x[above] - self.xs[-1])
        return out

    def tail_slope(self) -> float:
        """The slope above the last knot: toward `far` when it lies past the last knot (never negative); else the
        last segment's, or 0 with a single knot."""
        if self.far is not None and self.far[0] > self.xs[-1]:
            return max(0.0, (self.far[1] - self.ys[-1]) / (self.far[0] - self.xs[-1]))
        if self.xs.shape[0] == 1:
            return 0.0
        return float((self.ys[-1] - self.ys[-2]) / (self.xs[-1] - self.xs[-2]))


# ---- cost models ---------------------------------------------------------------------------------------------------
class StepCostModel(ABC):
    """Predicts the wall time of one step from the batch size and each row's draft length.

    A cost model used by `goodput` must be nondecreasing in every row's draft length.
    """

    @abstractmethod
    def step_seconds(self, batch_size: int, lengths: torch.LongTensor) -> float:
        """Seconds of a step where active row `j` drafts `lengths[j]` tokens (`[batch]`, all 0 = plain decoding)."""

    def candidate_seconds(self, batch_size: int, lengths: torch.LongTensor) -> torch.Tensor:
        """`[num_candidates]` float64 seconds of each candidate length vector in `lengths` (`[num_candidates, batch]`).

        Override for speed; the default calls `step_seconds` once per candidate.
        """
        return torch.tensor([self.step_seconds(batch_size, row) for row in lengths], dtype=torch.float64)

    def summary_seconds(self, batch_size: int, longest: np.ndarray, total: np.ndarray) -> np.ndarray | None:
        """`[n]` seconds of steps known only by their longest draft and their draft tokens over all rows (`[n]` each),
        or `None` when the model needs each row's length (the default; searches then build length vectors and call
        `candidate_seconds`). Override in models that depend on those two numbers only: `goodput`'s search then
        runs in time and memory linear in the batch size."""
        return None

    def observe(self, feedback: StepFeedback) -> None:
        """Learn from a finished step's timings (no-op for fixed models)."""

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """Learn from the call's target prefill, `seconds` over `tokens` target tokens, padding included (no-op)."""

    def exploration_length(self, batch_size: int, max_draft_tokens: int) -> int | None:
        """A draft length the model wants measured at this batch size next step, or `None` (fixed models: never)."""
        return None


class PaddedCostModel(StepCostModel):
    """`verify(b * (1 + K)) + K * draft(b)` with `K = max(lengths)`: the loop pads every row to the longest draft
    (`verify(b + sum(k))` when it packs verify forwards, `packed`).

    `verify` maps target tokens per forward to seconds, `draft` maps the batch size to seconds per draft forward;
    a missing `verify` costs one (arbitrary) second per step and a missing `draft` costs nothing.

    The call's target prefill (`observe_prefill`) is a forward far wider than any verify: past its last knot the
    verify curve follows the line to it (`PiecewiseLinear.far`) rather than its last segment. Knots a token or two
    apart (a batch's plain steps as its rows finish) say little about a verify several times wider; the prefill
    measures what each further token costs where the forward is compute-bound.
    """

    def __init__(
        self,
        verify: PiecewiseLinear | None,
        draft: PiecewiseLinear | None,
        rows_apart: bool = False,
        packed: bool = False,
    ) -> None:
        self.verify = verify
        self.draft = draft
        self.rows_apart = rows_apart
        """The draft runs each row in forwards of its own (`BatchedProposer.rows_apart`): a step's draft forwards
        are the sum of its rows' drafts, each over one row, instead of its longest draft over the whole batch."""
        self.packed = packed
        """The loop packs verify forwards (`hf_dynspec.packing`): a step's target computes `b + sum(k)` tokens, the
        real ones, instead of `b * (1 + K)`."""

    def set_packed(self, packed: bool) -> None:
        """Price verify forwards as packed (or padded); see `packed`."""
        self.packed = packed

    def draft_rows(self, batch_size: int) -> int:
        """Rows in each draft forward of a step at `batch_size` rows (the draft curve's knot that prices it)."""
        return 1 if self.rows_apart else batch_size

    def set_rows_apart(self, rows_apart: bool) -> None:
        """Price the draft as running each row apart (or the whole batch at once); see `rows_apart`."""
        self.rows_apart = rows_apart

    def draft_forward(self, rows: int) -> float:
        """Seconds of one draft forward over `rows` rows (0 without a draft curve): the draft curve, and past its last
        knot at least that knot scaled by the verify curve from its rows to `rows`. A forward's cost grows with its
        rows as the target's does, while the draft curve stays flat past a single knot: drafts timed at one row
        would price a forward over 16 rows at one row's cost."""
        if self.draft is None:
            return 0.0
        value = float(self.draft(np.array([float(rows)]))[0])
        last = float(self.draft.xs[-1])
        if rows > last and self.verify is not None:
            one, wide = self.verify(np.array([last, float(rows)]))
            value = max(value, float(self.draft.ys[-1]) * float(wide) / max(float(one), 1e-12))
        return value

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if self.verify is not None and tokens > 0 and seconds > 0:
            self.verify = replace(self.verify, far=(float(tokens), float(seconds)))

    def padded_seconds(
        self, batch_size: int, max_lengths: np.ndarray, totals: np.ndarray | None = None
    ) -> np.ndarray:
        """`[n]` seconds of steps whose longest draft is `max_lengths` (`[n]`) at `batch_size` active rows, with
        `totals` (`[n]`) draft tokens over all rows (default: every row drafts the longest)."""
        k = np.asarray(max_lengths, dtype=np.float64)
        tokens = batch_size * (1.0 + k)  # [n] target tokens of each step, padded to the longest draft
        if self.packed and totals is not None:
            tokens = batch_size + np.asarray(totals, dtype=np.float64)
        verify = self.verify(tokens) if self.verify is not None else np.ones_like(k)
        if self.draft is None:
            return verify
        per_forward = self.draft_forward(self.draft_rows(batch_size))
        if not self.rows_apart:
            return verify + k * per_forward
        return verify + (batch_size * k if totals is None else np.asarray(totals, dtype=np.float64)) * per_forward

    def step_seconds(self, batch_size: int, lengths: torch.LongTensor) -> float:
        longest = int(lengths.max()) if lengths.numel() else 0
        total = int(lengths.sum()) if lengths.numel() else 0
        return float(self.padded_seconds(batch_size, np.array([longest]), np.array([total]))[0])

    def candidate_seconds(self, batch_size: int, lengths: torch.LongTensor) -> torch.Tensor:
        values = lengths.detach().cpu().numpy()
        longest = values.max(axis=1) if values.shape[1] else np.zeros(values.shape[0])
        return torch.from_numpy(self.padded_seconds(batch_size, longest, values.sum(axis=1)))

    def summary_seconds(self, batch_size: int, longest: np.ndarray, total: np.ndarray) -> np.ndarray:
        return self.padded_seconds(batch_size, longest, total)


class ProfileCostModel(PaddedCostModel):
    """The padded cost model fitted to a saved calibration [`Profile`] (fixed: it does not learn)."""

    def __init__(self, profile: Profile) -> None:
        verify_points: dict[int, list[float]] = {}
        for timing in profile.target_forward:
            verify_points.setdefault(timing.batch_size * timing.tokens_per_row, []).append(timing.seconds)
        draft_points = {t.batch_size: [t.seconds] for t in profile.draft_forward}
        super().__init__(PiecewiseLinear.fit(_medians(verify_points)), PiecewiseLinear.fit(_medians(draft_points)))
        self.profile = profile


def draft_model_forwards(
    lengths: torch.LongTensor, free_rows: torch.BoolTensor | None, rows_apart: bool = False
) -> int:
    """Draft-model forwards of a step with draft `lengths` (`[batch]`): its longest draft among rows not served by
    prompt lookup (`free_rows`, a hybrid's lookup rows propose without a forward); with `rows_apart` (each row
    drafts in forwards of its own, `PaddedCostModel.rows_apart`) the sum of those rows' drafts."""
    if free_rows is not None:
        lengths = torch.where(free_rows.to(lengths.device), torch.zeros_like(lengths), lengths)
    if not lengths.numel():
        return 0
    return int(lengths.sum()) if rows_apart else int(lengths.max())


class OnlineCostModel(PaddedCostModel):
    """The padded cost model learned from the loop's own timings, with or without a starting profile.

    Knots: every distinct number of target tokens `N` seen in a verify forward, and every batch size seen in a step
    that drafted (its draft seconds divided by its longest draft). Each knot keeps its last `window` samples. A
    verify knot is worth the fastest of them (a draft knot their median, see `_fit`): on a shared machine
    interference only ever slows a step down, so the fastest recent run is the best estimate of what the step
    costs (the advice of Python's `timeit`); with symmetric noise this reads every knot a little low, which largely
    cancels in the comparisons between lengths that the policy makes. A knot with fewer than `confirm_samples` samples is provisional: it is worth
    at most what the confirmed knots predict there. That is optimism where evidence is thin: one slow step (another
    process on the machine, the draft catching up after plain steps) cannot make a length look expensive and be
    avoided for good; if the length really is expensive, choosing it again adds samples until the knot is
    confirmed at its true cost. The knots are then made nondecreasing by isotonic regression weighted by sample
    counts. A lasting change (longer KV caches) replaces a knot's old samples within `window` visits. A knot with
    fewer than `confirm_samples` samples younger than `stale_after` observed steps is *stale*: between fresh knots
    it is capped by their interpolation, and `optimistic()` also caps it by their extrapolation, so a length
    measured during a burst of interference from other processes, and avoided since, is tried (and measured) again
    when the policy probes, instead of being avoided for good.

    Exploration: before the knots bracket the current batch size (a knot near or below `N = b`, one near or above
    `N = b * (1 + max)`), `exploration_length` asks for a plain step or a maximal one; afterwards, every
    `explore_interval` steps, for the draft length whose `N` is farthest (more than a factor `1 + tolerance`) from
    every knot measured at least twice (a knot measured once is priced optimistically, so it is measured again). The first `warmup_steps` steps this model ever observes are ignored (lazy initialisation).
    """

    def __init__(
        self,
        window: int = 9,
        tolerance: float = 0.25,
        explore_interval: int = 16,
        warmup_steps: int = 1,
        confirm_samples: int = 3,
        profile: Profile | None = None,
        stale_after: int = 64,
    ) -> None:
        check_int("window", window, 1)
        check_int("confirm_samples", confirm_samples, 1)
        check_positive("tolerance", tolerance)
        check_int("explore_interval", explore_interval, 1)
        check_int("warmup_steps", warmup_steps, 0)
        check_int("stale_after", stale_after, 1)
        super().__init__(None, None)
        self.stale_after = stale_after
        self.window = window
        self.tolerance = float(tolerance)
        self.explore_interval = explore_interval
        self.warmup_steps = warmup_steps
        self.confirm_samples = confirm_samples
        self.verify_samples: dict[int, deque[tuple[float, int]]] = {}  # knot -> (seconds, step observed)
        self.draft_samples: dict[int, deque[tuple[float, int]]] = {}
        self.steps_observed = 0
        self._since_exploration = 0
        self.prefill_point: tuple[float, float] | None = None  # the call's target prefill: (tokens, seconds)
        self.draft_ratio: float | None = None
        """Draft/target cost ratio assumed before any draft knot is confirmed (the policy sets the parameter ratio):
        a draft knot with too few fresh samples is then worth at most this times a plain step at its batch size."""
        self.evidence = PaddedCostModel(None, None)
        """The knots as measured, without the optimism of provisional and stale knots: what the loss budget books
        steps at (a finished step's own timing is among the samples, so a cost measured once counts in full)."""
        if profile is not None:
            for timing in profile.target_forward:
                self._add(self.verify_samples, timing.batch_size * timing.tokens_per_row, timing.seconds)
            for timing in profile.draft_forward:
                self._add(self.draft_samples, timing.batch_size, timing.seconds)
            self._refit()

    def observe(self, feedback: StepFeedback) -> None:
        self.steps_observed += 1
        if self.steps_observed <= self.warmup_steps or feedback.batch_size == 0:
            return
        self._add(self.verify_samples, int(feedback.target_tokens), float(feedback.verify_seconds))
        forwards = draft_model_forwards(feedback.draft_lengths, feedback.free_rows, self.rows_apart)
        if forwards > 0 and feedback.draft_seconds > 0:
            self._add(self.draft_samples, self.draft_rows(feedback.batch_size), float(feedback.draft_seconds) / forwards)
        self._refit()

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.prefill_point = (float(tokens), float(seconds))
            self._refit()

    def set_rows_apart(self, rows_apart: bool) -> None:
        """As `PaddedCostModel.set_rows_apart`; draft knots learned the other way are keyed by other batch sizes, so
        a change forgets them."""
        if rows_apart != self.rows_apart:
            self.draft_samples.clear()
        self.rows_apart = rows_apart
        self._refit()

    def set_packed(self, packed: bool) -> None:
        """As `PaddedCostModel.set_packed`, for the measured knots (`evidence`) too."""
        self.packed = self.evidence.packed = packed

    def exploration_length(self, batch_size: int, max_draft_tokens: int) -> int | None:
        if max_draft_tokens <= 0:
            return None
        knots = np.array(sorted(self.verify_samples), dtype=np.float64)
        wanted = batch_size * (1.0 + np.arange(max_draft_tokens + 1))  # [max + 1] target tokens of each length
        slack = 1.0 + self.tolerance
        if knots.size == 0 or knots[0] > wanted[0] * slack:
            return 0
        if knots[-1] < wanted[-1] / slack:
            return max_draft_tokens
        self._since_exploration += 1
        if self._since_exploration < self.explore_interval:
            return None
        # A knot measured once is no knot here: its price is capped optimistically, and the loss budget (which books
        # the measurement) may keep the policy from ever choosing that length again, so only exploring it gives it
        # a second sample. Without this, a batch size's wide verify widths could stay priced at the narrow ones'.
        # (With `confirm_samples=1` one sample confirms a knot: nothing is capped, and every knot counts.)
        enough = min(2, self.confirm_samples)
        seen = np.array(sorted(k for k, v in self.verify_samples.items() if len(v) >= enough), dtype=np.float64)
        if seen.size:
            knots = seen
        gaps = np.abs(np.log(wanted[:, None] / knots[None, :])).min(axis=1)  # [max + 1]
        if gaps.max() <= math.log(slack):
            return None
        self._since_exploration = 0
        return int(gaps.argmax())

    def _add(self, samples: dict[int, deque[tuple[float, int]]], key: int, seconds: float) -> None:
        samples.setdefault(key, deque(maxlen=self.window)).append((seconds, self.steps_observed))

    def _refit(self) -> None:
        self.verify = self._fit(self.verify_samples, extrapolate=False, far=self.prefill_point)
        self.draft = self._fit(self.draft_samples, extrapolate=False, typical=True, prior=self._draft_prior(self.verify))
        self.evidence = PaddedCostModel(
            _as_measured(self.verify_samples, min, self.prefill_point),
            _as_measured(self.draft_samples, _median),
            self.rows_apart,
            self.packed,
        )

    def has_measured(self, tokens: int) -> bool:
        """Whether a knot with a fresh sample at or beyond `tokens` target tokens (within the tolerance) prices them."""
        fresh_from = self.steps_observed - self.stale_after
        return any(
            knot * (1.0 + self.tolerance) >= tokens and any(step > fresh_from for _, step in values)
            for knot, values in self.verify_samples.items()
        )

    def optimistic(self) -> PaddedCostModel:
        """The same knots with every stale one capped by what the fresh knots predict, even beyond their range."""
        verify = self._fit(self.verify_samples, True, far=self.prefill_point)
        draft = self._fit(self.draft_samples, True, typical=True, prior=self._draft_prior(verify))
        return PaddedCostModel(verify, draft, self.rows_apart, self.packed)

    def _draft_prior(self, verify: PiecewiseLinear | None) -> Callable[[np.ndarray], np.ndarray] | None:
        """`draft_ratio` times a plain step at each batch size (`None` while either is unknown)."""
        ratio = self.draft_ratio
        if ratio is None or verify is None:
            return None
        return lambda batch_sizes: ratio * verify(np.asarray(batch_sizes, dtype=np.float64))

    def _fit(
        self,
        samples: dict[int, deque[tuple[float, int]]],
        extrapolate: bool,
        typical: bool = False,
        prior: Callable[[np.ndarray], np.ndarray] | None = None,
        far: tuple[float, float] | None = None,
    ) -> PiecewiseLinear | None:
        """Fastest sample per knot (the median if `typical`); provisional knots capped at what the confirmed knots
        predict (within their range unless `extrapolate`), or at the `prior` while no knot is confirmed; isotonic fit,
        extended past its last knot toward `far`. The caps themselves extend the confirmed knots along their last
        segment (flat for one knot): optimism where evidence is thin, so a draft length measured once is tried again.

        Without the prior, one draft step timed slow (a burst of load) would price drafting out for good: a
        length never chosen again is never measured again.

        Draft knots take the median: a step's draft seconds per draft token vary with the content, not only with
        interference (where the draft's lookahead guess holds, one forward yields several tokens), so the fastest
        step would price every draft token at its luckiest."""
        fresh_from = self.steps_observed - self.stale_after
        points = _knot_points(samples, _median if typical else min)
        fresh = {key: sum(step > fresh_from for _, step in values) for key, values in samples.items()}
        base = PiecewiseLinear.fit({x: p for x, p in points.items() if fresh[x] >= self.confirm_samples})
        provisional = [x for x in points if fresh[x] < self.confirm_samples]
        if base is not None and not extrapolate:
            provisional = [x for x in provisional if len(samples[x]) < self.confirm_samples or base.xs[0] <= x <= base.xs[-1]]
        if base is None and prior is not None and provisional:
            caps = prior(np.array(provisional, dtype=np.float64))
            for x, cap in zip(provisional, caps.tolist()):
                points[x] = (min(points[x][0], cap), points[x][1])
        if base is not None and provisional:
            caps = base(np.array(provisional, dtype=np.float64))
            kept = {x: value for x, (value, _) in points.items() if x not in provisional}
            for x, cap in zip(provisional, caps.tolist()):
                # never below a knot that is not capped at fewer tokens: the isotonic fit would pool the two and
                # pull a measured cost down (a cost that rises steeply from the second token on would be lost)
                floor = max((value for y, value in kept.items() if y < x), default=0.0)
                points[x] = (min(points[x][0], max(cap, floor)), points[x][1])
        return PiecewiseLinear.fit(points, far)


def measured(cost_model: StepCostModel, batch: int, longest: int) -> bool:
    """Whether an online cost model has confirmed what a step at `batch` rows drafting up to `longest` costs (other
    cost models are taken at their word)."""
    if not isinstance(cost_model, OnlineCostModel):
        return True
    return cost_model.has_measured(batch * (1 + longest)) and cost_model.draft_rows(batch) in cost_model.draft_samples


def verify_only(cost_model: StepCostModel) -> StepCostModel:
    """The verify part of a padded cost model: what a step costs when no draft forward runs (prompt lookup)."""
    if isinstance(cost_model, PaddedCostModel):
        return PaddedCostModel(cost_model.verify, None, packed=cost_model.packed)
    return cost_model


def _median(values: list[float]) -> float:
    return float(np.median(values))


def _knot_points(
    samples: dict[int, deque[tuple[float, int]]], pick: Callable[[list[float]], float]
) -> dict[int, tuple[float, int]]:
    """`{knot: (pick of its samples' seconds, number of samples)}` for every knot with samples."""
    return {key: (pick([seconds for seconds, _ in values]), len(values)) for key, values in samples.items() if values}


def _as_measured(
    samples: dict[int, deque[tuple[float, int]]],
    pick: Callable[[list[float]], float],
    far: tuple[float, float] | None = None,
) -> PiecewiseLinear | None:
    """The knots as measured (`pick` of each knot's samples), none capped: see `OnlineCostModel.evidence`."""
    return PiecewiseLinear.fit(_knot_points(samples, pick), far)


def _medians(samples: dict[int, Any]) -> dict[int, tuple[float, int]]:
    """`{key: (median, number of samples)}` of `{key: samples}`."""
    return {key: (float(np.median(list(values))), len(values)) for key, values in samples.items() if len(values)}


# ---- calibration profiles ------------------------------------------------------------------------------------------
@dataclass
class TargetTiming:
    """Median seconds of one target forward over `batch_size` rows of `tokens_per_row` new tokens each."""

    batch_size: int
    tokens_per_row: int
    seconds: float
    samples: list[float] = field(default_factory=list)


@dataclass
class DraftTiming:
    """Median seconds of one draft forward over `batch_size` rows of one new token each."""

    batch_size: int
    seconds: float
    samples: list[float] = field(default_factory=list)


@dataclass
class Profile:
    """Step costs of a target/draft pair measured on one machine, as written by `hf-dynspec calibrate`.

    JSON form: `{"format": "hf_dynspec.profile", "version": 1, "target": ..., "draft": ..., "device": ...,
    "dtype": ..., "context_length": ..., "warmup": ..., "repeats": ..., "narrow_rows": {"target": ..., "draft": ...},
    "target_forward": [{"batch_size",
    "tokens_per_row", "seconds", "samples"}, ...], "draft_forward": [{"batch_size", "seconds", "samples"}, ...]}`.
    """

    target_forward: list[TargetTiming]
    draft_forward: list[DraftTiming]
    target: str = ""
    draft: str = ""
    device: str = "cpu"
    dtype: str = "float32"
    context_length: int = 0
    warmup: int = 0
    repeats: int = 0
    narrow_rows: dict[str, int] = field(default_factory=dict)
    """Per model (`target`, `draft`): the most rows its linear layers computed weight-first (`hf_dynspec.kernels`);
    empty in profiles written before it was recorded."""
    created: str = ""

    def __post_init__(self) -> None:
        if not self.target_forward:
            raise ValueError("A profile needs at least one `target_forward` timing.")
        for i, timing in enumerate(self.target_forward):
            where = f"target_forward[{i}]"
            check_int(f"{where}.batch_size", timing.batch_size, 1)
            check_int(f"{where}.tokens_per_row", timing.tokens_per_row, 1)
            check_positive(f"{where}.seconds", timing.seconds)
        for i, timing in enumerate(self.draft_forward):
            check_int(f"draft_forward[{i}].batch_size", timing.batch_size, 1)
            check_positive(f"draft_forward[{i}].seconds", timing.seconds)

    def to_dict(self) -> dict[str, Any]:
        return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, **asdict(self)}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        """Build from the JSON form; a wrong format, version or field raises `ValueError` naming it."""
        if not isinstance(data, dict):
            raise ValueError(f"A profile is a JSON object, got {type(data).__name__}.")
        if data.get("format") != PROFILE_FORMAT:
            raise ValueError(
                f"Not a calibration profile: `format` is {data.get('format')!r}, expected {PROFILE_FORMAT!r} "
                "(write one with `hf-dynspec calibrate --out profile.json`)."
            )
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(f"Unsupported profile `version` {data.get('version')!r}; this release reads version 1.")
        body = {k: v for k, v in data.items() if k not in ("format", "version")}
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(body) - known)
        if unknown:
            raise ValueError(f"Unknown profile key(s) {unknown}; valid keys are {sorted(known)}.")
        try:
            body["target_forward"] = [TargetTiming(**t) for t in body.get("target_forward", [])]
            body["draft_forward"] = [DraftTiming(**t) for t in body.get("draft_forward", [])]
        except TypeError as error:
            raise ValueError(f"Malformed timing entry in profile: {error}.") from error
        return cls(**body)

    @classmethod
    def load(cls, source: str | Path | dict[str, Any] | Profile) -> Profile:
        """A profile from a JSON file path, its dict form, or a `Profile` (returned as is)."""
        if isinstance(source, Profile):
            return source
        if isinstance(source, dict):
            return cls.from_dict(source)
        path = Path(source)
        if not path.is_file():
            raise ValueError(f"Profile file {str(path)!r} does not exist; create it with `hf-dynspec calibrate`.")
        return cls.from_dict(json.loads(path.read_text()))


# ---- validation helpers (shared with the policies' settings) ---------------------------------------------------------
