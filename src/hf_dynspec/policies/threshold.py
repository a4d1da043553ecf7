"""`threshold`: speculate only while the batch is small (milestone 1 of vLLM's dynamic speculation RFC)."""

from __future__ import annotations

import torch

from .base import DraftLengthPolicy, PolicyInput


class ThresholdPolicy(DraftLengthPolicy):
    """Every row drafts `num_speculative_tokens` while at most `batch_size_threshold` rows are active, else none.

    As rows finish, the batch shrinks below the threshold and speculation starts again (the long tail of a rollout).
    """

    name = "threshold"

    def __init__(self, batch_size_threshold: int, num_speculative_tokens: int | None = None) -> None:
        """
        Args:
            batch_size_threshold: largest number of active rows that still speculates (0: never speculate).
            num_speculative_tokens: draft length while speculating; `None` uses the loop's maximum.
        """
        if isinstance(batch_size_threshold, bool) or not isinstance(batch_size_threshold, int) or batch_size_threshold < 0:
            raise ValueError(f"`batch_size_threshold` must be an integer >= 0, got {batch_size_threshold!r}.")
        if num_speculative_tokens is not None and (
            isinstance(num_speculative_tokens, bool)
            or not isinstance(num_speculative_tokens, int)
            or num_speculative_tokens < 0
        ):
            raise ValueError(f"`num_speculative_tokens` must be an integer >= 0 or None, got {num_speculative_tokens!r}.")
        self.batch_size_threshold = batch_size_threshold
        self.num_speculative_tokens = num_speculative_tokens

    def draft_lengths(self, request: PolicyInput) -> torch.LongTensor:
        k = request.max_draft_tokens if self.num_speculative_tokens is None else self.num_speculative_tokens
        if request.batch_size > self.batch_size_threshold:
            k = 0
        return torch.full((request.batch_size,), min(k, request.max_draft_tokens), dtype=torch.long)
