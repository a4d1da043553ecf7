"""The policy interface: each step, a policy chooses a draft length for every active row."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class PolicyInput:
    """What a policy sees before a step.

    Row identity is stable for a whole `generate` call: `row_ids` holds each active row's index in the original batch,
    so per-row state (acceptance estimates) can be kept in tensors of size `num_rows` given to `reset`.
    """

    step: int
    row_ids: torch.LongTensor  # [batch] original batch index of each active row
    remaining_tokens: torch.LongTensor  # [batch] tokens each row may still emit before its length limit
    max_draft_tokens: int  # upper bound on any row's draft length (DynSpecConfig.num_speculative_tokens)

    @property
    def batch_size(self) -> int:
        return int(self.row_ids.shape[0])


@dataclass
class StepFeedback:
    """What happened in a step, given to `DraftLengthPolicy.observe` after verification.

    The loop pads draft tokens to the longest row, so the target processes `batch_size * (1 + max(draft_lengths))`
    tokens in the verify forward (`target_tokens`), and the draft model runs `max(draft_lengths)` forwards in
    `draft_seconds`. A draft catching up on a backlog (its prompt prefill) spends `catchup_seconds` on top.
    """

    row_ids: torch.LongTensor  # [batch]
    requested_lengths: torch.LongTensor  # [batch] what the policy asked for
    draft_lengths: torch.LongTensor  # [batch] what the proposer actually proposed (<= requested)
    accepted: torch.LongTensor  # [batch] accepted draft tokens per row
    draft_seconds: float
    verify_seconds: float
    target_tokens: int
    catchup_seconds: float = 0.0  # draft catch-up on a backlog (its prefill), not included in draft_seconds

    @property
    def batch_size(self) -> int:
        return int(self.row_ids.shape[0])


class DraftLengthPolicy(ABC):
    """Chooses each active row's draft length (0 .. `max_draft_tokens`) every step.

    Subclasses implement `draft_lengths`; `observe` receives the outcome of each step and `continue_drafting` lets a
    policy stop a row's drafting early from the draft's own confidence.
    """

    name: str = "base"

    def reset(self, num_rows: int) -> None:
        """Called once at the start of each `generate` call with the number of rows in the batch."""

    @abstractmethod
    def draft_lengths(self, request: PolicyInput) -> torch.LongTensor:
        """Return `torch.LongTensor` of shape `(batch,)` with values in `[0, request.max_draft_tokens]`."""

    def observe(self, feedback: StepFeedback) -> None:
        """Learn from a finished step (accepted counts, timings)."""

    def continue_drafting(
        self, row_ids: torch.LongTensor, position: int, draft_probs: torch.Tensor
    ) -> torch.BoolTensor | None:
        """Early stop while drafting.

        Args:
            row_ids: `[batch]` original indices of the rows still drafting.
            position: index (0-based) of the draft token just proposed.
            draft_probs: `[batch]` the draft's probability of the token it just proposed.

        Returns:
            `[batch]` bool, `False` where the row should stop after this token, or `None` to keep every row going.
        """
        return None
