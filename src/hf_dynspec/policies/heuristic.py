"""`heuristic`: transformers' `num_assistant_tokens_schedule="heuristic"` rule, kept per row.

transformers (`AssistedCandidateGenerator.update_candidate_strategy`) adds 2 to the number of assistant tokens when
every candidate of the last step was accepted and otherwise subtracts 1, never going below 1. Here each row keeps its
own count, starting at `initial_tokens` (the maximum by default) at every `generate` call, like
`"heuristic_transient"`. Two differences from transformers, both forced by the batched loop: the count is also capped
at the loop's maximum (transformers lets it grow without bound), and a row that proposed no draft tokens in a step
(its length budget ran out) keeps its count.
"""

from __future__ import annotations

import torch

from .base import DraftLengthPolicy, PolicyInput, StepFeedback

INCREASE, DECREASE = 2, 1


class HeuristicPolicy(DraftLengthPolicy):
    """Per row: +2 after a step whose draft tokens were all accepted, -1 (down to 1) after a rejection."""

    name = "heuristic"

    def __init__(self, initial_tokens: int | None = None) -> None:
        """
        Args:
            initial_tokens: every row's draft length at its first step; `None` starts at the loop's maximum.
        """
        if initial_tokens is not None and (
            isinstance(initial_tokens, bool) or not isinstance(initial_tokens, int) or initial_tokens < 1
        ):
            raise ValueError(f"`initial_tokens` must be an integer >= 1 or None, got {initial_tokens!r}.")
        self.initial_tokens = initial_tokens
        self.counts = torch.zeros(0, dtype=torch.long)  # [num_rows], 0 = not started yet
        self._max_tokens = 0

    def reset(self, num_rows: int) -> None:
        self.counts = torch.zeros(num_rows, dtype=torch.long)

    def draft_lengths(self, request: PolicyInput) -> torch.LongTensor:
        self._max_tokens = request.max_draft_tokens
        rows = self._rows(request.row_ids)
        start = request.max_draft_tokens if self.initial_tokens is None else self.initial_tokens
        fresh = self.counts[rows] == 0
        self.counts[rows[fresh]] = max(1, min(start, request.max_draft_tokens))
        return self.counts[rows].clamp(max=request.max_draft_tokens)

    def observe(self, feedback: StepFeedback) -> None:
        rows = self._rows(feedback.row_ids)
        proposed, accepted = feedback.draft_lengths.cpu(), feedback.accepted.cpu()
        updated = torch.where(accepted == proposed, self.counts[rows] + INCREASE, self.counts[rows] - DECREASE)
        updated = updated.clamp(min=1, max=max(self._max_tokens, 1))
        self.counts[rows] = torch.where(proposed > 0, updated, self.counts[rows])

    def _rows(self, row_ids: torch.LongTensor) -> torch.LongTensor:
        rows = row_ids.cpu().long()
        needed = int(rows.max()) + 1 if rows.numel() else 0
        if needed > self.counts.shape[0]:
            self.counts = torch.cat([self.counts, torch.zeros(needed - self.counts.shape[0], dtype=torch.long)])
        return rows
