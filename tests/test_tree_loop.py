"""Token trees in the loop: draft-model trees and prompt-lookup tries must give exactly plain greedy output, and
sampled output must follow the target's distribution."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import left_padded_prompts, perturbed, tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hf_dynspec
from hf_dynspec import DynSpecConfig
from hf_dynspec.candidates import DraftTreeProposer, LookupTreeProposer
from hf_dynspec.policies.static import StaticPolicy


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request):
    target = tiny_model(request.param, seed=0)
    return target, perturbed(target, scale=0.05)


def plain(model, ids, mask, **kwargs):
    kwargs.setdefault("do_sample", False)
    return model.generate(input_ids=ids, attention_mask=mask, **kwargs)


def speculative(model, ids, mask, config: DynSpecConfig, draft=None, **kwargs):
    return model.generate(
        input_ids=ids,
        attention_mask=mask,
        assistant_model=draft,
        custom_generate=hf_dynspec.speculative_loop,
        dynspec_config=config,
        return_dict_in_generate=True,
        **kwargs,
    )


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    batch_size=st.integers(1, 6),
    depth=st.integers(1, 5),
    budget=st.integers(1, 12),
    branching=st.integers(1, 4),
    seed=st.integers(0, 1000),
    floor=st.sampled_from([0.0, 0.0, 0.01, 0.1]),
)
def test_draft_tree_matches_plain_greedy(pair, batch_size, depth, budget, branching, seed, floor):
    target, draft = pair
    ids, mask = left_padded_prompts([3 + (seed + 7 * row) % 12 for row in range(batch_size)], seed=seed)
    expected = plain(target, ids, mask, max_new_tokens=20)
    config = DynSpecConfig(policy="static", num_speculative_tokens=depth, tree_node_budget=budget, tree_branching=branching,
                           tree_min_node_probability=floor)
    out = speculative(target, ids, mask, config, draft, do_sample=False, max_new_tokens=20)
    assert torch.equal(out.sequences, expected)
    steps = [s for s in out.dynspec_stats.steps if max(s.draft_lengths) > 0]
    assert steps and all(max(s.draft_lengths) <= budget and max(s.draft_depths) <= depth for s in steps)
    assert all(a <= d for s in steps for a, d in zip(s.accepted, s.draft_depths))


def test_trees_accept_more_than_chains_of_the_same_depth(pair):
    target, draft = pair
    ids, mask = left_padded_prompts([5, 9, 12, 7], seed=3)
    chain = speculative(target, ids, mask, DynSpecConfig(policy="static", num_speculative_tokens=3), draft, max_new_tokens=32)
    tree_config = DynSpecConfig(policy="static", num_speculative_tokens=3, tree_node_budget=12, tree_branching=3)
    tree = speculative(target, ids, mask, tree_config, draft, max_new_tokens=32)
    assert torch.equal(tree.sequences, chain.sequences)
    assert tree.dynspec_stats.num_steps < chain.dynspec_stats.num_steps
    assert any(max(s.draft_lengths) > max(s.draft_depths) for s in tree.dynspec_stats.steps), "no step branched"


def test_tree_with_eos_inside_a_branch_and_compaction(pair):
    target, draft = pair
    ids, mask = left_padded_prompts([4, 9, 6, 11, 3, 8], seed=11)
    generated = plain(target, ids, mask, max_new_tokens=20)[:, ids.shape[1] :]
    eos = int(torch.bincount(generated[:, 3:12].reshape(-1)).argmax())  # a token plain emits mid-sequence
    expected = plain(target, ids, mask, max_new_tokens=90, eos_token_id=eos)
    config = DynSpecConfig(policy="static", num_speculative_tokens=4, tree_node_budget=10, tree_branching=3, compact_min_holes=4)
    out = speculative(target, ids, mask, config, draft, do_sample=False, max_new_tokens=90, eos_token_id=eos)
    assert torch.equal(out.sequences, expected)
    assert out.dynspec_stats.compactions > 0


@pytest.mark.parametrize("threshold, deepest", [(1.0, 1), (0.0, 4)])
def test_early_stop_ends_greedy_trees(pair, threshold, deepest):
    """The confidence stop judges a tree's best node at each depth: a threshold no draft probability reaches ends
    every tree at depth 1, one every probability reaches lets trees grow to the depth cap; output stays plain's."""
    target, draft = pair
    ids, mask = left_padded_prompts([5, 9, 12, 7], seed=3)
    expected = plain(target, ids, mask, max_new_tokens=24)
    options = {"threshold": threshold, "adaptive": False}
    config = DynSpecConfig(policy="confidence", policy_options=options, num_speculative_tokens=4, tree_node_budget=8,
                           tree_branching=2)
    out = speculative(target, ids, mask, config, draft, do_sample=False, max_new_tokens=24)
    assert torch.equal(out.sequences, expected)
    depths = [d for s in out.dynspec_stats.steps for d in s.draft_depths or []]
    assert depths and max(depths) == deepest
    if threshold == 1.0:
        assert any(n > d for s in out.dynspec_stats.steps for n, d in zip(s.draft_lengths, s.draft_depths)), "no branch"


class StopAtDepth(StaticPolicy):
    """Drafts `depth_cap` deep and stops every tree after depth `stop_after`, recording what the stop is shown."""

    def __init__(self, depth_cap: int, stop_after: int) -> None:
        super().__init__(depth_cap)
        self.stop_after = stop_after
        self.seen: list[tuple[list[int], list[float]]] = []

    def continue_drafting(self, row_ids, position, draft_probs):
        positions = torch.as_tensor(position).expand(row_ids.shape[0])
        self.seen.append((positions.tolist(), draft_probs.tolist()))
        return positions + 1 < self.stop_after


def test_early_stop_sees_each_depths_best_node(pair):
    """The stop is shown one probability per row and depth, in order, with the draft's probability of its most likely
    first token at depth 1; a tree grows no deeper than where it said stop, and the output stays plain's."""
    target, draft = pair
    ids, mask = left_padded_prompts([7], seed=2)
    expected = plain(target, ids, mask, max_new_tokens=12)
    policy = StopAtDepth(depth_cap=4, stop_after=2)
    config = DynSpecConfig(num_speculative_tokens=4, tree_node_budget=6, tree_branching=2)
    out = speculative(target, ids, mask, config, draft, dynspec_policy=policy, do_sample=False, max_new_tokens=12)
    assert torch.equal(out.sequences, expected)
    drafted = [step for step in out.dynspec_stats.steps if step.draft_lengths[0] > 0]
    deep = [step for step in drafted if step.requested_lengths[0] > 2]  # the cap leaves room below depth 2
    assert deep and all(step.draft_depths == [2] for step in deep)
    assert all(step.draft_depths[0] <= 2 for step in drafted)
    assert any(step.draft_lengths[0] > 2 for step in drafted), "no tree branched"
    shown = [positions for positions, _ in policy.seen]  # depth 1, then depth 2 where the cap allows depth 3
    assert shown.count([0]) == len(drafted) and shown.count([1]) == len(deep) and shown[0] == [0]
    with torch.no_grad():  # the draft after the prompt and the prefill's token
        first = draft(expected[:, : ids.shape[1] + 1]).logits[0, -1].softmax(-1).max()
    assert policy.seen[0][1][0] == pytest.approx(float(first), rel=1e-3)
    assert all(0.0 < q <= 1.0 for _, probs in policy.seen for q in probs)


@pytest.mark.parametrize("branching", [2, 3])
def test_tree_judge_shows_the_stop_every_proposable_sibling(pair, branching):
    """With `tree_stop_judges='tree'` the stop is shown, at depth 1, the draft's probability that the target's first
    token is any of the root's children (the sum of its `branching` likeliest tokens), and at depth 2 the share of the
    tree's depth-1 mass its depth-2 nodes carry; the tree grows and stops as with 'best', and output stays plain's."""
    target, draft = pair
    ids, mask = left_padded_prompts([7], seed=2)
    expected = plain(target, ids, mask, max_new_tokens=12)
    policy = StopAtDepth(depth_cap=4, stop_after=2)
    config = DynSpecConfig(num_speculative_tokens=4, tree_node_budget=12, tree_branching=branching,
                           tree_stop_judges="tree")
    out = speculative(target, ids, mask, config, draft, dynspec_policy=policy, do_sample=False, max_new_tokens=12)
    assert torch.equal(out.sequences, expected)
    assert all(step.draft_depths[0] <= 2 for step in out.dynspec_stats.steps if step.draft_lengths[0] > 0)
    with torch.no_grad():  # the draft after the prompt and the prefill's token
        probs = draft(expected[:, : ids.shape[1] + 1]).logits[0, -1].softmax(-1)
    top = probs.topk(branching)
    assert policy.seen[0] == ([0], [pytest.approx(float(top.values.sum()), rel=1e-3)])
    assert policy.seen[0][1][0] > float(top.values[0])  # more than 'best' shows: the siblings count
    # depth 2: the children of the `branching` depth-1 nodes, over those nodes' mass
    with torch.no_grad():
        below = torch.stack([
            draft(torch.cat([expected[:, : ids.shape[1] + 1], token.view(1, 1)], 1)).logits[0, -1].softmax(-1)
            for token in top.indices
        ])  # [branching, vocab]
    reached = (top.values.unsqueeze(1) * below.topk(branching).values).sum()
    assert policy.seen[1] == ([1], [pytest.approx(float(reached / top.values.sum()), rel=1e-3)])


def test_node_floor_drops_unlikely_nodes(pair, monkeypatch):
    """With `tree_min_node_probability`, a greedy tree proposes exactly the budget's most valuable nodes whose draft
    path probability reaches the floor (always at least the best one), fewer than without it; output stays plain's."""
    target, draft = pair
    ids, mask = left_padded_prompts([5, 9, 12, 7], seed=3)
    expected = plain(target, ids, mask, max_new_tokens=24)
    select, seen = DraftTreeProposer._select, []

    def recording(self, candidates, budgets, fed_columns, q_store, batch):
        proposal = select(self, candidates, budgets, fed_columns, q_store, batch)
        values = candidates.values.sort(dim=1, descending=True).values  # [batch, created]
        ranks = torch.arange(values.shape[1]).expand_as(values)
        top = torch.isfinite(values) & (ranks < budgets.unsqueeze(1))
        seen.append((top, values, proposal.lengths.clone(), self.config.tree_min_node_probability))
        return proposal

    monkeypatch.setattr(DraftTreeProposer, "_select", recording)
    nodes = {}
    for floor in (0.0, 0.05):
        config = DynSpecConfig(policy="static", num_speculative_tokens=4, tree_node_budget=12, tree_branching=3,
                               tree_min_node_probability=floor)
        out = speculative(target, ids, mask, config, draft, do_sample=False, max_new_tokens=24)
        assert torch.equal(out.sequences, expected)
        nodes[floor] = sum(sum(s.draft_lengths) for s in out.dynspec_stats.steps)
    for top, values, lengths, floor in seen:
        kept = top & ((values >= math.log(floor)) | (torch.arange(values.shape[1]) == 0)) if floor else top
        assert torch.equal(lengths, kept.sum(dim=1))
    assert any(floor and bool((lengths < top.sum(dim=1)).any()) for top, _, lengths, floor in seen), "nothing dropped"
    assert nodes[0.05] < nodes[0.0]


def test_node_floor_is_validated():
    for floor in (-0.1, 1.0, "0.1", True):
        with pytest.raises(ValueError, match="`tree_min_node_probability` must be a number in \\[0, 1\\)"):
            DynSpecConfig(tree_min_node_probability=floor)


def test_tree_judge_is_validated():
    with pytest.raises(ValueError, match="`tree_stop_judges` must be one of"):
        DynSpecConfig(tree_stop_judges="mass")


def test_lookup_trie_matches_plain_greedy(pair):
    target, _ = pair
    base = torch.tensor([[5, 6, 7, 8, 5, 6, 9, 5, 6, 7, 3, 5, 6]])
    ids = torch.cat([base, base.flip(1), base.roll(3, 1)], dim=0)
    mask = torch.ones_like(ids)
    expected = plain(target, ids, mask, max_new_tokens=24)
    config = DynSpecConfig(policy="static", num_speculative_tokens=4, tree_node_budget=8)
    out = speculative(target, ids, mask, config, prompt_lookup_num_tokens=4, do_sample=False, max_new_tokens=24)
    assert torch.equal(out.sequences, expected)
    assert any(max(s.draft_lengths) > max(s.draft_depths) for s in out.dynspec_stats.steps), "no trie branched"


def test_proposers_are_chosen_by_the_config(pair, monkeypatch):
    target, draft = pair
    ids, mask = left_padded_prompts([5, 7], seed=1)
    seen = []
    original = hf_dynspec.loop.loop_proposer

    def spy(choice):
        proposer = original(choice)
        seen.append(type(proposer))
        return proposer

    monkeypatch.setattr(hf_dynspec.loop, "loop_proposer", spy)
    speculative(target, ids, mask, DynSpecConfig(policy="static", tree_node_budget=4), draft, max_new_tokens=4)
    speculative(target, ids, mask, DynSpecConfig(policy="static", tree_node_budget=4), prompt_lookup_num_tokens=3, max_new_tokens=4)
    assert seen == [DraftTreeProposer, LookupTreeProposer]


def test_tree_settings_are_validated(pair):
    with pytest.raises(ValueError, match="tree_node_budget"):
        DynSpecConfig(tree_node_budget=-1)
    with pytest.raises(ValueError, match="tree_branching"):
        DynSpecConfig(tree_branching=0)
    target, draft = pair
    ids, mask = left_padded_prompts([5, 7], seed=1)
    with pytest.raises(ValueError, match="proposes chains"):
        speculative(target, ids, mask, DynSpecConfig(tree_node_budget=4, proposer="hybrid"), draft, max_new_tokens=4)


# ---- sampling ---------------------------------------------------------------------------------------------------------
def _first_tokens(target, ids, draws: int, config: DynSpecConfig | None, draft=None) -> torch.Tensor:
    """`[draws, 3]` the first three sampled tokens of `draws` copies of one prompt, in one batch."""
    batch = ids.expand(draws, -1)
    mask = torch.ones_like(batch)
    kwargs = dict(do_sample=True, max_new_tokens=3, top_k=0, temperature=1.0)
    if config is None:
        return plain(target, batch, mask, **kwargs)[:, -3:]
    return speculative(target, batch, mask, config, draft, **kwargs).sequences[:, -3:]


def _tree_sampling_p_value(family: str) -> float:
    """Joint law of the first three tokens, tree speculation against plain sampling: the smaller chi-square p-value of
    tokens (1, 2) and tokens (2, 3). An unrelated draft makes rejections, and so the residual rules, common."""
    target, draft = tiny_model(family, seed=0), tiny_model(family, seed=7)
    torch.manual_seed(0)
    ids = torch.tensor([[3, 14, 15, 9, 2, 6]])
    draws = 6000
    config = DynSpecConfig(policy="static", num_speculative_tokens=3, tree_node_budget=6, tree_branching=2)
    reference = _first_tokens(target, ids, draws, None)
    trees = _first_tokens(target, ids, draws, config, draft)
    return min(_chi_square_p(reference[:, :2], trees[:, :2]), _chi_square_p(reference[:, 1:], trees[:, 1:]))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_sampling_with_trees_follows_the_target(family):
    assert _tree_sampling_p_value(family) > 1e-3


def test_sampling_test_catches_a_wrong_residual(monkeypatch):
    """Keeping `p` after a rejected child (instead of `norm(max(0, p - q))`) must be caught by the same test."""
    monkeypatch.setattr(hf_dynspec.verification, "_reject_residual", lambda p, q: p)
    assert _tree_sampling_p_value("llama") < 1e-3


def _chi_square_p(first: torch.Tensor, second: torch.Tensor, bins: int = 12) -> float:
    """p-value of a two-sample chi-square test on the `bins` most common rows (the rest pooled)."""
    from scipy.stats import chi2_contingency

    keys = [tuple(r) for r in torch.cat([first, second]).tolist()]
    common = [k for k, _ in __import__("collections").Counter(keys).most_common(bins)]
    table = [[0] * (len(common) + 1) for _ in range(2)]
    for sample, rows in enumerate((first, second)):
        for row in rows.tolist():
            key = tuple(row)
            table[sample][common.index(key) if key in common else len(common)] += 1
    return float(chi2_contingency(table)[1])


def test_sampling_trees_with_fewer_allowed_tokens_than_branches(pair):
    """top_k=1 leaves one token with q > 0 where the tree wants 3 children: only it is proposed, and sampling with
    top_k=1 is the target's argmax, so the output equals plain greedy decoding."""
    target, draft = pair
    ids, mask = left_padded_prompts([6, 9, 4], seed=5)
    expected = plain(target, ids, mask, max_new_tokens=16)
    config = DynSpecConfig(policy="static", num_speculative_tokens=3, tree_node_budget=9, tree_branching=3)
    out = speculative(target, ids, mask, config, draft, do_sample=True, top_k=1, max_new_tokens=16)
    assert torch.equal(out.sequences, expected)
    assert all(n <= d for s in out.dynspec_stats.steps for n, d in zip(s.draft_lengths, s.draft_depths or []))


def test_draft_tree_refuses_transformers_chain_loop(pair):
    from transformers import GenerationConfig, LogitsProcessorList

    from hf_dynspec.placement import Placement

    target, draft = pair
    placement = Placement.of(torch.device("cpu"), target, draft)
    proposer = DraftTreeProposer(draft, LogitsProcessorList(), GenerationConfig(), placement, DynSpecConfig())
    with pytest.raises(NotImplementedError, match="chains only"):
        proposer.get_candidates(torch.tensor([[5, 6, 7]]))
