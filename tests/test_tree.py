"""Token trees: structure, masks and positions by hand, tree logits against plain causal logits, prompt-lookup tries."""

from __future__ import annotations

import pytest
import torch
from conftest import left_padded_prompts, tiny_model
from transformers.cache_utils import DynamicCache

from hf_dynspec.cache import cache_kwarg
from hf_dynspec.candidates import TokenTree, prompt_lookup_tree
from hf_dynspec.candidates.trie import lookup_occurrences

#        row 0:  root 9 ─┬─ 5 ─┬─ 7           row 1:  root 9 ── 4     (three placeholder slots)
#                        │     └─ 8
#                        └─ 6
TREE = dict(tokens=[[9, 5, 6, 7, 8], [9, 4]], parents=[[-1, 0, 0, 1, 1], [-1, 0]])


@pytest.fixture
def tree() -> TokenTree:
    return TokenTree.from_parent_lists(TREE["tokens"], TREE["parents"])


# ---- structure, masks and positions by hand -------------------------------------------------------------------------
def test_from_parent_lists_pads_and_derives_depths(tree):
    assert tree.tokens.tolist() == [[9, 5, 6, 7, 8], [9, 4, 0, 0, 0]]
    assert tree.parents.tolist() == [[-1, 0, 0, 1, 1], [-1, 0, -1, -1, -1]]
    assert tree.depths.tolist() == [[0, 1, 1, 2, 2], [0, 1, 0, 0, 0]]
    assert tree.valid.tolist() == [[True] * 5, [True, True, False, False, False]]
    assert tree.max_depth == 2 and tree.num_draft.tolist() == [4, 1]


def test_positions_paths_children(tree):
    assert tree.position_ids(torch.tensor([3, 5])).tolist() == [[3, 4, 4, 5, 5], [5, 6, 5, 5, 5]]
    assert tree.paths().tolist() == [
        [[0, -1, -1], [0, 1, -1], [0, 2, -1], [0, 1, 3], [0, 1, 4]],
        [[0, -1, -1], [0, 1, -1], [2, -1, -1], [3, -1, -1], [4, -1, -1]],
    ]
    assert tree.children().tolist() == [
        [[1, 2], [3, 4], [-1, -1], [-1, -1], [-1, -1]],
        [[1, -1], [-1, -1], [-1, -1], [-1, -1], [-1, -1]],
    ]


def test_ancestor_and_attention_masks(tree):
    expected_nodes = [
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 0, 1]],
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 0, 1]],
    ]
    assert tree.ancestor_mask().long().tolist() == expected_nodes
    cache_valid = torch.tensor([[1, 0, 1], [0, 1, 1]])  # row 0 has a hole, row 1 left padding
    mask = tree.attention_mask(cache_valid, torch.float64)
    assert mask.shape == (2, 1, 5, 8) and mask.dtype == torch.float64
    visible = (mask[:, 0] == 0).long().tolist()
    cache_part = [[[1, 0, 1]] * 5, [[0, 1, 1]] * 2 + [[0, 0, 0]] * 3]  # placeholder slots see no cache column
    assert visible == [[c + n for c, n in zip(cache_part[b], expected_nodes[b])] for b in range(2)]
    assert float(mask.min()) == torch.finfo(torch.float64).min


def test_chain_is_a_tree_of_single_children():
    chain = TokenTree.from_chain(torch.tensor([[11, 12, 13], [21, 22, 0]]), torch.tensor([3, 1]), torch.tensor([10, 20]))
    assert chain.tokens.tolist() == [[10, 11, 12, 13], [20, 21, 22, 0]]
    assert chain.parents.tolist() == [[-1, 0, 1, 2], [-1, 0, -1, -1]]
    assert chain.depths.tolist() == [[0, 1, 2, 3], [0, 1, 0, 0]]
    assert chain.valid.tolist() == [[True] * 4, [True, True, False, False]]
    assert chain.position_ids(torch.tensor([7, 2])).tolist() == [[7, 8, 9, 10], [2, 3, 2, 2]]
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    assert torch.equal(chain.ancestor_mask()[0], causal)
    assert torch.equal(chain.ancestor_mask()[1], torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]).bool())
    assert chain.paths().tolist() == [[[0, -1, -1, -1], [0, 1, -1, -1], [0, 1, 2, -1], [0, 1, 2, 3]],
                                      [[0, -1, -1, -1], [0, 1, -1, -1], [2, -1, -1, -1], [3, -1, -1, -1]]]
    walked = TokenTree.from_parents(chain.tokens, chain.parents, chain.valid)  # the same tree, not known as a chain
    assert not walked.chain and torch.equal(walked.paths(), chain.paths())


@pytest.mark.parametrize(
    ("tokens", "parents", "message"),
    [
        ([[9, 1, 2]], [[-1, 2, 0]], "parent after child"),
        ([[9, 1, 2]], [[-1, 2, 1]], "cycle"),
        ([[9, 1, 2]], [[-1, 1, 0]], "cycle"),
        ([[9, 1, 2]], [[0, 0, 0]], "Node 0 of every row must be the root"),
        ([[9, 1, 2]], [[-1, 0, -1]], "only the root"),
        ([[9, 1, 1]], [[-1, 0, 0]], "distinct tokens"),
    ],
)
def test_invalid_structures_are_named(tokens, parents, message):
    with pytest.raises(ValueError, match=message):
        TokenTree.from_parent_lists(tokens, parents)


def test_depth_mismatch_is_named(tree):
    depths = tree.depths.clone()
    depths[0, 3] = 1
    with pytest.raises(ValueError, match="node 3 has depth 1 but its parent 1 implies 2"):
        TokenTree(tree.tokens, tree.parents, depths, tree.valid)
    with pytest.raises(ValueError, match="`valid` has shape"):
        TokenTree(tree.tokens, tree.parents, tree.depths, tree.valid[:, :3])


# ---- tree logits equal plain causal logits of every branch ----------------------------------------------------------
def ragged_prefix(model, prompt_lengths: list[int]) -> tuple[DynamicCache, torch.Tensor, list[list[int]]]:
    """A left-padded prefill plus a chunk whose middle column is a hole in row 0 (as a ragged cache holds them).

    Returns the cache, its `[batch, length]` validity and each row's real tokens so far.
    """
    ids, mask = left_padded_prompts(prompt_lengths, seed=3)
    cache = DynamicCache(config=model.config)
    model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), **{cache_kwarg(model.forward): cache})
    chunk = torch.tensor([[40, 41, 42], [50, 51, 52]])
    chunk_valid = torch.tensor([[1, 0, 1], [1, 1, 1]])  # 41 was rejected in row 0: a hole
    positions = mask.sum(1, keepdim=True) + (chunk_valid.cumsum(1) - 1)
    valid = torch.cat([mask, chunk_valid], dim=1)
    model(input_ids=chunk, attention_mask=valid, position_ids=positions, **{cache_kwarg(model.forward): cache})
    sequences = [[int(t) for t, v in zip(ids_row, valid_row) if v] for ids_row, valid_row in
                 zip(torch.cat([ids, chunk], 1), valid)]
    return cache, valid, sequences


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_tree_logits_equal_branch_logits(family, attention):
    model = tiny_model(family, seed=1, attn_implementation=attention)
    # Eager attention in float64 turns a left-padded prefill into NaN by itself (min mask plus score overflows to
    # -inf on padding rows), with or without trees: check eager on unpadded prompts, SDPA on left-padded ones.
    cache, cache_valid, sequences = ragged_prefix(model, [4, 6] if attention == "sdpa" else [5, 5])
    tree = TokenTree.from_parent_lists([[60, 61, 62, 63, 64, 65], [70, 71, 72]], [[-1, 0, 0, 1, 1, 3], [-1, 0, 1]])
    prefix_lengths = cache_valid.sum(dim=1)
    with torch.no_grad():
        logits = model(
            input_ids=tree.tokens,
            attention_mask=tree.attention_mask(cache_valid, model.dtype),
            position_ids=tree.position_ids(prefix_lengths),
            **{cache_kwarg(model.forward): cache},
        ).logits  # [batch, nodes, vocab]
        paths = tree.paths()
        for row in range(tree.batch_size):
            for node in range(tree.num_nodes):
                if not tree.valid[row, node]:
                    continue
                branch = [int(tree.tokens[row, n]) for n in paths[row, node] if n >= 0]
                plain = model(torch.tensor([sequences[row] + branch])).logits[0, -1]
                # float64, yet eager attention differs from the causal forward by up to 5e-7 on a CPU with AVX2 only
                # (exactly 0 with AMX); a wrong mask moves logits by O(1)
                torch.testing.assert_close(logits[row, node], plain, rtol=0, atol=1e-10 if attention == "sdpa" else 1e-5)


# ---- prompt-lookup tries -----------------------------------------------------------------------------------------------
def branches(tree: TokenTree, row: int = 0) -> list[list[int]]:
    """Every root-to-leaf path of a row as a list of draft tokens (root excluded), in node order."""
    children = tree.children()[row]
    leaves = [n for n in range(1, tree.num_nodes) if tree.valid[row, n] and children[n, 0] < 0]
    paths = tree.paths()[row]
    return [[int(tree.tokens[row, n]) for n in paths[leaf, 1:] if n >= 0] for leaf in leaves]


def test_occurrences_keep_the_longest_ngram():
    #                       0  1  2  3  4  5  6  7  8
    sequence = torch.tensor([7, 5, 1, 2, 6, 1, 3, 5, 1])
    # final 2-gram "5 1" occurs at 1 (continuation starts at 3); the 1-gram "1" also at 5 (continuation at 6)
    assert lookup_occurrences(sequence, 3, 1) == {3: 2, 6: 1}
    assert lookup_occurrences(sequence, 3, 2) == {3: 2}


def test_trie_merges_continuations_most_frequent_first():
    sequence = torch.tensor([5, 1, 2, 9, 5, 1, 3, 5, 1, 2, 7, 8, 5, 1])
    tree = prompt_lookup_tree([sequence], max_ngram=3, min_ngram=1, budget=10, max_depth=3)
    assert int(tree.tokens[0, 0]) == 1  # the root is the row's last token
    # continuations of "5 1": [2 9 5], [3 5 1], [2 7 8]; the shared "2" is the most frequent branch, so it comes first
    assert sorted(branches(tree)) == [[2, 7, 8], [2, 9, 5], [3, 5, 1]]
    # best first: "2" (two occurrences), then the most recent single ones: 7 8 (start 9), 3 5 1 (start 6), 9 5 (start 2)
    assert tree.tokens[0].tolist() == [1, 2, 7, 8, 3, 5, 1, 9, 5]
    assert tree.parents[0].tolist() == [-1, 0, 1, 2, 0, 4, 5, 1, 7]


def test_trie_respects_budget_and_depth():
    sequence = torch.tensor([5, 1, 2, 9, 5, 1, 3, 5, 1, 2, 7, 8, 5, 1])
    tree = prompt_lookup_tree([sequence, torch.tensor([4, 4])], budget=4, max_depth=2)
    assert tree.num_draft.tolist() == [4, 1]
    assert tree.max_depth == 2
    # the best four nodes: "2" (two occurrences), then the most recent single ones: "7" under it, then "3", "5"
    assert tree.tokens[0].tolist() == [1, 2, 7, 3, 5]
    assert branches(tree) == [[2, 7], [3, 5]]
    assert branches(tree, 1) == [[4]]
    short = prompt_lookup_tree([torch.tensor([8]), torch.tensor([3, 4])], budget=4, max_depth=2)
    assert short.num_draft.tolist() == [0, 0] and short.tokens[:, 0].tolist() == [8, 4]


def test_trie_prefers_longer_ngram_matches():
    # "3 4" recurs once (continuation 9); "4" alone recurs twice with continuation 6
    sequence = torch.tensor([3, 4, 9, 0, 4, 6, 2, 4, 6, 3, 4])
    tree = prompt_lookup_tree([sequence], max_ngram=2, min_ngram=1, budget=1, max_depth=1)
    assert branches(tree) == [[9]]
    tree = prompt_lookup_tree([sequence], max_ngram=1, min_ngram=1, budget=1, max_depth=1)
    assert branches(tree) == [[6]]


def test_trie_rejects_bad_arguments():
    with pytest.raises(ValueError, match="min_ngram"):
        prompt_lookup_tree([torch.tensor([1, 2])], max_ngram=1, min_ngram=2)
    with pytest.raises(ValueError, match="budget"):
        prompt_lookup_tree([torch.tensor([1, 2])], budget=-1)
    with pytest.raises(ValueError, match="non-empty"):
        prompt_lookup_tree([torch.tensor([], dtype=torch.long)])
