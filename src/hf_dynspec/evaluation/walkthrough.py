"""Recording a policy's decisions step by step, for the goodput walkthrough notebook.

`DecisionRecorder` wraps any policy: it forwards every call and keeps, per step, what the policy saw (active rows,
remaining budgets), what it chose, and what then happened (accepted tokens, measured seconds). For policies with an
acceptance estimator and a step cost model (the `goodput` policy) it also records the estimates the choice was based
on and the predicted tokens per second of plain decoding and of the chosen lengths.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..policies.base import DraftLengthPolicy, PolicyInput, StepFeedback


@dataclass
class Decision:
    """One step as the policy saw and chose it, and its outcome."""

    step: int
    row_ids: list[int]
    remaining: list[int]
    lengths: list[int]
    acceptance: list[float] | None = None
    explored: int | None = None
    predicted_plain_rate: float | None = None  # tokens/s the cost model expects from plain decoding
    predicted_chosen_rate: float | None = None  # tokens/s it expects from the chosen lengths
    predicted_seconds: float | None = None
    accepted: list[int] = field(default_factory=list)
    measured_seconds: float | None = None

    def as_row(self) -> dict[str, Any]:
        """Flat dict for a table (one row per step)."""
        return {
            "step": self.step,
            "rows": len(self.row_ids),
            "draft lengths": self.lengths,
            "accepted": self.accepted,
            "mean acceptance estimate": _mean(self.acceptance),
            "explored length": self.explored,
            "predicted plain tok/s": self.predicted_plain_rate,
            "predicted chosen tok/s": self.predicted_chosen_rate,
            "predicted s": self.predicted_seconds,
            "measured s": self.measured_seconds,
        }


def _mean(values: list[float] | None) -> float | None:
    return sum(values) / len(values) if values else None


class DecisionRecorder(DraftLengthPolicy):
    """Wraps `policy`, recording a `Decision` per step in `decisions` (across every `generate` call)."""

    def __init__(self, policy: DraftLengthPolicy) -> None:
        self.policy = policy
        self.name = f"recorded-{policy.name}"
        self.decisions: list[Decision] = []

    def reset(self, num_rows: int) -> None:
        self.policy.reset(num_rows)

    def draft_lengths(self, request: PolicyInput) -> torch.LongTensor:
        acceptance = getattr(self.policy, "acceptance", None)
        estimates = acceptance.mean(request.row_ids).tolist() if acceptance is not None else None
        lengths = self.policy.draft_lengths(request)
        decision = Decision(
            step=request.step,
            row_ids=request.row_ids.tolist(),
            remaining=request.remaining_tokens.tolist(),
            lengths=lengths.tolist(),
            acceptance=estimates,
            explored=getattr(self.policy, "last_exploration", None),
        )
        self._predict(decision, lengths)
        self.decisions.append(decision)
        return lengths

    def _predict(self, decision: Decision, lengths: torch.LongTensor) -> None:
        """Predicted rates from the wrapped policy's cost model, when it has one and can price this batch yet."""
        cost_model = getattr(self.policy, "cost_model", None)
        if cost_model is None or decision.acceptance is None:
            return
        batch = len(decision.row_ids)
        try:
            plain = float(cost_model.step_seconds(batch, torch.zeros(batch, dtype=torch.long)))
            chosen = float(cost_model.step_seconds(batch, lengths.cpu()))
        except (ValueError, RuntimeError):  # an online model that has not measured anything yet
            return
        expected = sum(sum(a**j for j in range(k + 1)) for a, k in zip(decision.acceptance, decision.lengths))
        decision.predicted_seconds = chosen
        decision.predicted_plain_rate = batch / plain if plain > 0 else None
        decision.predicted_chosen_rate = expected / chosen if chosen > 0 else None

    def observe(self, feedback: StepFeedback) -> None:
        if self.decisions:
            self.decisions[-1].accepted = feedback.accepted.tolist()
            self.decisions[-1].measured_seconds = feedback.draft_seconds + feedback.verify_seconds
        self.policy.observe(feedback)

    def continue_drafting(
        self, row_ids: torch.LongTensor, position: int | torch.LongTensor, draft_probs: torch.Tensor
    ) -> torch.BoolTensor | None:
        return self.policy.continue_drafting(row_ids, position, draft_probs)

    def table(self) -> list[dict[str, Any]]:
        """One flat dict per recorded step."""
        return [decision.as_row() for decision in self.decisions]
