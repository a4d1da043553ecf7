"""What speculation may cost: a loss budget against plain decoding, and the price of the draft's catch-ups.

`LossBudget` makes the `goodput` controller *conservative* in the sense of conservative bandits (Wu et al., 2016):
speculation is an action whose payoff is uncertain, plain decoding the baseline whose payoff is known, and the
controller may only take a speculative step if, even when that step accepts nothing, the work it has done stays
within a stated fraction of plain decoding's time. The ledger spans every `generate` call a policy serves (one call
for a policy built per call), so short calls together fund what one short call could not. With

- `work`: the plain-decoding seconds done so far (each call's target prefill, then per step the plain-step cost
  times the tokens each row emitted on average),
- `balance`: the seconds speculation has saved so far (plain-equivalent seconds minus the seconds the steps cost, both
  priced by the cost model, so a burst of noise from other processes does not count as a loss or a gain),
- `future`: the plain seconds still ahead (the plain-step cost times the most tokens any row may still emit),
  credited up to `FUTURE_CREDIT` times `work`, so that a plain-step cost measured during a burst of interference
  from other processes cannot inflate the budget,

a step whose worst case changes the balance by `worst` (negative: its extra cost when every draft token is rejected,
catch-up included) is allowed when `balance + worst >= -fraction * (work + future)`. Every step taken under this rule
keeps `balance >= -fraction * (total plain work)`, so the policy loses at most `fraction` of plain decoding's time
to speculation, up to the cost model's error on one step; when speculation pays, the balance grows and the rule stops
binding. When it does not pay, the controller still probes, at a rate the budget's growth allows.
"""

from __future__ import annotations

from collections import deque

FUTURE_CREDIT = 4.0
"""The plain work still ahead counts towards the budget up to this multiple of the work already done."""


class LossBudget:
    """Book-keeping of the seconds speculation has saved (positive) or lost (negative) against plain decoding."""

    def __init__(self, fraction: float | None) -> None:
        """`fraction`: the largest share of plain decoding's time speculation may lose; `None` switches the rule off."""
        if fraction is not None and (
            isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction < 1.0
        ):
            raise ValueError(f"`loss_budget` must be a number in [0, 1) or None (no budget), got {fraction!r}.")
        self.fraction = None if fraction is None else float(fraction)
        self.reset()

    def reset(self) -> None:
        """Start a new `generate` call: nothing done, nothing saved."""
        self.work = 0.0
        self.balance = 0.0

    def start(self, prefill_seconds: float) -> None:
        """The target's prefill is work plain decoding does too."""
        self.work += max(float(prefill_seconds), 0.0)

    def allows(self, worst_change: float, future_work: float) -> bool:
        """Whether a step whose worst case changes the balance by `worst_change` seconds stays within the budget."""
        if self.fraction is None:
            return True
        future = min(max(future_work, 0.0), FUTURE_CREDIT * self.work)
        return self.balance + worst_change >= -self.fraction * (self.work + future)

    def record(self, plain_seconds: float, spent_seconds: float) -> None:
        """A finished step did `plain_seconds` of plain-decoding work in `spent_seconds` (both cost-model priced)."""
        self.work += plain_seconds
        self.balance += plain_seconds - spent_seconds


class CatchupCost:
    """Seconds of a draft catch-up forward over `tokens` tokens (padding included).

    Before the draft has ever caught up, its cost is the target's prefill rate scaled by the draft/target parameter
    ratio (a forward's cost grows with the weights it multiplies); afterwards the fastest of the last `window`
    measured rates (seconds per token), which ignores bursts of interference from other processes.
    """

    def __init__(self, window: int = 9) -> None:
        self.rates: deque[float] = deque(maxlen=window)
        self.prior_rate: float | None = None

    def observe_prefill(self, seconds: float, tokens: int, draft_cost_ratio: float | None) -> None:
        """Set the prior from the target's prefill (`seconds` over `tokens`) and the draft/target cost ratio."""
        if draft_cost_ratio is not None and tokens > 0 and seconds > 0:
            self.prior_rate = draft_cost_ratio * seconds / tokens

    def observe(self, seconds: float, tokens: int) -> None:
        """A measured catch-up forward."""
        if tokens > 0 and seconds > 0:
            self.rates.append(seconds / tokens)

    def seconds(self, tokens: int) -> float:
        """Predicted seconds of a catch-up over `tokens` tokens (0 when nothing is known and nothing is needed)."""
        if tokens <= 0:
            return 0.0
        rate = min(self.rates) if self.rates else self.prior_rate
        return 0.0 if rate is None else rate * tokens
