"""What the `goodput` policy knows of acceptance: per-row estimates, and the checks of its settings.

Acceptance (`AcceptanceEstimator`): every draft token of row `i` is assumed accepted with probability `a_i`,
independently of the others, so a row that proposed `k` tokens and had `m` accepted contributes `m` successes and, when
`m < k`, one failure (the first rejected token; the ones after it are never judged). With a Beta prior the posterior
mean is `(S_i + w * p) / (S_i + F_i + w)`, where `p` is a pooled estimate over every row seen so far (itself started
from `prior_acceptance`) and `w` is `prior_weight` pseudo-tokens. Counts decay by `decay` at every observation, so an
estimate follows a row whose text changes character.
Step costs live in `cost_models`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    pass



# ---- acceptance ----------------------------------------------------------------------------------------------------
class AcceptanceEstimator:
    """Per-row Beta estimate of the probability that a row's next draft token is accepted.

    Per-row counts live in tensors indexed by the row's original batch index (`PolicyInput.row_ids`); `reset` clears
    them at the start of a `generate` call while the pooled estimate (the prior of new rows) carries over. Every
    `update` (one per step) multiplies the counts of every row it names, and the pooled counts, by `decay`, whether
    the row drafted or not: what was learned long ago weighs less, so an estimate that stopped a row from drafting
    drifts back to the pooled one and then to the prior, and the row drafts again (without this, two early rejections
    could keep a row from drafting for the rest of its call: plain steps teach nothing).
    """

    def __init__(self, prior_acceptance: float = 0.6, prior_weight: float = 4.0, decay: float = 0.95) -> None:
        check_open_unit("prior_acceptance", prior_acceptance)
        check_positive("prior_weight", prior_weight)
        if not isinstance(decay, (int, float)) or not 0.0 < decay <= 1.0:
            raise ValueError(f"`decay` must be a number in (0, 1], got {decay!r}.")
        self.prior_acceptance = float(prior_acceptance)
        self.prior_weight = float(prior_weight)
        self.decay = float(decay)
        self.pooled_successes = 0.0
        self.pooled_failures = 0.0
        self.successes = torch.zeros(0, dtype=torch.float64)  # [num_rows]
        self.failures = torch.zeros(0, dtype=torch.float64)  # [num_rows]

    def reset(self, num_rows: int) -> None:
        """Forget every row (the pooled estimate is kept)."""
        self.successes = torch.zeros(num_rows, dtype=torch.float64)
        self.failures = torch.zeros(num_rows, dtype=torch.float64)

    def forget(self, row_ids: torch.LongTensor) -> None:
        """Forget the rows `row_ids` (`[n]`): new requests took them, and start from the pooled estimate."""
        rows = self._rows(row_ids)
        self.successes[rows] = 0.0
        self.failures[rows] = 0.0

    @property
    def pooled_mean(self) -> float:
        """Acceptance over every row observed so far, shrunk towards `prior_acceptance`: the prior of a new row."""
        w = self.prior_weight
        seen = self.pooled_successes + self.pooled_failures
        return (self.pooled_successes + w * self.prior_acceptance) / (seen + w)

    def mean(self, row_ids: torch.LongTensor) -> torch.Tensor:
        """`[batch]` float64 posterior mean acceptance of each row in `row_ids` (`[batch]`)."""
        rows = self._rows(row_ids)
        s, f = self.successes[rows], self.failures[rows]
        return (s + self.prior_weight * self.pooled_mean) / (s + f + self.prior_weight)

    def shifted(self, row_ids: torch.LongTensor, z: float) -> torch.Tensor:
        """`[batch]` each row's posterior mean moved by `z` standard deviations of the pooled estimate, in [0, 1]: the
        acceptance of every row if the source as a whole were `z` deviations better (or worse, `z < 0`) than known.
        Rows deviate from the pooled estimate on their own, and over a batch those deviations average out; what
        moves every row together is how much is known of the source."""
        pooled, seen = self.pooled_mean, self.pooled_successes + self.pooled_failures
        spread = (pooled * (1 - pooled) / (seen + self.prior_weight + 1)) ** 0.5
        return (self.mean(row_ids) + z * spread).clamp(min=0.0, max=1.0)

    def upper(self, row_ids: torch.LongTensor, z: float) -> torch.Tensor:
        """`[batch]` optimistic estimate: posterior mean plus `z` posterior standard deviations, at most 1."""
        rows = self._rows(row_ids)
        mean = self.mean(row_ids)
        n = self.successes[rows] + self.failures[rows] + self.prior_weight
        return (mean + z * torch.sqrt(mean * (1 - mean) / (n + 1))).clamp(max=1.0)

    def lower(self, row_ids: torch.LongTensor, z: float) -> torch.Tensor:
        """`[batch]` pessimistic estimate: posterior mean minus `z` posterior standard deviations, at least 0."""
        rows = self._rows(row_ids)
        mean = self.mean(row_ids)
        n = self.successes[rows] + self.failures[rows] + self.prior_weight
        return (mean - z * torch.sqrt(mean * (1 - mean) / (n + 1))).clamp(min=0.0)

    def update(self, row_ids: torch.LongTensor, proposed: torch.LongTensor, accepted: torch.LongTensor) -> None:
        """Learn from one step: row `row_ids[j]` proposed `proposed[j]` draft tokens and `accepted[j]` were accepted.

        Args:
            row_ids: `[batch]` original row indices.
            proposed: `[batch]` draft lengths actually proposed (rows with 0 teach nothing; their counts only age).
            accepted: `[batch]` accepted draft tokens, `0 <= accepted <= proposed`.
        """
        rows = self._rows(row_ids)
        proposed, accepted = proposed.cpu(), accepted.cpu()
        if bool((accepted > proposed).any()) or bool((accepted < 0).any()):
            raise ValueError(
                f"Accepted counts {accepted.tolist()} must lie between 0 and the proposed lengths {proposed.tolist()}."
            )
        # Every step ages what is known of each row, drafting or not: a row that stopped drafting after a few
        # rejections drifts back to the pooled prior and is tried again, instead of keeping a stale low estimate.
        self.successes[rows] *= self.decay
        self.failures[rows] *= self.decay
        self.pooled_successes *= self.decay
        self.pooled_failures *= self.decay
        seen = proposed > 0
        if not bool(seen.any()):
            return
        rows = rows[seen]
        wins = accepted[seen].double()
        losses = (accepted[seen] < proposed[seen]).double()
        self.successes[rows] += wins
        self.failures[rows] += losses
        self.pooled_successes += float(wins.sum())
        self.pooled_failures += float(losses.sum())

    def _rows(self, row_ids: torch.LongTensor) -> torch.LongTensor:
        rows = row_ids.cpu().long()
        needed = int(rows.max()) + 1 if rows.numel() else 0
        if needed > self.successes.shape[0]:  # used without `reset` (or with more rows than announced)
            grow = needed - self.successes.shape[0]
            self.successes = torch.cat([self.successes, torch.zeros(grow, dtype=torch.float64)])
            self.failures = torch.cat([self.failures, torch.zeros(grow, dtype=torch.float64)])
        return rows


class ConfidenceScale:
    """How sure, on average, the proposals were whose verification an `AcceptanceEstimator` learned from.

    A model-free proposal that says how sure it is (suffix trees: the share of earlier occurrences of the matched text
    that continued that way, `BatchedProposer.free_confidence`) is accepted about in proportion to it: among the
    default target's greedy outputs on `agent` prompts, a suffix token whose context always continued that way was
    accepted 70% of the time after a short match, one whose context continued that way less than half the time 14%.
    So a proposal's acceptance is its class's learned acceptance times its confidence over this mean: proposals as sure
    as those the class learned from keep the class's estimate, less sure ones get less. Counts age by `decay` per
    update, as the estimator's do.
    """

    def __init__(self, prior_weight: float = 4.0, decay: float = 0.95) -> None:
        self.decay = decay
        self.weight = prior_weight  # verified tokens behind `mean`, aged; the prior counts as this many sure ones
        self.mean = 1.0

    def update(self, confidence: torch.Tensor, tried: torch.Tensor) -> None:
        """Learn from one step: proposals of `confidence` (`[n]`) had `tried` (`[n]`) of their tokens verified."""
        self.weight *= self.decay
        tried = tried.double().cpu()
        total = float(tried.sum())
        if total > 0:
            weighted = float((tried * confidence.double().cpu()).sum())
            self.mean = (self.weight * self.mean + weighted) / (self.weight + total)
            self.weight += total

    def scale(self, acceptance: torch.Tensor, confidence: torch.Tensor) -> torch.Tensor:
        """`[batch]` acceptance of proposals of `confidence`, from their class's `acceptance` (both `[batch]`)."""
        return (acceptance * confidence.to(acceptance.dtype) / max(self.mean, 1e-6)).clamp(0.0, 1.0)


def expected_tokens(acceptance: torch.Tensor, lengths: torch.LongTensor) -> torch.Tensor:
    """`[batch]` expected emitted tokens of a step: `sum_{j=0..k} a^j = (1 - a^(k+1)) / (1 - a)` (exact at `a = 1`).

    Args:
        acceptance: `[batch]` per-token acceptance probabilities in `[0, 1]`.
        lengths: `[batch]` draft lengths.
    """
    depth = torch.arange(int(lengths.max()) + 1 if lengths.numel() else 1, dtype=torch.float64)  # [K + 1]
    powers = acceptance.double().unsqueeze(1) ** depth  # [batch, K + 1]
    return (powers * (depth.unsqueeze(0) <= lengths.unsqueeze(1))).sum(dim=1)


# ---- piecewise linear functions ------------------------------------------------------------------------------------
def check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value!r}.")


def check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
        raise ValueError(f"`{name}` must be a finite number > 0, got {value!r}.")


def check_open_unit(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < 1.0:
        raise ValueError(f"`{name}` must be a number strictly between 0 and 1, got {value!r}.")
