"""`confidence`: a row stops drafting as soon as the draft is unsure of its own token.

After every draft token the loop calls `continue_drafting` with the draft's probability `q` of the token it just
proposed; a row whose `q` is below the threshold keeps that token and stops. This is the rule of transformers'
`assistant_confidence_threshold` (`ConfidenceCriteria`), and the threshold adapts the way transformers adapts it: from
the recent draft tokens (their `q`, and whether the verifier accepted them: accepted tokens are positives, the first
rejected token of a row is a negative, later ones are never judged) it picks the threshold `t` minimising

    false_positive_rate(t) + false_negative_cost * false_negative_rate(t)

(a false positive continues past a token that gets rejected, a false negative stops before one that gets accepted;
transformers weighs them 1 : 3). `ConfidenceStopper` holds this logic so `goodput` can use it as its early stop.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from .base import DraftLengthPolicy, PolicyInput, StepFeedback


@dataclass
class ConfidenceSettings:
    """Settings of the confidence early stop (`policy_options` of `confidence`, or `goodput`'s `early_stop`)."""

    threshold: float = field(
        default=0.4, metadata={"help": "Starting threshold on the draft's probability of its own token (0..1)."}
    )
    adaptive: bool = field(default=True, metadata={"help": "Re-fit the threshold after every step from recent tokens."})
    window: int = field(default=512, metadata={"help": "Number of recent judged draft tokens the threshold is fit on."})
    min_samples: int = field(
        default=6, metadata={"help": "Judged tokens (with both outcomes present) needed before the threshold adapts."}
    )
    false_negative_cost: float = field(
        default=3.0, metadata={"help": "Weight of stopping before an accepted token, relative to continuing past a rejected one."}
    )

    def __post_init__(self) -> None:
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) or not 0 <= self.threshold <= 1:
            raise ValueError(f"`threshold` must be a number in [0, 1], got {self.threshold!r}.")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"`adaptive` must be a bool, got {self.adaptive!r}.")
        for name, minimum in (("window", 2), ("min_samples", 2)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value!r}.")
        cost = self.false_negative_cost
        if isinstance(cost, bool) or not isinstance(cost, (int, float)) or not cost > 0 or not math.isfinite(cost):
            raise ValueError(f"`false_negative_cost` must be a finite number > 0, got {cost!r}.")


class ConfidenceStopper:
    """The early-stop rule and its adaptive threshold, shared by the `confidence` and `goodput` policies."""

    def __init__(self, settings: ConfidenceSettings | None = None) -> None:
        self.settings = settings or ConfidenceSettings()
        self.threshold = float(self.settings.threshold)
        self.probs: deque[float] = deque(maxlen=self.settings.window)
        self.labels: deque[int] = deque(maxlen=self.settings.window)
        self._rates: np.ndarray | None = None  # [bins] acceptance by draft-probability bin (`acceptance_rates`)
        self._pending = torch.full((0, 0), math.nan, dtype=torch.float64)  # [num_rows, positions] q of this step

    def reset(self, num_rows: int) -> None:
        """Start a `generate` call (the judged-token history and the threshold carry over)."""
        self._pending = torch.full((num_rows, 0), math.nan, dtype=torch.float64)

    def continue_drafting(
        self, row_ids: torch.LongTensor, position: int | torch.LongTensor, draft_probs: torch.Tensor
    ) -> torch.BoolTensor:
        """`[n]` True where the row's draft probability `draft_probs` (`[n]`) reaches the threshold."""
        return self.record(row_ids, position, draft_probs) >= self.threshold

    def record(
        self, row_ids: torch.LongTensor, position: int | torch.LongTensor, draft_probs: torch.Tensor
    ) -> torch.Tensor:
        """Keep the draft probabilities `[n]` of rows `row_ids` (`[n]`) at draft position `position` (one for all, or
        `[n]`, one per row) until the step is judged; returns them as float64 on the CPU."""
        rows = row_ids.cpu().long()
        positions = torch.as_tensor(position).to("cpu", torch.long).expand(rows.shape[0])
        probs = draft_probs.detach().to("cpu", torch.float64)
        self._grow(int(rows.max()) + 1 if rows.numel() else 0, int(positions.max()) + 1 if rows.numel() else 0)
        self._pending[rows, positions] = probs
        return probs

    def acceptance_given(self, probs: torch.Tensor) -> torch.Tensor:
        """Calibrated acceptance `[batch]` of draft tokens with draft probabilities `probs` (`[batch]`), from the
        judged tokens up to the last step (`acceptance_rates`, refreshed once per step in `observe`)."""
        if self._rates is None:
            history = np.fromiter(self.probs, dtype=np.float64), np.fromiter(self.labels, dtype=np.float64)
            self._rates = acceptance_rates(*history)
        return torch.from_numpy(self._rates[rate_bins(probs.to("cpu", torch.float64).numpy())])

    def observe(self, feedback: StepFeedback) -> None:
        """Record which recorded draft tokens were accepted, then re-fit the threshold."""
        rows = feedback.row_ids.cpu().long()
        lengths, accepted = feedback.draft_lengths.cpu(), feedback.accepted.cpu()
        width = min(int(lengths.max()) if lengths.numel() else 0, self._pending.shape[1])
        if width == 0 or rows.numel() == 0:
            return
        self._grow(int(rows.max()) + 1, width)
        probs = self._pending[rows, :width]  # [batch, width]
        position = torch.arange(width).unsqueeze(0)  # [1, width]
        positive = position < accepted.unsqueeze(1)
        negative = (position == accepted.unsqueeze(1)) & (accepted < lengths).unsqueeze(1)
        judged = (positive | negative) & ~probs.isnan()
        self.probs.extend(probs[judged].tolist())
        self.labels.extend(positive[judged].long().tolist())
        self._pending[rows] = math.nan
        self._rates = None  # the calibration is refit from the new judged tokens when next asked
        if self.settings.adaptive:
            self._refit()

    def _refit(self) -> None:
        labels = np.fromiter(self.labels, dtype=np.int64)
        if labels.size < self.settings.min_samples or labels.min() == labels.max():
            return
        probs = np.fromiter(self.probs, dtype=np.float64)
        self.threshold = best_threshold(probs, labels, self.settings.false_negative_cost)

    def _grow(self, num_rows: int, positions: int) -> None:
        rows, cols = self._pending.shape
        if num_rows > rows or positions > cols:
            grown = torch.full((max(rows, num_rows), max(cols, positions)), math.nan, dtype=torch.float64)
            grown[:rows, :cols] = self._pending
            self._pending = grown


RATE_EDGES = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999, 1.0)
"""Bins of draft probability for calibrated acceptance: tenths, then finer towards 1, where long drafts live (ten
tokens at a draft probability near 0.999 are all accepted far more often than ten tokens somewhere in [0.9, 1])."""


def rate_bins(probs: np.ndarray, edges: tuple[float, ...] = RATE_EDGES) -> np.ndarray:
    """`[m]` the bin of `edges` that holds each draft probability in `probs` (`[m]`, clipped to [0, 1])."""
    index = np.searchsorted(np.asarray(edges[1:-1]), np.clip(probs, 0.0, 1.0), side="right")
    return index.astype(np.int64)


def acceptance_rates(
    probs: np.ndarray, labels: np.ndarray, edges: tuple[float, ...] = RATE_EDGES, prior_weight: float = 2.0
) -> np.ndarray:
    """`[bins]` how often draft tokens are accepted, by bin of their draft probability, from judged tokens.

    `probs` / `labels` (`[m]`, 1 = accepted) are the judged history; `edges` cut the unit interval into bins
    (`RATE_EDGES`). A bin's rate is its accepted count plus `prior_weight` pseudo-tokens accepted at the bin's centre
    probability (so with no history the answer is about the draft's own probability), and rates are made
    non-decreasing in the probability (a surer draft is never predicted to be accepted less often).
    """
    bounds = np.asarray(edges, dtype=np.float64)
    centres = (bounds[1:] + bounds[:-1]) / 2
    index = rate_bins(probs, edges)
    counts = np.bincount(index, minlength=centres.size)
    accepted = np.bincount(index, weights=labels, minlength=centres.size)
    return np.maximum.accumulate((accepted + prior_weight * centres) / (counts + prior_weight))


def best_threshold(probs: np.ndarray, labels: np.ndarray, false_negative_cost: float) -> float:
    """The threshold among the observed `probs` (`[n]`) minimising `fpr + false_negative_cost * fnr`.

    `labels` (`[n]`, 1 = accepted) must contain both outcomes. A token "continues" when its probability is at least the
    threshold; on ties the highest threshold wins.
    """
    order = np.argsort(-probs, kind="stable")
    probs, labels = probs[order], labels[order]
    true_pos = np.cumsum(labels)  # [n] positives at or above probs[i]
    false_pos = np.cumsum(1 - labels)
    last_of_value = np.append(probs[1:] != probs[:-1], True)  # thresholds at distinct values only
    fpr = false_pos[last_of_value] / false_pos[-1]
    fnr = 1.0 - true_pos[last_of_value] / true_pos[-1]
    cost = fpr + false_negative_cost * fnr
    return float(probs[last_of_value][int(np.argmin(cost))])


class ConfidencePolicy(DraftLengthPolicy):
    """Every row asks for the maximum draft length and stops early when the draft's confidence drops."""

    name = "confidence"

    def __init__(self, settings: ConfidenceSettings | None = None, num_speculative_tokens: int | None = None) -> None:
        if num_speculative_tokens is not None and (
            isinstance(num_speculative_tokens, bool)
            or not isinstance(num_speculative_tokens, int)
            or num_speculative_tokens < 0
        ):
            raise ValueError(f"`num_speculative_tokens` must be an integer >= 0 or None, got {num_speculative_tokens!r}.")
        self.stopper = ConfidenceStopper(settings)
        self.num_speculative_tokens = num_speculative_tokens

    @property
    def threshold(self) -> float:
        return self.stopper.threshold

    def reset(self, num_rows: int) -> None:
        self.stopper.reset(num_rows)

    def draft_lengths(self, request: PolicyInput) -> torch.LongTensor:
        k = request.max_draft_tokens if self.num_speculative_tokens is None else self.num_speculative_tokens
        return torch.full((request.batch_size,), min(k, request.max_draft_tokens), dtype=torch.long)

    def observe(self, feedback: StepFeedback) -> None:
        self.stopper.observe(feedback)

    def continue_drafting(
        self, row_ids: torch.LongTensor, position: int | torch.LongTensor, draft_probs: torch.Tensor
    ) -> torch.BoolTensor | None:
        return self.stopper.continue_drafting(row_ids, position, draft_probs)
