"""Draft lookahead inside token trees: prompt-lookup guesses fed with a tree's draft forwards expand the path they
guess without forwards of its own. Output stays plain greedy's, sampled output follows the target's distribution."""

from __future__ import annotations

import pytest
import torch
from conftest import left_padded_prompts, perturbed, tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_lookahead import UNCAPPED, _stepped
from test_sampling import NEW, VOCAB, assert_converges, exact_joint, small_vocab_pair  # noqa: F401 (fixture)
from test_tree_loop import StopAtDepth, plain, speculative
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

from hf_dynspec import DynSpecConfig
from hf_dynspec.calibration import affordable_lookahead
from hf_dynspec.candidates import DraftTreeProposer
from hf_dynspec.candidates.draft_model import DraftModelProposer
from hf_dynspec.candidates.free import proposal_of


def copying_model(family: str, seed: int = 0):
    """A tiny model without attention output: its next token depends on the current one only, so greedy text soon
    cycles and prompt-lookup guesses of it hold."""
    model = tiny_model(family, seed=seed)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    return model


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request):
    target = copying_model(request.param)
    return target, perturbed(target, scale=0.05)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def attending_pair(request):
    target = tiny_model(request.param, seed=0)
    return target, perturbed(target, scale=0.05)


@pytest.fixture
def oracle_guesses(monkeypatch):
    """Guesses that are the draft's own greedy continuation of each path, from plain forwards of the whole sequence:
    they hold whatever the model, so trees grow along them with attention that matters."""

    def lookups(self, batch, drafted, wanted, lookahead):
        share = lookahead // max(1, int((wanted > 0).sum()))
        drafted = drafted() if callable(drafted) else drafted
        found = []
        for row in range(batch.batch_size):
            tokens = torch.cat([batch.real_tokens(row), drafted[row]])
            count = min(int(wanted[row]), share)
            for _ in range(count):
                tokens = torch.cat([tokens, self.draft_model(tokens[None]).logits[0, -1:].argmax(-1)])
            found.append(tokens[tokens.shape[0] - count :])
        padded = proposal_of(batch, found)
        guessed = (torch.arange(padded.max_length) < padded.lengths.unsqueeze(1)).long()
        return padded.tokens, guessed, (padded.tokens, guessed)  # on the device, then on the host (one CPU here)

    monkeypatch.setattr(DraftModelProposer, "_lookups", lookups)


@pytest.fixture
def adopted(monkeypatch) -> list[int]:
    """Per walk of a guess: how many guess columns became tree nodes (`DraftTreeProposer._adopt_guesses`)."""
    counts: list[int] = []
    original = DraftTreeProposer._adopt_guesses

    def spy(self, batch, growth, *args):
        original(self, batch, growth, *args)
        counts.append(int((growth.fed[-1] >= 0).sum()))

    monkeypatch.setattr(DraftTreeProposer, "_adopt_guesses", spy)
    return counts


def tree_config(lookahead: int, **settings) -> DynSpecConfig:
    return DynSpecConfig(**{"policy": "static", "draft_lookahead": lookahead, **UNCAPPED, **settings})


@pytest.mark.parametrize("lengths", [[13], [9, 5, 12]])
def test_a_chain_shaped_tree_is_the_same_with_lookahead_in_fewer_forwards(attending_pair, oracle_guesses, adopted, lengths):
    """With one child per node a tree is a chain: lookahead must give the same trees, step by step (a guess's logits
    are those of its node), and the depths its guesses cover cost no forward."""
    target, draft = attending_pair
    ids, mask = left_padded_prompts(lengths, seed=1)
    expected = plain(target, ids, mask, max_new_tokens=32)
    settings = dict(num_speculative_tokens=6, tree_node_budget=6, tree_branching=1)
    stepwise = speculative(target, ids, mask, tree_config(0, **settings), draft, do_sample=False, max_new_tokens=32)
    ahead = speculative(target, ids, mask, tree_config(8, **settings), draft, do_sample=False, max_new_tokens=32)
    assert torch.equal(stepwise.sequences, expected) and torch.equal(ahead.sequences, expected)
    for field in ("draft_lengths", "draft_depths", "accepted"):
        assert [getattr(s, field) for s in ahead.dynspec_stats.steps] == [getattr(s, field) for s in stepwise.dynspec_stats.steps]
    assert sum(adopted) > 0
    assert ahead.dynspec_stats.draft_forwards < stepwise.dynspec_stats.draft_forwards


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    batch_size=st.integers(1, 5),
    depth=st.integers(1, 6),
    budget=st.integers(1, 14),
    branching=st.integers(1, 3),
    lookahead=st.integers(1, 12),
    seed=st.integers(0, 1000),
)
def test_trees_with_lookahead_match_plain_greedy(pair, adopted, batch_size, depth, budget, branching, lookahead, seed):
    target, draft = pair
    ids, mask = left_padded_prompts([4 + (seed + 5 * row) % 12 for row in range(batch_size)], seed=seed)
    expected = plain(target, ids, mask, max_new_tokens=24)
    config = tree_config(lookahead, num_speculative_tokens=depth, tree_node_budget=budget, tree_branching=branching,
                         compact_min_holes=3, compact_hole_fraction=0.05)
    out = speculative(target, ids, mask, config, draft, do_sample=False, max_new_tokens=24)
    assert torch.equal(out.sequences, expected)
    steps = [s for s in out.dynspec_stats.steps if max(s.draft_lengths) > 0]
    assert all(max(s.draft_lengths) <= budget and max(s.draft_depths) <= depth for s in steps)


def test_lookahead_saves_forwards_on_branching_trees(pair, adopted):
    target, draft = pair
    ids, mask = left_padded_prompts([14], seed=4)
    settings = dict(num_speculative_tokens=6, tree_node_budget=12, tree_branching=2)
    stepwise = speculative(target, ids, mask, tree_config(0, **settings), draft, do_sample=False, max_new_tokens=40)
    ahead = speculative(target, ids, mask, tree_config(8, **settings), draft, do_sample=False, max_new_tokens=40)
    assert torch.equal(ahead.sequences, stepwise.sequences)
    assert sum(adopted) > 0
    assert ahead.dynspec_stats.draft_forwards < stepwise.dynspec_stats.draft_forwards  # the same tokens, fewer forwards
    assert any(n > d for s in ahead.dynspec_stats.steps for n, d in zip(s.draft_lengths, s.draft_depths)), "no branch"


@pytest.fixture
def guess_calls(monkeypatch) -> list[tuple[bool, int]]:
    """Per `DraftTreeProposer._tree_guesses` call: whether it guesses below the root, and the guess tokens allowed."""
    calls: list[tuple[bool, int]] = []
    original = DraftTreeProposer._tree_guesses

    def spy(self, batch, candidates, anchor, wanted, reach, lookahead):
        calls.append((candidates is None, lookahead))
        return original(self, batch, candidates, anchor, wanted, reach, lookahead)

    monkeypatch.setattr(DraftTreeProposer, "_tree_guesses", spy)
    return calls


@pytest.mark.parametrize(("step_width", "root", "deeper"), [
    (100, 8, 8),  # wide forwards nearly free: every guess at every depth
    (2, 1, 0),  # one token more than a root's tail is free, any beside a frontier of 2 is not
    (3, 2, 1),
])
def test_a_trees_deeper_forwards_carry_only_the_guesses_affordable_beside_its_frontier(
    pair, adopted, guess_calls, step_width, root, deeper
):
    """A forward over a tree's frontier already feeds `branching` nodes, so its guesses are measured against that
    width: where a forward over more than `step_width` tokens costs twice as much, the root's forward carries
    `step_width - 1` guesses and a deeper one `step_width - branching`. The output stays plain greedy's."""
    target, draft = pair
    for base in (1, 2):  # measured once per process: what the draft's forwards cost, from the first call on
        affordable_lookahead(draft, 8, 1.25, narrow=0, timer=_stepped(step_width)[0], base=base)
    ids, mask = left_padded_prompts([14], seed=4)
    config = DynSpecConfig(policy="static", num_speculative_tokens=6, tree_node_budget=12, tree_branching=2,
                           draft_lookahead=8, draft_lookahead_max_cost=1.25, narrow_linear="off")
    out = speculative(target, ids, mask, config, draft, do_sample=False, max_new_tokens=40)
    assert torch.equal(out.sequences, plain(target, ids, mask, max_new_tokens=40))
    assert {allowed for at_root, allowed in guess_calls if at_root} == {root}
    assert {allowed for at_root, allowed in guess_calls if not at_root} == {deeper}
    assert out.dynspec_stats.draft_lookahead == root


def test_a_stopped_tree_drops_what_lookahead_grew_below_the_stop(attending_pair, oracle_guesses, adopted):
    """Guesses that hold grow trees far down; the stop still ends every tree at depth 2, and the output stays
    plain's."""
    target, draft = attending_pair
    ids, mask = left_padded_prompts([11, 7], seed=2)
    expected = plain(target, ids, mask, max_new_tokens=20)
    policy = StopAtDepth(depth_cap=6, stop_after=2)
    config = DynSpecConfig(num_speculative_tokens=6, tree_node_budget=8, tree_branching=2, draft_lookahead=10, **UNCAPPED)
    out = speculative(target, ids, mask, config, draft, dynspec_policy=policy, do_sample=False, max_new_tokens=20)
    assert torch.equal(out.sequences, expected)
    assert max(adopted) > 2  # lookahead grew some tree below depth 2 ...
    depths = [d for s in out.dynspec_stats.steps for d in s.draft_depths or []]
    assert depths and max(depths) == 2  # ... and the stop cut it off


@pytest.mark.slow
def test_sampled_trees_with_lookahead_follow_the_target(small_vocab_pair, adopted):  # noqa: F811
    """Joint law of the first `NEW` sampled tokens, against the exact one. Lookup guesses 1, 3, ... after the prompt,
    which the draft often draws among a node's two children, so trees grow along guesses in many rows."""
    target, draft = small_vocab_pair
    prompt = torch.tensor([3, 1, 3, 1, 3, 1, 3, 1, 3])
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.9), TopKLogitsWarper(5)])
    with torch.no_grad():
        joint = exact_joint(target, prompt, processors)

    def draw(n: int) -> torch.Tensor:
        ids = prompt.unsqueeze(0).expand(n, -1)
        config = tree_config(4 * n, num_speculative_tokens=3, tree_node_budget=6, tree_branching=2)  # 4 guesses a row
        out = speculative(target, ids, torch.ones_like(ids), config, draft, do_sample=True, temperature=0.9, top_k=5,
                          top_p=None, max_new_tokens=NEW + 3)  # the first step drafts 3 deep
        generated = out.sequences[:, prompt.shape[0] : prompt.shape[0] + NEW]  # [n, NEW]
        return (generated * torch.tensor([VOCAB**i for i in reversed(range(NEW))])).sum(dim=1)

    torch.manual_seed(0)
    assert_converges(draw, joint, sizes=(200, 2_000, 20_000))
    assert sum(adopted) > 1_000
