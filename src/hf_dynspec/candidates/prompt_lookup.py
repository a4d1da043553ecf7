"""Model-free proposer: continue the row's latest n-gram from an earlier occurrence in the row itself."""

from __future__ import annotations

import torch
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from ..sequences import TokenBatch
from .base import BatchedProposer, EarlyStop, Proposal


def lookup_continuation(tokens: torch.LongTensor, max_ngram: int, min_ngram: int, length: int) -> torch.LongTensor:
    """Up to `length` tokens that followed the most recent earlier occurrence of the row's final n-gram.

    Tries n-grams from `max_ngram` down to `min_ngram` tokens and returns an empty tensor when none recurs.

    Args:
        tokens: `[num_tokens]` the row's real tokens.
    """
    num_tokens = tokens.shape[0]
    for size in range(min(max_ngram, num_tokens - 1), min_ngram - 1, -1):
        windows = tokens[:-1].unfold(0, size, 1)  # [num_tokens - size, size], every n-gram but the final one
        hits = (windows == tokens[-size:]).all(dim=1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + size
            return tokens[start : start + length]
    return tokens[:0]


class PromptLookupProposer(PromptLookupCandidateGenerator, BatchedProposer):
    """Prompt lookup (n-gram) drafting for every row of a batch, each with its own draft length.

    Inside transformers' own batch-1 assisted loop it behaves as transformers' `PromptLookupCandidateGenerator`.
    Its draft tokens are proposed deterministically (`Proposal.probs` is `None`), which the sampling verifier treats
    as a one-hot `q`.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, num_output_tokens: int = 10, **kwargs) -> None:
        super().__init__(num_output_tokens=num_output_tokens, max_matching_ngram_size=max_ngram, **kwargs)
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.forwards = 0

    def propose(
        self,
        batch: TokenBatch,
        lengths: torch.LongTensor,
        early_stop: EarlyStop | None = None,
        free_rows: torch.BoolTensor | None = None,
        node_budgets: torch.LongTensor | None = None,
    ) -> Proposal:
        return self.proposal(batch, self.continuations(batch, lengths))

    def continuations(self, batch: TokenBatch, lengths: torch.LongTensor) -> list[torch.LongTensor]:
        """Each row's continuation (`[found]`, up to `lengths[b]` tokens, empty without a match or with length 0)."""
        lengths = lengths.clamp(max=self.num_output_tokens)
        return [
            lookup_continuation(batch.real_tokens(row), self.max_ngram, self.min_ngram, int(lengths[row]))
            if int(lengths[row]) > 0
            else batch.tokens.new_zeros(0)
            for row in range(batch.batch_size)
        ]

    @staticmethod
    def proposal(batch: TokenBatch, found: list[torch.LongTensor]) -> Proposal:
        """A placeholder-padded `Proposal` of per-row continuations."""
        actual = torch.tensor([f.shape[0] for f in found], dtype=torch.long, device=batch.tokens.device)
        width = int(actual.max()) if found else 0
        tokens = batch.tokens.new_full((batch.batch_size, width), batch.pad_id)
        for row, continuation in enumerate(found):
            tokens[row, : continuation.shape[0]] = continuation
        return Proposal(tokens, actual, None)
