"""`static`: every row speculates the same fixed number of tokens."""

from __future__ import annotations

import torch

from .base import DraftLengthPolicy, PolicyInput


class StaticPolicy(DraftLengthPolicy):
    """Every row speculates `num_speculative_tokens` tokens each step (the config's maximum)."""

    name = "static"

    def __init__(self, num_speculative_tokens: int) -> None:
        if num_speculative_tokens < 0:
            raise ValueError(f"`num_speculative_tokens` must be >= 0, got {num_speculative_tokens}.")
        self.num_speculative_tokens = num_speculative_tokens

    def draft_lengths(self, request: PolicyInput) -> torch.LongTensor:
        k = min(self.num_speculative_tokens, request.max_draft_tokens)
        return torch.full((request.batch_size,), k, dtype=torch.long)
