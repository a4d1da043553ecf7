"""Prompt lookup: continue the row's latest n-gram from an earlier occurrence in the row itself (chains or tries)."""

from __future__ import annotations

from collections.abc import Hashable

import torch
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from ..sequences import TokenBatch
from .base import EarlyStop, Proposal
from .free import MAX_ANCHOR, ModelFreeProposer, ModelFreeSource, Offer
from .trie import lookup_trie


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


class LookupSource(ModelFreeSource):
    """Prompt lookup for one row at a time: the tokens that followed the latest earlier occurrence of the row's last
    n-gram (`lookup_match`), or every continuation of every earlier occurrence as a trie (`trie.lookup_trie`)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def offer(self, row: Hashable, tokens: torch.LongTensor, max_tokens: int) -> Offer:
        found, anchor = lookup_match(tokens, self.max_ngram, self.min_ngram, max_tokens, MAX_ANCHOR)
        return Offer(found, anchor)

    def tree(self, row: Hashable, tokens: torch.LongTensor, depth: int, budget: int) -> tuple[list[int], list[int]]:
        nodes, parents = lookup_trie(tokens, self.max_ngram, self.min_ngram, budget, depth)
        return nodes[1:], parents[1:]  # node 0 of the trie is its root, the row's newest token


class PromptLookupProposer(PromptLookupCandidateGenerator, ModelFreeProposer):
    """Prompt lookup (n-gram) drafting for every row of a batch, each with its own draft length (`LookupSource`).

    Inside transformers' own batch-1 assisted loop it behaves as transformers' `PromptLookupCandidateGenerator`.
    Alone, its lengths are sized as a draft's are, from the acceptance the policy learns for it, as transformers sizes
    prompt lookup (`free_lengths` is `None`); a hybrid proposer prices its offers as model-free beside the draft model.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, num_output_tokens: int = 10, **kwargs) -> None:
        PromptLookupCandidateGenerator.__init__(
            self, num_output_tokens=num_output_tokens, max_matching_ngram_size=max_ngram, **kwargs
        )
        ModelFreeProposer.__init__(self, LookupSource(max_ngram, min_ngram), num_output_tokens)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def free_lengths(self, batch: TokenBatch, max_length: int) -> None:
        return None

    def propose(
        self,
        batch: TokenBatch,
        lengths: torch.LongTensor,
        early_stop: EarlyStop | None = None,
        free_rows: torch.BoolTensor | None = None,
        node_budgets: torch.LongTensor | None = None,
    ) -> Proposal:
        proposal = ModelFreeProposer.propose(self, batch, lengths, early_stop, free_rows, node_budgets)
        self.last_free_rows = None  # sized as a draft: its acceptance is learned as a draft's
        return proposal


class LookupTreeProposer(PromptLookupProposer):
    """Prompt-lookup tries for every row of a batch (`trie.lookup_trie`): `lengths` cap each row's depth,
    `node_budgets` its draft nodes (the depth when not given). Every child is a fixed proposal for the sampling
    verifier."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, num_output_tokens: int = 10, **kwargs) -> None:
        super().__init__(max_ngram, min_ngram, num_output_tokens, **kwargs)
        self.trees = True
