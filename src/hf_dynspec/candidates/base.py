"""The batched proposer interface used by the speculative loop."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..sequences import TokenBatch

# Called after each draft position with (position, draft probability of each proposed token `[batch]`); returns
# `[batch]` bool, False where a row stops drafting, or None to keep going.
EarlyStop = Callable[[int, torch.Tensor], "torch.BoolTensor | None"]


@dataclass
class Proposal:
    """Draft tokens for every active row.

    Rows propose different numbers of tokens; `tokens` is padded to the longest row with placeholder tokens (ignored
    by the verifier: only the first `lengths[b]` entries of row `b` are draft tokens).
    """

    tokens: torch.LongTensor  # [batch, max_length] draft tokens, placeholder-padded
    lengths: torch.LongTensor  # [batch] draft length per row (0 allowed)
    probs: torch.Tensor | None  # [batch, max_length, vocab] distribution q each token was sampled from; None = one-hot

    @property
    def max_length(self) -> int:
        return int(self.tokens.shape[1])


class BatchedProposer(ABC):
    """A proposer the batched loop drives: it proposes per-row draft tokens and tracks what it has seen.

    Lifecycle in one `generate` call: `start` once, then per step `propose` -> `commit`, and `select_rows` whenever
    finished rows leave the batch.
    """

    #: proposer counts its own model forwards here (0 for model-free proposers)
    forwards: int = 0
    #: seconds the last `propose` spent catching the proposer's model up on a backlog (its prefill), not drafting
    catchup_seconds: float = 0.0
    #: tokens (padding included) of that catch-up forward
    catchup_tokens: int = 0
    #: `[batch]` rows the last `propose` served from a model-free proposal (hybrid proposers; `None` otherwise)
    last_free_rows: torch.BoolTensor | None = None
    #: the proposer's model (`None` for model-free proposers)
    model = None

    def start(self, batch: TokenBatch) -> None:
        """Begin a new `generate` call on `batch` (the prompt plus the first generated token)."""
        self.forwards = 0

    @abstractmethod
    def propose(
        self,
        batch: TokenBatch,
        lengths: torch.LongTensor,
        early_stop: EarlyStop | None = None,
        free_rows: torch.BoolTensor | None = None,
    ) -> Proposal:
        """Propose up to `lengths[b]` (`[batch]`, 0 allowed) draft tokens for each row of `batch`.

        `free_rows` (`[batch]`, hybrid proposers only) marks the rows to serve from the model-free proposal.
        """

    def backlog(self, batch: TokenBatch) -> torch.LongTensor | None:
        """`[batch]` tokens the proposer's model must process before it can draft (`None`: no model)."""
        return None

    def free_lengths(self, batch: TokenBatch, max_length: int) -> torch.LongTensor | None:
        """`[batch]` draft tokens a model-free proposal offers each row this step (hybrid proposers; else `None`)."""
        return None

    def commit(self, batch: TokenBatch, proposal: Proposal, accepted: torch.LongTensor) -> None:
        """After verification: `accepted[b]` leading draft tokens of row `b` were kept; `batch` is already updated."""

    def select_rows(self, keep: torch.LongTensor) -> None:
        """Keep only the rows at indices `keep` (finished rows leave the batch)."""

    def release(self) -> None:
        """Free per-call state (caches) at the end of `generate`."""
