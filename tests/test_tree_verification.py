"""Tree verification: greedy against a brute-force walk, chains against the chain verifiers, sampling convergence."""

from __future__ import annotations

import pytest
import torch
from test_sampling import assert_converges

from hf_dynspec import verification
from hf_dynspec.candidates import TokenTree
from hf_dynspec.verification import verify_greedy, verify_sampling, verify_tree_greedy, verify_tree_sampling


def random_tree(generator: torch.Generator, scores: torch.Tensor, max_nodes: int) -> TokenTree:
    """Random trees with distinct sibling tokens; about half the nodes carry their parent's argmax."""
    batch, _, vocab = scores.shape
    argmax = scores.argmax(dim=-1)
    tokens, parents = [], []
    for row in range(batch):
        count = int(torch.randint(1, max_nodes + 1, (1,), generator=generator))
        row_tokens, row_parents = [0], [-1]
        for node in range(1, count):
            parent = int(torch.randint(0, node, (1,), generator=generator))
            taken = {t for t, p in zip(row_tokens, row_parents) if p == parent}
            free = [t for t in range(vocab) if t not in taken]
            wanted = int(argmax[row, parent])
            coin = float(torch.rand(1, generator=generator))
            token = wanted if coin < 0.5 and wanted in free else free[int(torch.randint(len(free), (1,), generator=generator))]
            row_tokens.append(token)
            row_parents.append(parent)
        tokens.append(row_tokens)
        parents.append(row_parents)
    return TokenTree.from_parent_lists(tokens, parents)


def brute_force_greedy(scores: torch.Tensor, tree: TokenTree, row: int) -> tuple[list[int], int]:
    """Walk from the root along the target's argmax: the accepted nodes and the next token."""
    node, path = 0, []
    while True:
        wanted = int(scores[row, node].argmax())
        children = [j for j in range(tree.num_nodes) if tree.valid[row, j] and int(tree.parents[row, j]) == node]
        matching = [j for j in children if int(tree.tokens[row, j]) == wanted]
        if not matching:
            return path, wanted
        node = matching[0]
        path.append(node)


# ---- greedy ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(5))
def test_greedy_matches_brute_force_walk(seed):
    generator = torch.Generator().manual_seed(seed)
    nodes, vocab = 9, 4
    scores = torch.randn(6, nodes, vocab, generator=generator)
    tree = random_tree(generator, scores, nodes)
    scores = scores[:, : tree.num_nodes]
    result = verify_tree_greedy(scores, tree)
    for row in range(tree.batch_size):
        path, next_token = brute_force_greedy(scores, tree, row)
        assert result.accepted[row].item() == len(path)
        assert result.last_node[row].item() == (path[-1] if path else 0)
        assert [n for n in result.path[row].tolist() if n >= 0] == path
        assert result.next_tokens[row].item() == next_token
        assert result.kept[row].nonzero().flatten().tolist() == [0] + path
        emitted = [int(tree.tokens[row, n]) for n in path] + [next_token]
        assert result.emitted[row, : len(path) + 1].tolist() == emitted


def test_greedy_hand_built_tree():
    #  root ─┬─ 3 ── 1          target argmax: root -> 2, node "2" -> 0
    #        └─ 2 ─┬─ 1
    #              └─ 0 ── 4    node "0" -> 4, node "4" -> 3 (the bonus token)
    tree = TokenTree.from_parent_lists([[9, 3, 2, 1, 1, 0, 4]], [[-1, 0, 0, 1, 2, 2, 5]])
    argmax = [2, 0, 0, 0, 0, 4, 3]
    scores = torch.nn.functional.one_hot(torch.tensor([argmax]), 5).double()
    result = verify_tree_greedy(scores, tree)
    assert result.accepted.tolist() == [3]
    assert result.path.tolist() == [[2, 5, 6]]
    assert result.next_tokens.tolist() == [3]
    assert result.kept.tolist() == [[True, False, True, False, False, True, True]]
    assert result.emitted.tolist() == [[2, 0, 4, 3]]


@pytest.mark.parametrize("seed", range(3))
def test_chain_as_tree_equals_verify_greedy(seed):
    generator = torch.Generator().manual_seed(seed)
    batch, k, vocab = 16, 5, 4  # a small vocabulary so that long accepted prefixes occur
    scores = torch.randn(batch, k + 1, vocab, generator=generator)
    drafts = torch.where(
        torch.rand(batch, k, generator=generator) < 0.7,
        scores[:, :k].argmax(dim=-1),
        torch.randint(vocab, (batch, k), generator=generator),
    )
    lengths = torch.randint(0, k + 1, (batch,), generator=generator)
    accepted, next_tokens = verify_greedy(scores, drafts, lengths)
    result = verify_tree_greedy(scores, TokenTree.from_chain(drafts, lengths))
    assert torch.equal(result.accepted, accepted)
    assert torch.equal(result.next_tokens, next_tokens)
    assert accepted.max() > 1  # the case is not trivial


# ---- sampling: chains -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fixed_drafts", [False, True])
def test_chain_as_tree_samples_like_verify_sampling(fixed_drafts):
    generator = torch.Generator().manual_seed(3)
    batch, k, vocab = 64, 4, 5
    p = torch.softmax(torch.randn(batch, k + 1, vocab, generator=generator) * 2, dim=-1)
    q = torch.softmax(torch.randn(batch, k, vocab, generator=generator) * 2, dim=-1)
    drafts = torch.multinomial(q.flatten(0, 1), 1, generator=generator).view(batch, k)
    lengths = torch.randint(0, k + 1, (batch,), generator=generator)
    q_chain = None if fixed_drafts else q
    q_tree = None if fixed_drafts else torch.cat([q, torch.zeros(batch, 1, vocab)], dim=1)  # leaves draw nothing
    for seed in range(3):
        accepted, next_tokens = verify_sampling(p, drafts, lengths, q_chain, torch.Generator().manual_seed(seed))
        result = verify_tree_sampling(p, TokenTree.from_chain(drafts, lengths), q_tree, torch.Generator().manual_seed(seed))
        assert torch.equal(result.accepted, accepted)
        assert torch.equal(result.next_tokens, next_tokens)
    assert (accepted >= 2).any() and (accepted < lengths).any()  # long accepted prefixes and rejections occur


def test_sampling_hand_built_certain_outcomes():
    # root children 3 then 1; p at the root wants 1, so 3 is rejected (p(3) = 0) and 1 accepted with certainty;
    # node "1" is a leaf whose p is one-hot on 4: the bonus token
    tree = TokenTree.from_parent_lists([[9, 3, 1]], [[-1, 0, 0]])
    p = torch.nn.functional.one_hot(torch.tensor([[1, 0, 4]]), 5).double()
    for q in (None, torch.full((1, 3, 5), 0.2, dtype=torch.float64)):
        result = verify_tree_sampling(p, tree, q)
        assert result.accepted.tolist() == [1] and result.path.tolist() == [[2]]
        assert result.next_tokens.tolist() == [4] and result.kept.tolist() == [[True, False, True]]


# ---- sampling: convergence to the target distribution ------------------------------------------------------------------
VOCAB = 6
SIZES = (50, 500, 5_000, 50_000)
# root ─ three children ─ two children each
PARENTS = [-1, 0, 0, 0, 1, 1, 2, 2, 3, 3]


def tables(seed: int) -> tuple[torch.Tensor, ...]:
    """Target and draft distributions: `p_root` `[vocab]`, `p_next` `[vocab, vocab]` (given the first token), same for q.

    The draft is sharp where the target is not, so that the without-replacement correction matters.
    """
    generator = torch.Generator().manual_seed(seed)
    p_root = torch.softmax(torch.randn(VOCAB, generator=generator), dim=-1)
    p_next = torch.softmax(torch.randn(VOCAB, VOCAB, generator=generator), dim=-1)
    q_root = torch.softmax(torch.randn(VOCAB, generator=generator) * 4, dim=-1)
    q_next = torch.softmax(torch.randn(VOCAB, VOCAB, generator=generator) * 4, dim=-1)
    return p_root, p_next, q_root, q_next


def two_tokens(n: int, seed: int, fixed: bool, generator: torch.Generator) -> torch.Tensor:
    """Verify `n` trees; returns the first two emitted tokens as one index `x1 * VOCAB + x2`.

    When only one token is emitted, the second comes from the target given the first, as the next step would draw it.
    """
    p_root, p_next, q_root, q_next = tables(seed)
    if fixed:  # children fixed in advance: tokens 0, 1, 2 under the root, then the two next tokens under each
        first = torch.tensor([0, 1, 2]).expand(n, 3)
        second = torch.stack([(first + 1) % VOCAB, (first + 2) % VOCAB], dim=2).flatten(1)  # [n, 6]
    else:  # children sampled from q without replacement
        first = torch.multinomial(q_root.expand(n, -1), 3, replacement=False, generator=generator)  # [n, 3]
        second = torch.multinomial(q_next[first.flatten()], 2, replacement=False, generator=generator).view(n, 6)
    tokens = torch.cat([torch.zeros(n, 1, dtype=torch.long), first, second], dim=1)  # [n, 10]
    tree = TokenTree.from_parents(tokens, torch.tensor(PARENTS).expand(n, -1))
    p = torch.cat([p_root.expand(n, 1, -1), p_next[first], p_root.expand(n, 6, -1)], dim=1)  # [n, 10, vocab]
    q = None if fixed else torch.cat([q_root.expand(n, 1, -1), q_next[first], q_root.expand(n, 6, -1)], dim=1)
    result = verify_tree_sampling(p, tree, q, generator)
    x1 = result.emitted[:, 0]
    follow_up = torch.multinomial(p_next[x1], 1, generator=generator).squeeze(1)
    x2 = torch.where(result.accepted >= 1, result.emitted[:, 1], follow_up)
    return x1 * VOCAB + x2


def exact_two_tokens(seed: int) -> torch.Tensor:
    p_root, p_next, _, _ = tables(seed)
    return (p_root.unsqueeze(1) * p_next).flatten()  # [vocab * vocab]


@pytest.mark.parametrize("fixed", [False, True], ids=["sampled-children", "fixed-children"])
def test_tree_sampling_follows_target(fixed):
    generator = torch.Generator().manual_seed(0)
    assert_converges(lambda n: two_tokens(n, 1, fixed, generator), exact_two_tokens(1), SIZES)


@pytest.mark.parametrize(
    ("fixed", "helper", "wrong"),
    [
        (False, "_without_token", lambda q, token: q),  # q not updated: children treated as drawn with replacement
        (True, "_reject_residual", lambda p, q: p),  # p not updated: a rejected fixed child can still come out
    ],
    ids=["no-without-replacement-correction", "no-residual"],
)
def test_convergence_test_catches_wrong_rules(monkeypatch, fixed, helper, wrong):
    monkeypatch.setattr(verification, helper, wrong)
    generator = torch.Generator().manual_seed(0)
    with pytest.raises(AssertionError):
        assert_converges(lambda n: two_tokens(n, 1, fixed, generator), exact_two_tokens(1), SIZES)
