"""Prompt-lookup tries: every continuation of every earlier occurrence of a row's final n-gram, merged into one tree.

Prompt lookup (`prompt_lookup.lookup_continuation`, like transformers' `PromptLookupCandidateGenerator`) drafts the
one continuation of a single match. When the final n-gram recurs several times, the continuations differ; a trie
keeps them all, sharing common prefixes, so the target checks every one of them in the same forward.

Each earlier position that continues a match is an *occurrence*, weighted by the longest n-gram (from `max_ngram`
down to `min_ngram` tokens) it matches. A trie node ranks by the longest n-gram among the occurrences passing through
it, then by how many pass through it (most frequent first), then by the most recent one. A child never ranks above
its parent, so keeping the best `budget` nodes keeps a tree; siblings come out best first.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .tree import TokenTree


@dataclass
class _TrieNode:
    token: int
    ngram: int = 0  # longest n-gram matched by an occurrence through this node
    count: int = 0  # occurrences through this node
    latest: int = -1  # start of the most recent occurrence through this node
    children: dict[int, _TrieNode] = field(default_factory=dict)

    def rank(self) -> tuple[int, int, int]:
        return (self.ngram, self.count, self.latest)


def lookup_occurrences(tokens: torch.LongTensor, max_ngram: int, min_ngram: int) -> dict[int, int]:
    """Start of every continuation of an earlier occurrence of the row's final n-gram -> longest n-gram size matched.

    Args:
        tokens: `[num_tokens]` the row's real tokens.
    """
    longest = torch.zeros(tokens.shape[0] + 1, dtype=torch.long)  # [num_tokens + 1] by continuation start
    for size in range(min(max_ngram, tokens.shape[0] - 1), min_ngram - 1, -1):
        windows = tokens[:-1].unfold(0, size, 1)  # [num_tokens - size, size], every n-gram but the final one
        starts = (windows == tokens[-size:]).all(dim=1).nonzero().flatten().cpu() + size
        longest[starts] = longest[starts].clamp(min=size)
    return {int(start): int(longest[start]) for start in longest.nonzero().flatten()}


def lookup_trie(
    tokens: torch.LongTensor, max_ngram: int, min_ngram: int, budget: int, max_depth: int
) -> tuple[list[int], list[int]]:
    """One row's prompt-lookup trie: node tokens (the root, the row's last token, first) and parent indices.

    Args:
        tokens: `[num_tokens]` the row's real tokens (at least one).
        budget: most draft nodes (the root not counted).
        max_depth: longest continuation kept.
    """
    root = _TrieNode(int(tokens[-1]))
    sequence = tokens.tolist()
    for start, ngram in lookup_occurrences(tokens, max_ngram, min_ngram).items():
        node = root
        for token in sequence[start : start + max_depth]:
            node = node.children.setdefault(token, _TrieNode(token))
            node.ngram, node.count, node.latest = max(node.ngram, ngram), node.count + 1, max(node.latest, start)
    return _best_first(root, budget)


def _best_first(root: _TrieNode, budget: int) -> tuple[list[int], list[int]]:
    """The `budget` best-ranked nodes (a tree, since children never outrank parents), parents before children."""
    node_tokens, parents = [root.token], [-1]
    frontier: list = []
    order = 0  # tie-breaker so the heap never compares nodes

    def push(children: dict[int, _TrieNode], parent: int) -> None:
        nonlocal order
        for child in children.values():
            heapq.heappush(frontier, (tuple(-value for value in child.rank()), order, parent, child))
            order += 1

    push(root.children, 0)
    while frontier and len(node_tokens) <= budget:
        _, _, parent, node = heapq.heappop(frontier)
        node_tokens.append(node.token)
        parents.append(parent)
        push(node.children, len(node_tokens) - 1)
    return node_tokens, parents


def prompt_lookup_tree(
    rows: Sequence[torch.LongTensor],
    max_ngram: int = 3,
    min_ngram: int = 1,
    budget: int = 8,
    max_depth: int = 5,
    placeholder: int = 0,
) -> TokenTree:
    """Prompt-lookup tries for a batch, padded into one `TokenTree` (rows without a match get only their root).

    Args:
        rows: per row, `[num_tokens]` its real tokens (the last one is the root).
        max_ngram: longest n-gram tried, as in prompt lookup.
        min_ngram: shortest n-gram tried.
        budget: most draft nodes per row.
        max_depth: most draft tokens on one path.
        placeholder: token id of padded node slots.
    """
    if min_ngram < 1 or max_ngram < min_ngram:
        raise ValueError(f"Need 1 <= min_ngram <= max_ngram; got min_ngram={min_ngram}, max_ngram={max_ngram}.")
    if budget < 0 or max_depth < 0:
        raise ValueError(f"`budget` and `max_depth` must be >= 0; got budget={budget}, max_depth={max_depth}.")
    if any(row.ndim != 1 or row.shape[0] == 0 for row in rows):
        raise ValueError("Every row must be a non-empty 1D tensor of its real tokens (its last token is the root).")
    tries = [lookup_trie(row, max_ngram, min_ngram, budget, max_depth) for row in rows]
    tree = TokenTree.from_parent_lists([t for t, _ in tries], [p for _, p in tries], placeholder)
    return TokenTree(*(tensor.to(rows[0].device) for tensor in (tree.tokens, tree.parents, tree.depths, tree.valid)))
