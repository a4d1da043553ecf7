"""Draft lookahead: prompt-lookup guesses fed along with each draft forward give the same chain in fewer forwards."""

from __future__ import annotations

import pytest
import torch
from conftest import perturbed, tiny_model
from test_hybrid import repetitive_prompts
from test_sampling import VOCAB, assert_converges, exact_joint, small_vocab_pair  # noqa: F401 (fixture)
from transformers import GenerationConfig, LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

import hf_dynspec
from hf_dynspec import DynSpecConfig
from hf_dynspec.calibration import LOOKAHEAD_ROUNDS, affordable_lookahead
from hf_dynspec.candidates.draft_model import DraftModelProposer
from hf_dynspec.placement import Placement
from hf_dynspec.policies import DraftLengthPolicy, PolicyInput
from hf_dynspec.sequences import TokenBatch

UNCAPPED = {"draft_lookahead_max_cost": None, "proposer": "draft"}
"""These tests are about what lookahead guesses do, so every guess token is fed, whatever a forward's width costs,
and the draft model proposes alone (no copies beside it)."""


def speculate(target, draft, ids, mask, **config):
    return target.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=32, assistant_model=draft,
        custom_generate=hf_dynspec.speculative_loop, dynspec_config=DynSpecConfig(**{"policy": "static", **UNCAPPED, **config}),
        return_dict_in_generate=True,
    )


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("lengths", [[11], [6, 13, 9], [5, 8, 12, 7, 10, 14]])
def test_lookahead_drafts_the_same_chain_in_fewer_forwards(family, lengths):
    target = tiny_model(family, seed=0)
    draft = perturbed(target, scale=0.05)
    ids, mask = repetitive_prompts(lengths, seed=len(lengths))
    plain = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=32)
    stepwise = speculate(target, draft, ids, mask, num_speculative_tokens=6, compact_min_holes=4, draft_lookahead=0)
    ahead = speculate(target, draft, ids, mask, num_speculative_tokens=6, compact_min_holes=4,
                      draft_lookahead=5 * len(lengths), prompt_lookup_max_tokens=6)  # no tokens past the length
    assert torch.equal(ahead.sequences, plain) and torch.equal(stepwise.sequences, plain)
    # the same proposals, step by step, so the same acceptance ...
    assert [s.draft_lengths for s in ahead.dynspec_stats.steps] == [s.draft_lengths for s in stepwise.dynspec_stats.steps]
    assert [s.accepted for s in ahead.dynspec_stats.steps] == [s.accepted for s in stepwise.dynspec_stats.steps]
    # ... for fewer draft forwards: a forward serves every row, so a batch saves one when all its rows' guesses hit
    assert ahead.dynspec_stats.draft_forwards <= stepwise.dynspec_stats.draft_forwards
    if len(lengths) == 1:
        assert ahead.dynspec_stats.draft_forwards < stepwise.dynspec_stats.draft_forwards


def test_tokens_a_forward_yields_may_run_past_the_length_but_never_cost_a_forward():
    target = tiny_model("llama", seed=0)
    draft = perturbed(target, scale=0.05)
    ids, mask = repetitive_prompts([11], seed=0)
    plain = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=40)
    out = target.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=40, assistant_model=draft,
        custom_generate=hf_dynspec.speculative_loop, return_dict_in_generate=True,
        dynspec_config=DynSpecConfig(policy="static", num_speculative_tokens=2, draft_lookahead=6, prompt_lookup_max_tokens=7,
                                     **UNCAPPED),
    )
    assert torch.equal(out.sequences, plain)
    steps = out.dynspec_stats.steps
    assert all(s.requested_lengths[0] <= 2 and s.draft_lengths[0] <= 7 for s in steps)
    assert any(s.draft_lengths[0] > 2 for s in steps)  # guesses carried some drafts past their length ...
    assert out.dynspec_stats.draft_forwards < sum(s.requested_lengths[0] for s in steps)  # ... for no extra forward


@pytest.mark.parametrize("policy", ["goodput", "static"])
def test_lookahead_keeps_greedy_identity_with_eos_and_compaction(policy):
    target = tiny_model("llama", seed=1, eos_token_id=4)
    draft = perturbed(target, scale=0.1, seed=3)
    ids, mask = repetitive_prompts([9, 15, 6, 12], seed=7)
    plain = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=32)
    out = speculate(target, draft, ids, mask, policy=policy, num_speculative_tokens=5, draft_lookahead=4,
                    compact_min_holes=2, compact_hole_fraction=0.05)
    assert torch.equal(out.sequences, plain)


@pytest.mark.parametrize("lengths", [[11], [11, 7, 13]])
def test_lookahead_with_an_early_stop_that_never_stops_drafts_the_same_chain_in_fewer_forwards(lengths):
    target = tiny_model("llama", seed=0)
    draft = perturbed(target, scale=0.05)
    ids, mask = repetitive_prompts(lengths, seed=2)
    config = dict(policy="confidence", num_speculative_tokens=6, prompt_lookup_max_tokens=6,
                  policy_options={"threshold": 0.0, "adaptive": False})
    ahead = speculate(target, draft, ids, mask, draft_lookahead=5 * len(lengths), **config)
    stepwise = speculate(target, draft, ids, mask, draft_lookahead=0, **config)
    assert torch.equal(ahead.sequences, stepwise.sequences)
    assert [s.draft_lengths for s in ahead.dynspec_stats.steps] == [s.draft_lengths for s in stepwise.dynspec_stats.steps]
    assert ahead.dynspec_stats.draft_forwards <= stepwise.dynspec_stats.draft_forwards
    if len(lengths) == 1:  # a batch saves a forward only when every row's guesses hit
        assert ahead.dynspec_stats.draft_forwards < stepwise.dynspec_stats.draft_forwards


class StopAfterTwo(DraftLengthPolicy):
    """Asks for 6 draft tokens and stops every row after its second; records the positions it was asked about."""

    def __init__(self):
        self.judged: list[tuple[int, int]] = []  # (row id, position)

    def draft_lengths(self, request: PolicyInput) -> torch.LongTensor:
        return torch.full((request.batch_size,), 6, dtype=torch.long)

    def continue_drafting(self, row_ids, position, draft_probs):
        positions = torch.as_tensor(position).expand(row_ids.shape[0])
        self.judged += list(zip(row_ids.tolist(), positions.tolist()))
        return positions < 1


@pytest.mark.parametrize("lookahead", [0, 10])
def test_a_row_an_early_stop_ends_draws_no_more_tokens_even_guessed_ones(lookahead):
    target = tiny_model("llama", seed=0)
    draft = target  # the draft agrees with the target, so lookup guesses from a repetitive prompt often hold
    ids, mask = repetitive_prompts([11, 7, 13], seed=2)
    policy = StopAfterTwo()
    out = target.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=24, assistant_model=draft,
        custom_generate=hf_dynspec.speculative_loop, return_dict_in_generate=True, dynspec_policy=policy,
        dynspec_config=DynSpecConfig(num_speculative_tokens=6, draft_lookahead=lookahead, prompt_lookup_max_tokens=6,
                                     **UNCAPPED),
    )
    assert torch.equal(out.sequences, target.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                                      max_new_tokens=24))
    assert all(k <= 2 for step in out.dynspec_stats.steps for k in step.draft_lengths)
    assert {position for _, position in policy.judged} == {0, 1}  # every drawn token judged, at its own position


@pytest.mark.slow
def test_lookahead_chains_follow_the_draft_distribution(small_vocab_pair):  # noqa: F811
    """Sampled chains of two tokens: rows whose first draw matches the guess take the second from the guess's
    column, the others from a second forward; together they must follow the draft's own distribution exactly."""
    target, draft = small_vocab_pair
    prompt = torch.tensor([3, 1, 3] * 3 + [3, 1])  # lookup guesses 3, which the draft draws with q = 0.66
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.9), TopKLogitsWarper(5)])
    with torch.no_grad():
        joint = exact_joint(draft, prompt, processors).reshape(VOCAB**2, VOCAB).sum(dim=1)  # [VOCAB ** 2] two tokens
    placement = Placement.of(torch.device("cpu"), target, draft)
    used_guess = []

    def draw(n: int) -> torch.Tensor:
        config = DynSpecConfig(policy="static", num_speculative_tokens=2, draft_lookahead=n, **UNCAPPED)  # one guess token for each of n rows
        proposer = DraftModelProposer(draft, processors, GenerationConfig(do_sample=True), placement, config)
        tokens = torch.cat([prompt.expand(n, -1), torch.zeros((n, 2), dtype=torch.long)], dim=1)
        batch = TokenBatch(tokens, prompt.shape[0], torch.full((n,), prompt.shape[0]), torch.zeros(n, dtype=torch.long), 0)
        proposer.start(batch)
        with torch.no_grad():
            proposal = proposer.propose(batch, torch.full((n,), 2))
        assert proposal.lengths.eq(2).all()
        used_guess.append(proposer._fed_nodes[:, 0] >= 0)  # [n] the guess's column holds the first draft token
        return proposal.tokens[:, 0] * VOCAB + proposal.tokens[:, 1]

    torch.manual_seed(0)
    assert_converges(draw, joint, sizes=(200, 2_000, 20_000))
    hits = torch.cat(used_guess)
    assert 0.05 < hits.double().mean() < 0.95  # both paths ran, on many rows


def test_negative_lookahead_is_refused():
    with pytest.raises(ValueError, match="`draft_lookahead` must be an integer >= 0"):
        DynSpecConfig(draft_lookahead=-1)
    for cost in (0.5, "1.25", True):
        with pytest.raises(ValueError, match="`draft_lookahead_max_cost` must be a number >= 1"):
            DynSpecConfig(draft_lookahead_max_cost=cost)


# ---- how many guess tokens a forward may carry -------------------------------------------------------------------------
def _stepped(step_width: int, factor: float = 2.0):
    """A timer: a forward costs 1 s up to `step_width` tokens and `factor` s beyond; it records the widths timed."""
    timed = []

    def timer(width: int) -> float:
        timed.append(width)
        return 1.0 if width <= step_width else factor

    return timer, timed


@pytest.mark.parametrize(("most", "step_width", "expected", "widths"), [
    (8, 100, 8, [1, 2, 3, 5, 9]),  # wide forwards nearly free: every guess token
    (8, 3, 2, [1, 2, 3, 5, 9]),  # a forward over 5 tokens costs twice one: 2 guess tokens
    (8, 1, 0, [1, 2, 3, 5, 9]),  # two tokens already cost twice one: no lookahead
    (4, 100, 4, [1, 2, 3, 5]),  # the widest the lookahead allows is timed too
    (40, 100, 40, [1, 2, 3, 5, 9, 17, 33, 41]),
])
def test_affordable_lookahead_is_the_widest_forward_within_the_cost(most, step_width, expected, widths):
    model = tiny_model("llama", seed=0)
    timer, timed = _stepped(step_width)
    assert affordable_lookahead(model, most, 1.25, timer=timer) == expected
    assert timed == widths * LOOKAHEAD_ROUNDS  # rounds that each time every width once
    timer, _ = _stepped(step_width, factor=1.2)  # within the cost: 20% more for the wider forwards is fine
    assert affordable_lookahead(model, most, 1.25, timer=timer) == most


@pytest.mark.parametrize(("base", "step_width", "expected"), [
    (3, 100, 8),  # wide forwards nearly free: every guess beside 3 frontier nodes too
    (3, 5, 2),  # forwards over more than 5 tokens cost twice: 2 guesses beside 3 nodes (4 beside one token)
    (3, 3, 0),  # the frontier's 3 tokens are all a forward may feed
])
def test_affordable_lookahead_beside_a_wider_forward(base, step_width, expected):
    """Guesses are priced against the forward they ride on: over `base` tokens, timed as widths `base + g`."""
    model = tiny_model("llama", seed=0)
    timer, timed = _stepped(step_width)
    assert affordable_lookahead(model, 8, 1.25, timer=timer, base=base) == expected
    assert timed == [3, 4, 5, 7, 11] * LOOKAHEAD_ROUNDS
    assert affordable_lookahead(model, 8, 1.25, timer=_stepped(step_width)[0]) == min(8, step_width - 1)
    with pytest.raises(ValueError, match="`base` must be an int >= 1"):
        affordable_lookahead(model, 8, 1.25, timer=timer, base=0)


def _bursty(timer, burst: range, slowdown: float = 4.0):
    """`timer`, with the calls numbered in `burst` (counting from 0) `slowdown` times slower: other processes."""
    calls = iter(range(10**6))
    return lambda width: timer(width) * (slowdown if next(calls) in burst else 1.0)


@pytest.mark.parametrize(("step_width", "expected"), [(100, 8), (3, 2)])
def test_affordable_lookahead_shrugs_off_a_burst_of_load(step_width, expected):
    """A burst of load over fewer consecutive forwards than a round times leaves every width a clean sample. Priced
    by one sample (or by samples taken back to back), a burst over the wider forwards would cut the lookahead, and a
    burst over the one-token forward would let through forwards that cost too much."""
    model = tiny_model("llama", seed=0)
    widths = 5  # forwards over 1, 2, 3, 5 and 9 tokens
    for first in range(widths * LOOKAHEAD_ROUNDS):
        for length in range(1, widths + 1):
            timer = _bursty(_stepped(step_width)[0], range(first, first + length))
            assert affordable_lookahead(model, 8, 1.25, timer=timer) == expected, (first, length)


def test_a_draft_drafts_token_by_token_where_lookahead_forwards_cost_too_much():
    target = tiny_model("llama", seed=0)
    draft = perturbed(target, scale=0.05)
    ids, mask = repetitive_prompts([11], seed=1)
    config = {"num_speculative_tokens": 6, "prompt_lookup_max_tokens": 6, "narrow_linear": "off"}
    stepwise = speculate(target, draft, ids, mask, draft_lookahead=0, **config)
    runs = {}
    for name, step_width in (("costly", 1), ("cheap", 100)):  # what the draft's forwards are measured to cost
        affordable_lookahead(draft, 8, 1.25, narrow=0, timer=_stepped(step_width)[0])  # measured once per process
        runs[name] = speculate(target, draft, ids, mask, draft_lookahead=8, draft_lookahead_max_cost=1.25, **config)
    assert all(torch.equal(run.sequences, stepwise.sequences) for run in runs.values())
    assert runs["costly"].dynspec_stats.draft_forwards == stepwise.dynspec_stats.draft_forwards
    assert (runs["costly"].dynspec_stats.draft_lookahead, runs["cheap"].dynspec_stats.draft_lookahead) == (0, 8)
    assert runs["cheap"].dynspec_stats.draft_forwards < stepwise.dynspec_stats.draft_forwards


def test_policies_that_stop_early_or_not():
    from hf_dynspec.policies import GoodputPolicy, GoodputSettings, build_policy

    assert not GoodputPolicy().stops_early  # goodput's stop is opt-in
    assert GoodputPolicy(GoodputSettings(early_stop="marginal")).stops_early
    assert build_policy(DynSpecConfig(policy="confidence")).stops_early
    assert not build_policy(DynSpecConfig(policy="static")).stops_early


def test_the_lookahead_measurement_is_not_timed_as_drafting(monkeypatch):
    """The draft's lookahead width is measured on the first call of a process, inside the first `propose`. Timed as
    drafting, its seconds made the policy's first draft sample several times a draft forward's cost, which priced
    drafting out of every later call."""
    import time

    measure = DraftModelProposer.lookahead_tokens

    def slow_measurement(self):
        time.sleep(0.3)
        return measure(self)

    monkeypatch.setattr(DraftModelProposer, "lookahead_tokens", slow_measurement)
    target = tiny_model("llama", seed=0)
    draft = perturbed(target, scale=0.05)
    ids, mask = repetitive_prompts([11], seed=0)
    out = speculate(target, draft, ids, mask, num_speculative_tokens=2)
    steps = out.dynspec_stats.steps
    assert len(steps) > 3 and all(s.draft_seconds < 0.3 for s in steps)
    drafting = [s for s in steps if s.requested_lengths[0] > 0]
    assert len(drafting) > 3 and all(s.overhead_seconds >= 0.3 for s in drafting)  # the measurement is overhead
    assert out.dynspec_stats.overhead_seconds >= 0.3 * len(drafting)
