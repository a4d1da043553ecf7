"""Model-free proposer: continue the row's latest n-gram from an earlier occurrence in the row itself."""

from __future__ import annotations

import torch
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from ..devices import upload
from ..sequences import TokenBatch
from .base import BatchedProposer, EarlyStop, Proposal

MAX_ANCHOR = 32
"""Longest anchor `lookup_match` measures: enough to tell a row that copies a span from one that met a short n-gram."""


def lookup_continuation(tokens: torch.LongTensor, max_ngram: int, min_ngram: int, length: int) -> torch.LongTensor:
    """Up to `length` tokens that followed the most recent earlier occurrence of the row's final n-gram.

    Tries n-grams from `max_ngram` down to `min_ngram` tokens and returns an empty tensor when none recurs.

    Args:
        tokens: `[num_tokens]` the row's real tokens.
    """
    return lookup_match(tokens, max_ngram, min_ngram, length)[0]


def lookup_match(
    tokens: torch.LongTensor, max_ngram: int, min_ngram: int, length: int, max_anchor: int = 0
) -> tuple[torch.LongTensor, int]:
    """`lookup_continuation` and its anchor: how many of the row's final tokens equal those before the continuation's
    source (at least the matched n-gram, at most `max_anchor`; 0 without a match). A long anchor means the row has been
    copying that span for a while, and copies tend to go on.

    Args:
        tokens: `[num_tokens]` the row's real tokens.
        max_anchor: longest anchor to measure (the n-gram's size when smaller).
    """
    num_tokens = tokens.shape[0]
    for size in range(min(max_ngram, num_tokens - 1), min_ngram - 1, -1):
        windows = tokens[:-1].unfold(0, size, 1)  # [num_tokens - size, size], every n-gram but the final one
        hits = (windows == tokens[-size:]).all(dim=1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + size
            return tokens[start : start + length], _anchor(tokens, start, size, max_anchor)
    return tokens[:0], 0


def _anchor(tokens: torch.LongTensor, start: int, size: int, max_anchor: int) -> int:
    """Length of the common suffix of `tokens[:start]` and `tokens`, from `size` (already matched) up to `max_anchor`."""
    reach = min(max_anchor, start)
    if reach <= size:
        return size
    source = tokens[start - reach : start - size].flip(0)  # [reach - size] tokens before the match, nearest first
    row_end = tokens[tokens.shape[0] - reach : tokens.shape[0] - size].flip(0)  # [reach - size]
    differs = (source != row_end).nonzero()
    return size + (int(differs[0]) if differs.numel() else reach - size)


class PromptLookupProposer(PromptLookupCandidateGenerator, BatchedProposer):
    """Prompt lookup (n-gram) drafting for every row of a batch, each with its own draft length.

    Inside transformers' own batch-1 assisted loop it behaves as transformers' `PromptLookupCandidateGenerator`.
    Its draft tokens are proposed deterministically (`Proposal.probs` is `None`), which the sampling verifier treats
    as a one-hot `q`. It matches on the host copy of the rows' tokens (`TokenBatch.host`), so it never reads the
    device.
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
        return self.matches(batch, lengths)[0]

    def matches(
        self, batch: TokenBatch, lengths: torch.LongTensor, max_anchor: int = 0
    ) -> tuple[list[torch.LongTensor], torch.LongTensor]:
        """`continuations` and their `[batch]` anchors (`lookup_match`; 0 for rows without a match or length 0), all
        on the host (`lengths` too)."""
        lengths = lengths.clamp(max=self.num_output_tokens)
        empty = (torch.zeros(0, dtype=torch.long), 0)
        found = [
            lookup_match(batch.host_real_tokens(row), self.max_ngram, self.min_ngram, int(lengths[row]), max_anchor)
            if int(lengths[row]) > 0
            else empty
            for row in range(batch.batch_size)
        ]
        anchors = torch.tensor([anchor for _, anchor in found], dtype=torch.long)
        return [continuation for continuation, _ in found], anchors

    def match_confidence(self) -> torch.Tensor | None:
        """`[batch]` confidence of the last `matches` (`BatchedProposer.free_confidence`); prompt lookup has none."""
        return None

    @staticmethod
    def proposal(batch: TokenBatch, found: list[torch.LongTensor]) -> Proposal:
        """A placeholder-padded `Proposal` of per-row continuations (`found`: on the host), copied to the device
        without waiting for it."""
        tokens, actual = padded(found, batch.batch_size, batch.pad_id)
        device = batch.tokens.device
        return Proposal(upload(tokens, device), upload(actual, device), None, host_lengths=actual)


def padded(found: list[torch.LongTensor], rows: int, pad_id: int) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Per-row continuations (`[found_b]` each) on the host as `[rows, longest]` tokens padded with `pad_id`, and
    their `[rows]` lengths."""
    actual = torch.tensor([f.shape[0] for f in found], dtype=torch.long)
    width = int(actual.max()) if found else 0
    tokens = torch.full((rows, width), pad_id, dtype=torch.long)
    for row, continuation in enumerate(found):
        tokens[row, : continuation.shape[0]] = continuation
    return tokens, actual
