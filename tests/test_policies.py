"""Draft-length policies without models: the goodput search, batch tables, threshold, heuristic, confidence."""

from __future__ import annotations

import itertools
import json
import tracemalloc
from dataclasses import replace

import numpy as np
import pytest
import torch

from hf_dynspec import DynSpecConfig
from hf_dynspec.cost_models import DraftTiming, PaddedCostModel, PiecewiseLinear, Profile, StepCostModel, TargetTiming
from hf_dynspec.estimators import AcceptanceEstimator, ConfidenceScale, expected_tokens
from hf_dynspec.policies import (
    BatchTablePolicy,
    ConfidencePolicy,
    ConfidenceSettings,
    GoodputPolicy,
    GoodputSettings,
    HeuristicPolicy,
    PolicyInput,
    PrefillFeedback,
    StepFeedback,
    ThresholdPolicy,
    best_draft_lengths,
    build_policy,
)
from hf_dynspec.policies import search as search_module
from hf_dynspec.policies.confidence import RATE_EDGES, ConfidenceStopper, acceptance_rates, best_threshold
from hf_dynspec.policies.search import Candidates

# The two speculative configs of vLLM's dynamic speculative decoding documentation, verbatim.
VLLM_EAGLE = """{
"method": "eagle",
"model": "yuhuili/EAGLE-LLaMA3.1-Instruct-8B",
"num_speculative_tokens": 3,
"num_speculative_tokens_per_batch_size": [
[1, 64, 3],
[65, 128, 1],
[129, 512, 0]
]
}"""
VLLM_EAGLE3 = """{
"method": "eagle3",
"model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
"num_speculative_tokens": 3,
"num_speculative_tokens_per_batch_size": [
[1, 16, 5],
[17, 32, 4],
[33, 64, 3],
[65, 128, 1],
[129, 512, 0]
]
}"""


# ---- synthetic cost models -----------------------------------------------------------------------------------------
class FunctionCost(StepCostModel):
    """A cost model from a Python function of the length vector (priced one candidate at a time)."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def step_seconds(self, batch_size: int, lengths: torch.LongTensor) -> float:
        return float(self.fn(batch_size, lengths))


def padded_cost(batch, lengths):  # the loop's reality: draft max(k) forwards, verify batch * (1 + max k) tokens
    k = int(lengths.max())
    return 0.2 + 0.01 * batch * (1 + k) + 0.03 * k


def ragged_cost(batch, lengths):  # a verifier that processes only real tokens: sum(1 + k_i)
    return 0.1 + 0.02 * float((1 + lengths).sum())


def mixed_cost(batch, lengths):  # draft priced by max(k), verification by sum(1 + k_i), with a superlinear term
    total = float((1 + lengths).sum())
    return 0.15 + 0.04 * int(lengths.max()) + 0.01 * total + 0.002 * total**1.5


def rate(acceptance: torch.Tensor, lengths: torch.LongTensor, cost) -> float:
    return float(expected_tokens(acceptance, lengths).sum()) / cost(acceptance.shape[0], lengths)


def brute_force(acceptance: torch.Tensor, caps: torch.LongTensor, cost) -> tuple[float, torch.LongTensor]:
    best, best_lengths = -1.0, None
    for combo in itertools.product(*[range(int(c) + 1) for c in caps]):
        lengths = torch.tensor(combo)
        value = rate(acceptance, lengths, cost)
        if value > best + 1e-12:
            best, best_lengths = value, lengths
    return best, best_lengths


def request(batch: int, max_k: int, remaining: int | list[int] = 100, step: int = 0, row_ids=None) -> PolicyInput:
    remaining_t = torch.tensor(remaining) if isinstance(remaining, list) else torch.full((batch,), remaining)
    rows = torch.arange(batch) if row_ids is None else torch.tensor(row_ids)
    return PolicyInput(step=step, row_ids=rows, remaining_tokens=remaining_t, max_draft_tokens=max_k)


def feedback(rows, lengths, accepted, draft_seconds=0.0, verify_seconds=0.1) -> StepFeedback:
    rows, lengths, accepted = torch.tensor(rows), torch.tensor(lengths), torch.tensor(accepted)
    tokens = len(rows) * (1 + int(lengths.max()))
    return StepFeedback(rows, lengths, lengths, accepted, draft_seconds, verify_seconds, tokens)


# ---- goodput: the search ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cost", [padded_cost, ragged_cost, mixed_cost], ids=["padded", "ragged", "mixed"])
def test_goodput_search_matches_brute_force(cost) -> None:
    generator = torch.Generator().manual_seed(0)
    unique_optima = 0
    for trial in range(40):
        batch = 1 + trial % 4
        max_k = 2 + trial % 3
        acceptance = torch.rand(batch, generator=generator, dtype=torch.float64)
        caps = torch.randint(0, max_k + 1, (batch,), generator=generator)
        chosen = best_draft_lengths(acceptance, caps, max_k, FunctionCost(cost))
        best, best_lengths = brute_force(acceptance, caps, cost)
        assert bool((chosen <= caps).all())
        assert rate(acceptance, chosen, cost) == pytest.approx(best, rel=1e-12)
        runner_up = max(
            rate(acceptance, torch.tensor(c), cost)
            for c in itertools.product(*[range(int(k) + 1) for k in caps])
            if list(c) != best_lengths.tolist()
        ) if int(caps.sum()) else -1.0
        if best - runner_up > 1e-9:  # a unique optimum: the very same lengths
            unique_optima += 1
            assert chosen.tolist() == best_lengths.tolist()
    assert unique_optima >= 20


def test_goodput_search_is_exact_at_batch_8_with_heterogeneous_rows() -> None:
    acceptance = torch.tensor([0.95, 0.9, 0.3, 0.1, 0.7, 0.55, 0.8, 0.05], dtype=torch.float64)
    caps = torch.tensor([3, 3, 3, 3, 3, 1, 2, 3])
    chosen = best_draft_lengths(acceptance, caps, 3, FunctionCost(ragged_cost))
    best, best_lengths = brute_force(acceptance, caps, ragged_cost)
    assert chosen.tolist() == best_lengths.tolist()
    assert len(set(chosen.tolist())) > 1  # rows with different acceptance get different lengths


def test_candidates_include_plain_decoding_and_respect_caps() -> None:
    acceptance = torch.tensor([0.9, 0.5, 0.2], dtype=torch.float64)
    caps = torch.tensor([4, 0, 2])
    candidates = Candidates.build(acceptance, caps, 4)
    lengths, tokens = torch.from_numpy(candidates.lengths()), torch.from_numpy(candidates.tokens)
    assert lengths[0].tolist() == [0, 0, 0] and float(tokens[0]) == 3.0
    assert bool((lengths <= caps).all())
    torch.testing.assert_close(tokens, expected_tokens(acceptance.expand(len(lengths), 3).reshape(-1),
                                                       lengths.reshape(-1)).reshape(-1, 3).sum(1))


def test_goodput_chooses_plain_decoding_when_verification_is_expensive() -> None:
    expensive = FunctionCost(lambda batch, lengths: 0.1 + 0.5 * int(lengths.max()))  # each extra token costs 5 steps
    acceptance = torch.full((4,), 0.9, dtype=torch.float64)
    chosen = best_draft_lengths(acceptance, torch.full((4,), 8), 8, expensive)
    assert chosen.tolist() == [0, 0, 0, 0]
    cheap = FunctionCost(lambda batch, lengths: 0.1 + 0.001 * int(lengths.max()))
    assert best_draft_lengths(acceptance, torch.full((4,), 8), 8, cheap).tolist() == [8, 8, 8, 8]


def test_goodput_min_gain_keeps_plain_decoding_on_a_marginal_win() -> None:
    cost = FunctionCost(lambda batch, lengths: 1.0 + 0.45 * int(lengths.max()))
    acceptance = torch.full((1,), 0.5, dtype=torch.float64)  # k = 1: 1.5 tokens in 1.45 s beats 1 token in 1 s by 3%
    assert best_draft_lengths(acceptance, torch.tensor([1]), 1, cost).tolist() == [1]
    assert best_draft_lengths(acceptance, torch.tensor([1]), 1, cost, min_gain=0.05).tolist() == [0]


def test_goodput_rejects_a_cost_model_returning_nonpositive_seconds() -> None:
    with pytest.raises(ValueError, match="finite positive seconds"):
        best_draft_lengths(torch.tensor([0.5]), torch.tensor([2]), 2, FunctionCost(lambda b, k: 0.0))


# ---- goodput: the policy -------------------------------------------------------------------------------------------
def measured_profile() -> Profile:
    """Target costs measured with Qwen2.5-Coder 1.5B (float32 CPU); draft forwards assumed a third of the target's."""
    return Profile(
        target_forward=[
            TargetTiming(1, 1, 0.229),
            TargetTiming(1, 8, 0.633),
            TargetTiming(16, 1, 0.656),
            TargetTiming(16, 2, 1.003),
        ],
        draft_forward=[DraftTiming(1, 0.076), DraftTiming(16, 0.22)],
    )


def goodput_with_acceptance(value: float, **options) -> GoodputPolicy:
    """The search alone (no loss budget and no measuring unless `options` set them), on a measured profile."""
    options.setdefault("loss_budget", None)
    options.setdefault("probe_z", 0.0)
    settings = GoodputSettings(cost_model="profile", profile=measured_profile().to_dict(), prior_acceptance=value,
                               **options)
    return GoodputPolicy(settings)


def test_goodput_speculates_at_batch_1_and_not_at_batch_16_with_measured_costs() -> None:
    policy = goodput_with_acceptance(0.75)
    policy.reset(16)
    assert int(policy.draft_lengths(request(1, 8)).max()) > 0
    assert policy.draft_lengths(request(16, 8)).tolist() == [0] * 16


def linear_profile() -> Profile:
    """A calibration grid of a target costing 0.2 s + 10 ms per token and a draft costing 50 ms + 5 ms per row."""
    sizes, tokens = [1, 2, 4, 8, 16, 32], [1, 2, 3, 5, 9]
    return Profile(
        target_forward=[TargetTiming(b, t, 0.2 + 0.01 * b * t) for b in sizes for t in tokens],
        draft_forward=[DraftTiming(b, 0.05 + 0.005 * b) for b in sizes],
    )


def test_goodput_lengths_rise_as_the_batch_shrinks() -> None:
    policy = GoodputPolicy(GoodputSettings(cost_model="profile", profile=linear_profile().to_dict(),
                                           prior_acceptance=0.8, loss_budget=None, probe_z=0.0))  # the search alone
    policy.reset(32)
    longest = [int(policy.draft_lengths(request(b, 8)).max()) for b in range(32, 0, -1)]
    assert longest == sorted(longest)  # nondecreasing as rows finish
    assert longest[0] == 0 and longest[-1] >= 3


def test_goodput_gives_rows_their_own_length_from_their_acceptance() -> None:
    policy = GoodputPolicy(GoodputSettings(prior_weight=1.0), cost_model=FunctionCost(ragged_cost))
    policy.reset(2)
    for _ in range(30):  # row 0 accepts everything, row 1 nothing
        policy.observe(feedback([0, 1], [4, 4], [4, 0]))
    lengths = policy.draft_lengths(request(2, 4))
    assert int(lengths[0]) > int(lengths[1])
    assert policy.acceptance.mean(torch.tensor([0])) > 0.9 > 0.2 > policy.acceptance.mean(torch.tensor([1]))


def test_goodput_caps_lengths_at_each_rows_remaining_budget() -> None:
    policy = goodput_with_acceptance(0.9)
    policy.reset(3)
    lengths = policy.draft_lengths(request(1, 8, remaining=[3]))
    assert lengths.tolist() == [2]
    assert policy.draft_lengths(request(1, 8, remaining=[1])).tolist() == [0]


def test_goodput_measures_an_uncertain_draft_where_the_call_can_repay_it() -> None:
    """Drafting pays only above acceptance 0.8. The prior (0.5, as sure as 4 observed tokens) says it does not, but
    could be wrong: with a long call ahead the expected gain of learning otherwise outweighs one step's loss, so the
    draft is measured; with two tokens left it is not, nor when the estimate is sure (a prior as heavy as 10 000
    tokens) or no optimism is allowed (`probe_z=0`: the optimistic search is the plain one)."""
    cost = FunctionCost(lambda batch, lengths: 1.0 + 0.8 * int(lengths.max()))

    def first_step(remaining: int, **settings) -> GoodputPolicy:
        policy = GoodputPolicy(GoodputSettings(**{"prior_acceptance": 0.5, "loss_budget": None, **settings}),
                               cost_model=cost)
        policy.reset(1)
        policy.draft_lengths(request(1, 4, remaining=remaining))
        return policy

    measured = first_step(1000)
    assert measured.last_probe and measured.last_exploration is None  # a fixed cost model never asks to explore
    assert not first_step(3).last_probe
    assert not first_step(1000, prior_weight=10_000.0).last_probe
    assert not first_step(1000, probe_z=0.0).last_probe


def test_a_draft_measured_poor_is_measured_again_only_as_its_evidence_ages() -> None:
    """Every draft token rejected: after the first measurements the estimate is low and sure, and measuring again
    waits until decay has made it uncertain enough to be worth a step; over 200 steps the draft runs on few of
    them, and more than once."""
    cost = FunctionCost(lambda batch, lengths: 1.0 + 0.8 * int(lengths.max()))
    policy = GoodputPolicy(GoodputSettings(prior_acceptance=0.5, loss_budget=None), cost_model=cost)
    policy.reset(1)
    drafted = []
    for step in range(200):
        lengths = policy.draft_lengths(request(1, 4, remaining=1000, step=step))
        policy.observe(feedback([0], lengths.tolist(), [0]))
        if int(lengths[0]):
            drafted.append(step)
    assert 2 <= len(drafted) <= 20, drafted
    assert drafted[-1] >= 100, drafted  # measured again late, not only at the start


def test_a_catch_up_is_weighed_against_the_tokens_left_in_the_call() -> None:
    """A draft that must first catch up on a 200-token prompt (6 s, six plain steps) is still measured where the
    call has 10 000 tokens left to repay it, but not where it has 1000; without a catch-up due it is measured there.
    (Probes that waited as many plain steps as they were expected to lose never came in calls whose catch-up was
    large: on follow-ups the default copied and never ran the draft.)"""
    cost = FunctionCost(lambda batch, lengths: 1.0 + 0.8 * int(lengths.max()))

    def measures(backlog: int, remaining: int) -> bool:
        policy = GoodputPolicy(GoodputSettings(prior_acceptance=0.5, loss_budget=None), cost_model=cost)
        policy.reset(1)
        policy.observe_prefill(PrefillFeedback(1, 100, 10.0, 0.3))  # the draft catches up at 0.03 s a token
        step = PolicyInput(step=0, row_ids=torch.tensor([0]), remaining_tokens=torch.tensor([remaining]),
                           max_draft_tokens=4, backlog=torch.tensor([backlog]))
        return int(policy.draft_lengths(step).max()) > 0

    assert measures(201, 10_000) and not measures(201, 1000)
    assert measures(1, 1000)


def test_goodput_from_dynspec_config_and_json(tmp_path) -> None:
    profile_path = tmp_path / "profile.json"
    measured_profile().save(profile_path)
    config = DynSpecConfig(
        num_speculative_tokens=8,
        policy="goodput",
        policy_options={"cost_model": "profile", "profile": str(profile_path), "early_stop": {"threshold": 0.3}},
    )
    config_path = tmp_path / "dynspec.json"
    config_path.write_text(json.dumps(config.to_dict()))
    policy = build_policy(DynSpecConfig.from_json_file(config_path))
    assert isinstance(policy, GoodputPolicy)
    assert policy.stopper is not None and policy.stopper.threshold == 0.3
    assert policy.cost_model.step_seconds(1, torch.tensor([0])) == pytest.approx(0.229)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"cost_model": "magic"}, "`cost_model` must be one of"),
        ({"cost_model": "profile"}, "needs `profile`"),
        ({"prior_acceptance": 1.5}, "`prior_acceptance`"),
        ({"prior_weight": 0}, "`prior_weight`"),
        ({"acceptance_decay": 0}, "`acceptance_decay`"),
        ({"window": 0}, "`window`"),
        ({"tolerance": -1}, "`tolerance`"),
        ({"probe_z": -1}, "`probe_z`"),
        ({"min_gain": -0.1}, "`min_gain`"),
        ({"early_stop": "yes"}, "`early_stop`"),
        ({"early_stop": {"treshold": 0.3}}, r"Unknown `early_stop` option\(s\) \['treshold'\]"),
        ({"speed": "fast"}, r"Unknown `goodput` policy option\(s\) \['speed'\]"),
        ({"cost_model": "profile", "profile": "/nonexistent/profile.json"}, "does not exist"),
    ],
)
def test_goodput_rejects_bad_options(options, message) -> None:
    with pytest.raises(ValueError, match=message):
        build_policy(DynSpecConfig(policy="goodput", policy_options=options))


# ---- batch_table ---------------------------------------------------------------------------------------------------
def test_batch_table_loads_vllm_examples_unchanged() -> None:
    eagle = BatchTablePolicy.from_vllm_config(json.loads(VLLM_EAGLE))
    assert [eagle.length_for(b) for b in (1, 64, 65, 128, 129, 512)] == [3, 3, 1, 1, 0, 0]
    assert eagle.ignored_keys == ["method", "model"]
    eagle3 = BatchTablePolicy.from_vllm_config(VLLM_EAGLE3)  # JSON text, as given to --speculative-config
    # k above num_speculative_tokens (5 and 4 in the example) is clamped to it, as vLLM does
    assert [eagle3.length_for(b) for b in (1, 16, 17, 32, 33, 64, 65, 129)] == [3, 3, 3, 3, 3, 3, 1, 0]
    assert [r.index for r in eagle3.clamped] == [0, 1]
    assert eagle3.to_vllm_config("eagle3", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B") == json.loads(VLLM_EAGLE3)


def test_batch_table_from_file_and_dynspec_config(tmp_path) -> None:
    path = tmp_path / "speculative.json"
    path.write_text(VLLM_EAGLE)
    from_path = build_policy(DynSpecConfig(num_speculative_tokens=3, policy="batch_table",
                                           policy_options={"vllm_config": str(path)}))
    inline = build_policy(DynSpecConfig(num_speculative_tokens=3, policy="batch_table",
                                        policy_options=json.loads(VLLM_EAGLE)))
    for policy in (from_path, inline):
        assert policy.draft_lengths(request(100, 3)).tolist() == [1] * 100
        assert policy.draft_lengths(request(2, 3)).tolist() == [3, 3]
        assert policy.draft_lengths(request(2, 2)).tolist() == [2, 2]  # the loop's maximum caps the table


def test_batch_table_outside_ranges_use_the_maximum_or_the_previous_range() -> None:
    table = [[2, 4, 2], [8, 16, 0]]
    default = BatchTablePolicy(5, table)
    assert [default.length_for(b) for b in (1, 2, 5, 8, 17, 1000)] == [5, 2, 5, 0, 5, 5]
    previous = BatchTablePolicy(5, table, outside_ranges="previous")
    assert [previous.length_for(b) for b in (1, 2, 5, 8, 17, 1000)] == [5, 2, 2, 0, 0, 0]


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ([[1, 64, 3], [60, 128, 1]], r"entry 0 \(\[1, 64, 3\]\) and entry 1 \(\[60, 128, 1\]\) overlap at batch sizes 60..64"),
        ([[129, 512, 0], [1, 200, 3]], r"entry 1 \(\[1, 200, 3\]\) and entry 0 \(\[129, 512, 0\]\) overlap"),
        ([[1, 64, 3], [128, 65, 1]], r"entry 1 \(\[128, 65, 1\]\) is inverted: start_bs 128 > end_bs 65"),
        ([[0, 4, 1]], r"entry 0 \(\[0, 4, 1\]\): start_bs must be >= 1"),
        ([[1, 4, -1]], r"entry 0 \(\[1, 4, -1\]\): k must be >= 0"),
        ([[1, 4]], r"entry 0 \(\[1, 4\]\) must be a list \[start_bs, end_bs, k\]"),
        ([[1, 4, 1], [5, 8, 1.5]], r"entry 1 \(\[5, 8, 1.5\]\) must hold integers only"),
        ([[1, 4, 1, 100, 2]], "5 items"),
        ([], "non-empty list"),
        ({"1": 3}, "non-empty list"),
    ],
)
def test_batch_table_rejects_malformed_tables_naming_the_entry(table, message) -> None:
    with pytest.raises(ValueError, match=message):
        BatchTablePolicy(3, table)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"num_speculative_tokens": 3}, "lacks `num_speculative_tokens_per_batch_size`"),
        ({"num_speculative_tokens_per_batch_size": [[1, 2, 1]]}, "lacks `num_speculative_tokens`"),
        ({"num_speculative_tokens": 0, "num_speculative_tokens_per_batch_size": [[1, 2, 1]]}, ">= 1"),
        ({"method": 3, "num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[1, 2, 1]]},
         "`method`.*must be a string"),
        ("{not json", "Could not parse"),
        ("/nonexistent/speculative.json", "does not exist"),
        ([1, 2], "is a dict, a JSON file path or JSON text"),
    ],
)
def test_batch_table_rejects_bad_vllm_configs(config, message) -> None:
    with pytest.raises(ValueError, match=message):
        BatchTablePolicy.from_vllm_config(config)


def test_batch_table_builder_errors() -> None:
    with pytest.raises(ValueError, match="needs vLLM's speculative config"):
        build_policy(DynSpecConfig(policy="batch_table", policy_options={"table": [[1, 2, 3]]}))
    with pytest.raises(ValueError, match=r"exceeds DynSpecConfig.num_speculative_tokens=2.*num_speculative_tokens=3"):
        build_policy(DynSpecConfig(num_speculative_tokens=2, policy="batch_table", policy_options=json.loads(VLLM_EAGLE)))
    with pytest.raises(ValueError, match="`outside_ranges` must be one of"):
        build_policy(DynSpecConfig(num_speculative_tokens=3, policy="batch_table",
                                   policy_options={"vllm_config": VLLM_EAGLE, "outside_ranges": "nearest"}))


# ---- threshold -----------------------------------------------------------------------------------------------------
def test_threshold_speculates_only_at_or_below_the_threshold() -> None:
    policy = build_policy(DynSpecConfig(num_speculative_tokens=4, policy="threshold",
                                        policy_options={"batch_size_threshold": 8}))
    assert policy.draft_lengths(request(9, 4)).tolist() == [0] * 9
    assert policy.draft_lengths(request(8, 4)).tolist() == [4] * 8
    fixed = ThresholdPolicy(8, num_speculative_tokens=2)
    assert fixed.draft_lengths(request(3, 4)).tolist() == [2, 2, 2]


def test_threshold_rejects_bad_options() -> None:
    with pytest.raises(ValueError, match="needs `policy_options=\\{'batch_size_threshold': N\\}`"):
        build_policy(DynSpecConfig(policy="threshold"))
    with pytest.raises(ValueError, match="`batch_size_threshold` must be an integer >= 0"):
        ThresholdPolicy(-1)
    with pytest.raises(ValueError, match="`num_speculative_tokens` must be an integer >= 0 or None"):
        ThresholdPolicy(4, num_speculative_tokens=2.5)
    with pytest.raises(ValueError, match=r"Unknown `policy_options` \['max_batch'\]"):
        build_policy(DynSpecConfig(policy="threshold", policy_options={"max_batch": 4}))


# ---- heuristic -----------------------------------------------------------------------------------------------------
def transformers_heuristic(start: int, outcomes: list[tuple[int, int]]) -> list[int]:
    """transformers' update_candidate_strategy on (candidates, matches) pairs; returns the count after each."""
    counts, n = [], start
    for candidates, matches in outcomes:
        n = n + 2 if matches == candidates else max(1, n - 1)
        counts.append(n)
    return counts


def test_heuristic_follows_transformers_rule_per_row_within_the_maximum() -> None:
    policy = build_policy(DynSpecConfig(num_speculative_tokens=10, policy="heuristic",
                                        policy_options={"initial_tokens": 3}))
    policy.reset(2)
    steps = [(1, 0), (1, 3), (0, 1), (0, 0), (0, 4), (0, 4)]  # accepted (row 0, row 1)
    history = {0: [], 1: []}
    for acc0, acc1 in steps:
        lengths = policy.draft_lengths(request(2, 10))
        policy.observe(feedback([0, 1], lengths.tolist(), [min(acc0, int(lengths[0])), min(acc1, int(lengths[1]))]))
        for row, acc in ((0, acc0), (1, acc1)):
            history[row].append((int(lengths[row]), min(acc, int(lengths[row]))))
    for row in (0, 1):
        assert policy.counts[row].item() == transformers_heuristic(3, history[row])[-1]
    assert policy.counts[0].item() != policy.counts[1].item()


def test_heuristic_starts_at_the_maximum_caps_there_and_resets_per_call() -> None:
    policy = HeuristicPolicy()
    policy.reset(1)
    assert policy.draft_lengths(request(1, 4)).tolist() == [4]
    policy.observe(feedback([0], [4], [4]))
    assert policy.draft_lengths(request(1, 4)).tolist() == [4]  # +2 capped at the maximum
    policy.observe(feedback([0], [4], [1]))
    assert policy.draft_lengths(request(1, 4)).tolist() == [3]
    policy.observe(feedback([0], [0], [0]))  # no draft tokens proposed: unchanged
    assert policy.draft_lengths(request(1, 4)).tolist() == [3]
    policy.reset(1)
    assert policy.draft_lengths(request(1, 4)).tolist() == [4]
    with pytest.raises(ValueError, match="`initial_tokens` must be an integer >= 1"):
        HeuristicPolicy(0)


# ---- confidence ----------------------------------------------------------------------------------------------------
def test_confidence_stops_rows_below_the_threshold() -> None:
    policy = build_policy(DynSpecConfig(num_speculative_tokens=5, policy="confidence",
                                        policy_options={"threshold": 0.5, "adaptive": False}))
    policy.reset(3)
    assert policy.draft_lengths(request(3, 5)).tolist() == [5, 5, 5]
    keep = policy.continue_drafting(torch.tensor([0, 1, 2]), 0, torch.tensor([0.9, 0.49, 0.5]))
    assert keep.tolist() == [True, False, True]


def test_confidence_threshold_adapts_to_the_roc_optimum() -> None:
    policy = ConfidencePolicy(ConfidenceSettings(threshold=0.4, min_samples=6))
    policy.reset(2)
    generator = torch.Generator().manual_seed(1)
    for _ in range(40):
        probs = torch.rand(2, 3, generator=generator, dtype=torch.float64)
        for position in range(3):
            policy.continue_drafting(torch.tensor([0, 1]), position, probs[:, position])
        accepted = [int((probs[row] > 0.6).long().cumprod(0).sum()) for row in range(2)]
        policy.observe(feedback([0, 1], [3, 3], accepted))
    # accepted exactly when q > 0.6: the adapted threshold separates the two classes
    assert 0.55 < policy.threshold <= 0.7


def test_best_threshold_minimises_the_weighted_roc_cost() -> None:
    generator = torch.Generator().manual_seed(2)
    probs = torch.rand(60, generator=generator, dtype=torch.float64)
    labels = (torch.rand(60, generator=generator, dtype=torch.float64) < probs).long()
    chosen = best_threshold(probs.numpy(), labels.numpy(), 3.0)

    def cost(threshold: float) -> float:
        go = probs >= threshold
        fpr = float((go & (labels == 0)).sum()) / float((labels == 0).sum())
        fnr = float((~go & (labels == 1)).sum()) / float((labels == 1).sum())
        return fpr + 3.0 * fnr

    assert cost(chosen) == pytest.approx(min(cost(float(t)) for t in probs))


def test_goodput_uses_the_confidence_stop_as_early_stop() -> None:
    policy = GoodputPolicy(GoodputSettings(early_stop={"threshold": 0.5, "adaptive": False}),
                           cost_model=FunctionCost(padded_cost))
    policy.reset(2)
    assert policy.continue_drafting(torch.tensor([0, 1]), 0, torch.tensor([0.2, 0.8])).tolist() == [False, True]
    assert GoodputPolicy(cost_model=FunctionCost(padded_cost)).continue_drafting(
        torch.tensor([0]), 0, torch.tensor([0.2])) is None


def test_calibrated_acceptance_starts_at_the_draft_probability_and_learns_monotone_rates() -> None:
    stopper = ConfidenceStopper(ConfidenceSettings(adaptive=False))
    assert stopper.acceptance_given(torch.tensor([0.05, 0.55, 0.9995])).tolist() == pytest.approx([0.05, 0.55, 0.9995])
    generator = np.random.default_rng(0)
    probs = generator.uniform(size=400)
    labels = (probs > 0.5).astype(np.float64)  # the draft is right exactly when it is more than half sure
    stopper.reset(1)
    for prob, label in zip(probs, labels):  # one-token steps, judged one by one
        stopper.record(torch.tensor([0]), 0, torch.tensor([prob]))
        stopper.observe(feedback([0], [1], [int(label)]))
    rates = stopper.acceptance_given(torch.tensor([0.05, 0.35, 0.65, 0.95])).numpy()
    assert rates[0] < 0.05 and rates[1] < 0.05 and rates[2] > 0.95 and rates[3] > 0.95
    rates = acceptance_rates(probs, 1.0 - labels)  # a draft that is wrong when sure: rates still never fall
    assert rates.shape == (len(RATE_EDGES) - 1,) and (np.diff(rates) >= 0).all()


def test_calibrated_acceptance_tells_a_sure_draft_from_a_fairly_sure_one() -> None:
    """Long drafts multiply many acceptances near 1: tokens at q = 0.9995 must not be priced like those at q = 0.92."""
    generator = np.random.default_rng(1)
    sure, fair = np.full(2000, 0.9995), np.full(2000, 0.92)
    labels = np.concatenate([generator.uniform(size=2000) < 0.995, generator.uniform(size=2000) < 0.8]).astype(float)
    stopper = ConfidenceStopper(ConfidenceSettings(adaptive=False, window=4000))
    stopper.probs.extend(np.concatenate([sure, fair]).tolist())
    stopper.labels.extend(labels.astype(int).tolist())
    rates = stopper.acceptance_given(torch.tensor([0.9995, 0.92])).tolist()
    assert rates[0] > 0.98 and rates[1] < 0.9  # (0.8 observed, raised to the empty bin below: 0.85)
    assert rates[0] ** 10 > 0.8  # ten sure tokens in a row: still likely all accepted


def offload_like_cost() -> PaddedCostModel:
    """Verifying 1 or 17 tokens costs the same 0.45 s; a draft forward 0.05 s."""
    return PaddedCostModel(PiecewiseLinear.fit({1: (0.45, 1), 64: (0.45, 1)}), PiecewiseLinear.fit({1: (0.05, 1)}))


def in_memory_cost() -> PaddedCostModel:
    """Every verified token costs 0.05 s on top of a 0.15 s step; a draft forward 0.05 s."""
    return PaddedCostModel(PiecewiseLinear.fit({1: (0.15, 1), 64: (3.3, 1)}), PiecewiseLinear.fit({1: (0.05, 1)}))


@pytest.mark.parametrize("batch", [1, 8])
def test_goodput_prices_a_draft_that_runs_rows_apart_per_row(batch: int) -> None:
    """Verifying is free and a draft forward costs 0.15 of a step at any batch size. A batched draft pays for 8 rows
    what it pays for one; a draft that runs its rows apart (`PrefillFeedback.draft_rows_apart`) pays 8 times as
    much, which acceptance 0.8 does not repay: it drafts alone, never in a batch of 8."""
    drafted = []
    for rows_apart in (False, True):
        cost = PaddedCostModel(PiecewiseLinear.fit({1: (1.0, 1), 128: (1.0, 1)}), PiecewiseLinear.fit({1: (0.15, 1)}))
        policy = GoodputPolicy(GoodputSettings(prior_acceptance=0.8, prior_weight=1000.0, loss_budget=None,
                                               early_stop=None, probe_z=0.0), cost_model=cost)
        policy.reset(batch)
        policy.observe_prefill(PrefillFeedback(batch, 10 * batch, 1.0, 0.3, rows_apart))
        assert cost.rows_apart == rows_apart
        drafted.append(int(policy.draft_lengths(request(batch, 4)).sum()))
    batched, apart = drafted
    assert batched > 0
    assert (apart > 0) if batch == 1 else (apart == 0)


def drafted_until_stop(policy: GoodputPolicy, probs: list[float]) -> int:
    """Draft tokens a one-row step keeps under the marginal stop, the draft being `probs` sure of each."""
    requested = int(policy.draft_lengths(request(1, len(probs)))[0])  # the cap, or what the loss budget allows
    for position, prob in enumerate(probs[:requested]):
        if not bool(policy.continue_drafting(torch.tensor([0]), position, torch.tensor([prob]))[0]):
            return position + 1
    return requested


def test_marginal_stop_drafts_long_when_verifying_is_free_and_short_when_it_costs() -> None:
    sure = [0.95] * 16
    policy = GoodputPolicy(GoodputSettings(early_stop="marginal", loss_budget=None), cost_model=offload_like_cost())
    policy.reset(1)
    policy.acceptance.update(torch.tensor([0]), torch.tensor([40]), torch.tensor([38]))
    assert drafted_until_stop(policy, sure) >= 12
    assert drafted_until_stop(policy, [0.95, 0.95, 0.95, 0.02] + sure[4:]) == 4  # an unsure draft token ends it
    costly = GoodputPolicy(GoodputSettings(early_stop="marginal", loss_budget=None), cost_model=in_memory_cost())
    costly.reset(1)
    costly.acceptance.update(torch.tensor([0]), torch.tensor([40]), torch.tensor([38]))
    assert 2 <= drafted_until_stop(costly, sure) <= 4


def test_marginal_stop_drafts_through_a_step_in_the_cost_curve_that_later_tokens_repay() -> None:
    """Verifying 4 or 5 tokens costs 0.45 s, 6 to 17 tokens 0.6 s (a knot timed fast by chance, or a kernel's tile
    boundary): the 5th draft token alone does not pay for the step, but the ten after it ride on it for free."""
    verify = PiecewiseLinear.fit({1: (0.45, 1), 5: (0.45, 1), 6: (0.6, 1), 64: (0.6, 1)})
    policy = GoodputPolicy(GoodputSettings(early_stop="marginal", loss_budget=None),
                           cost_model=PaddedCostModel(verify, PiecewiseLinear.fit({1: (0.01, 1)})))
    policy.reset(1)
    policy.acceptance.update(torch.tensor([0]), torch.tensor([40]), torch.tensor([38]))
    assert drafted_until_stop(policy, [0.95] * 16) >= 12
    assert drafted_until_stop(policy, [0.95] * 4 + [0.02] + [0.95] * 11) == 5  # an unsure draft token still ends it

def test_marginal_stop_may_draft_past_the_pessimistic_length_once_that_length_pays() -> None:
    """Late in a call the cap's worst case is no longer repaid twice over, the pessimistic length's still is: without
    the marginal stop the step is capped there; with it the row may draft on, token by token while each pays."""

    def requested(early_stop) -> int:
        verify = PiecewiseLinear.fit({1: (1.0, 1), 3: (1.1, 1), 17: (2.0, 1), 64: (6.0, 1)})
        policy = GoodputPolicy(GoodputSettings(early_stop=early_stop),
                               cost_model=PaddedCostModel(verify, PiecewiseLinear.fit({1: (0.3, 1)})))
        policy.reset(1)
        policy.observe_prefill(PrefillFeedback(1, 150, 2.0, 0.3))
        policy.acceptance.update(torch.tensor([0]), torch.tensor([40]), torch.tensor([30]))
        return int(policy.draft_lengths(request(1, 16, remaining=15))[0])

    assert requested(None) == 5
    assert requested("marginal") == 14  # the row's cap: 15 tokens left


def test_investment_rule_never_shortens_what_the_loss_budget_allows() -> None:
    """The pessimistic length caps a step only where the budget could not pay for the search's choice: with savings
    banked (or no budget at all) the search's length stands."""

    def requested(loss_budget, banked: float) -> int:
        verify = PiecewiseLinear.fit({1: (1.0, 1), 3: (1.1, 1), 17: (2.0, 1), 64: (6.0, 1)})
        policy = GoodputPolicy(GoodputSettings(loss_budget=loss_budget, probe_z=0.0),  # the search and the budget
                               cost_model=PaddedCostModel(verify, PiecewiseLinear.fit({1: (0.3, 1)})))
        policy.reset(1)
        policy.observe_prefill(PrefillFeedback(1, 150, 2.0, 0.3))
        policy.budget.record(banked, 0.0)  # seconds speculation saved in earlier steps
        policy.acceptance.update(torch.tensor([0]), torch.tensor([40]), torch.tensor([30]))
        return int(policy.draft_lengths(request(1, 16, remaining=40))[0])

    assert requested(0.05, banked=0.0) == 5  # a fresh budget: the pessimistic length, as an investment
    assert requested(0.05, banked=30.0) == requested(None, banked=0.0) == 8  # the search's own choice


def test_a_prompt_wide_catch_up_is_priced_from_the_target_prefill_not_the_last_verify_slope() -> None:
    """The verify curve knows 1 to 11 tokens, and its last knot was timed slow (0.25 s against 0.17 s two tokens
    before). Carried to the draft's 276-token prompt catch-up, that slope prices the catch-up at 3.6 s; the target
    prefilled the 275-token prompt in 1.2 s, so the draft (a third of the target's cost) needs about 0.4 s. Priced at
    3.6 s, a share of the catch-up per remaining token made every step of the call plain."""
    verify = PiecewiseLinear.fit({1: (0.15, 1), 9: (0.17, 1), 11: (0.25, 1)})
    policy = GoodputPolicy(GoodputSettings(loss_budget=None, probe_z=0.0),  # the search alone
                           cost_model=PaddedCostModel(verify, PiecewiseLinear.fit({1: (0.05, 1)})))
    policy.reset(1)
    policy.observe_prefill(PrefillFeedback(1, 275, 1.2, 0.33))
    policy.acceptance.update(torch.tensor([0]), torch.tensor([40]), torch.tensor([24]))
    step = PolicyInput(step=0, row_ids=torch.tensor([0]), remaining_tokens=torch.tensor([47]), max_draft_tokens=8,
                       backlog=torch.tensor([276]))
    assert 0.3 < policy._catchup_seconds(step) < 0.5  # draft forward 0.05 s x target 1.2 s / 0.15 s
    assert int(policy.draft_lengths(step)[0]) >= 2
    # the last segment's slope alone: 0.05 x (0.25 + 0.04 x 265) / 0.15
    policy.cost_model.verify = replace(policy.cost_model.verify, far=None)
    assert policy._catchup_seconds(step) > 3.0
    assert int(policy.draft_lengths(step)[0]) == 0


def test_verify_widths_past_the_last_knot_are_priced_on_the_line_to_the_target_prefill() -> None:
    """Batch 16 in bfloat16 on a CPU with AMX, at a 600-token context (one of two measurements in docs/benchmarks.md: a
    verify forward over 16, 32, 48, 64, 96 and 128 tokens cost 0.91, 0.86, 1.10, 1.47, 1.96 and 2.16 s; the 9600-token
    prefill 114.5 s; in the other the line below prices 64 tokens 31% high). A policy that has
    seen only plain steps knows verify widths up to 16 tokens, and there the steps of 15 and 16 rows were timed alike.
    Along that flat last segment a 64-token verify costs 0.91 s and, at acceptance 0.64, three draft tokens look
    best; along the line to the prefill it costs 1.48 s, and one draft token is best, as at the measured costs."""
    plain_steps = {rows: (0.25 + 0.044 * (rows - 1), 1) for rows in range(1, 15)} | {15: (0.91, 1), 16: (0.91, 1)}
    measured = PiecewiseLinear.fit({16: (0.91, 1), 32: (0.86, 1), 48: (1.10, 1), 64: (1.47, 1), 96: (1.96, 1),
                                    128: (2.16, 1)})
    draft = PiecewiseLinear.fit({16: (0.15, 1)})

    def chosen(verify: PiecewiseLinear) -> int:
        policy = GoodputPolicy(GoodputSettings(loss_budget=None), cost_model=PaddedCostModel(verify, draft))
        policy.reset(16)
        policy.observe_prefill(PrefillFeedback(16, 9600, 114.5, 0.33))
        rows = torch.arange(16)
        for i in range(100):  # 7 of every 10 single draft tokens accepted, 100 times per row
            policy.acceptance.update(rows, torch.ones(16, dtype=torch.long), torch.full((16,), int(i % 10 < 7)))
        assert float(policy.acceptance.mean(rows)[0]) == pytest.approx(0.64, abs=0.01)
        if verify is not measured:
            assert float(policy.cost_model.verify(np.array([64.0]))[0]) == pytest.approx(1.48, abs=0.01)
        return int(policy.draft_lengths(request(16, 8))[0])

    assert chosen(PiecewiseLinear.fit(plain_steps)) == chosen(measured) == 1
    flat = PaddedCostModel(PiecewiseLinear.fit(plain_steps), draft)  # the same knots without the prefill
    acceptance = torch.full((16,), 0.64, dtype=torch.float64)
    assert int(best_draft_lengths(acceptance, torch.full((16,), 8), 8, flat).max()) == 3


def test_marginal_stop_keeps_a_stopped_row_stopped() -> None:
    policy = GoodputPolicy(GoodputSettings(early_stop="marginal", loss_budget=None), cost_model=offload_like_cost())
    policy.reset(2)
    policy.acceptance.update(torch.tensor([0, 1]), torch.tensor([40, 40]), torch.tensor([38, 38]))
    assert policy.draft_lengths(request(2, 8)).tolist() == [8, 8]
    rows = torch.tensor([0, 1])
    assert policy.continue_drafting(rows, 0, torch.tensor([0.9, 0.01])).tolist() == [True, False]
    assert policy.continue_drafting(rows, 1, torch.tensor([0.9, 0.99])).tolist() == [True, False]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"threshold": 1.5}, "`threshold` must be a number in \\[0, 1\\]"),
        ({"adaptive": "yes"}, "`adaptive` must be a bool"),
        ({"window": 1}, "`window` must be an integer >= 2"),
        ({"false_negative_cost": 0}, "`false_negative_cost`"),
        ({"thresh": 0.2}, r"Unknown `policy_options` \['thresh'\]"),
    ],
)
def test_confidence_rejects_bad_options(options, message) -> None:
    with pytest.raises(ValueError, match=message):
        build_policy(DynSpecConfig(policy="confidence", policy_options=options))


# ---- the acceptance estimator as used by the policy ------------------------------------------------------------------
def test_new_rows_start_from_the_pooled_estimate() -> None:
    estimator = AcceptanceEstimator(prior_acceptance=0.5, prior_weight=2.0, decay=1.0)
    estimator.reset(2)
    assert estimator.mean(torch.tensor([0, 1])).tolist() == [0.5, 0.5]
    for _ in range(50):
        estimator.update(torch.tensor([0]), torch.tensor([4]), torch.tensor([4]))
    estimator.reset(3)  # a new generate call: rows are forgotten, the pooled estimate is not
    assert float(estimator.mean(torch.tensor([2]))) > 0.95


def test_padded_cost_model_prices_the_longest_draft() -> None:
    # draft forwards timed at 1 and 2 rows (past its last knot the draft curve would follow the verify curve)
    model = PaddedCostModel(PiecewiseLinear.fit({1: (1.0, 1), 10: (2.0, 1)}), PiecewiseLinear.fit({1: (0.5, 1), 2: (0.5, 1)}))
    assert model.step_seconds(1, torch.tensor([0])) == pytest.approx(1.0)
    assert model.step_seconds(2, torch.tensor([0, 4])) == pytest.approx(1.0 + 9 / 9 + 4 * 0.5)
    candidates = torch.tensor([[0, 0], [0, 4], [4, 4]])
    assert model.candidate_seconds(2, candidates).tolist() == pytest.approx([1.0 + 1 / 9, 4.0, 4.0])


# ---- goodput with a hybrid proposer: copies -------------------------------------------------------------------------
def lookup_request(anchor: int, offered: int = 10) -> PolicyInput:
    """One row that prompt lookup offers `offered` tokens, its final `anchor` tokens shared with their source."""
    return PolicyInput(step=0, row_ids=torch.tensor([0]), remaining_tokens=torch.tensor([100]), max_draft_tokens=4,
                       free_lengths=torch.tensor([offered]), free_anchors=torch.tensor([anchor]))


def sure_request(confidence: float | None) -> PolicyInput:
    """One row offered 10 suffix tokens after a short match, the proposal `confidence` sure (None: it does not say)."""
    request = lookup_request(1)
    request.free_confidence = None if confidence is None else torch.tensor([confidence], dtype=torch.float64)
    return request


def test_less_sure_suffix_proposals_are_priced_as_less_likely_accepted() -> None:
    """Sure proposals (every earlier occurrence continued that way) are all accepted, unsure ones (a third of them)
    none: the class's acceptance, scaled by each proposal's confidence over the mean it learned from, sends long
    drafts for sure proposals and none or short ones for unsure ones; a proposal that does not say is priced as its
    class."""
    policy = GoodputPolicy(GoodputSettings(loss_budget=None), cost_model=in_memory_cost())
    policy.reset(1)
    for step in range(12):
        sure = step % 2 == 0
        policy.draft_lengths(sure_request(1.0 if sure else 0.3))
        policy.observe(StepFeedback(torch.tensor([0]), torch.tensor([10]), torch.tensor([10]),
                                    torch.tensor([10 if sure else 0]), 0.0, 0.6, 11, free_rows=torch.tensor([True])))
    assert 0.9 < policy.lookup_confidence.mean < 1.0  # weighted by tokens verified: 60 sure ones, 6 unsure
    served = {confidence: int(policy.draft_lengths(sure_request(confidence))[0]) for confidence in (1.0, 0.3, None)}
    assert served[1.0] >= 8 and served[0.3] <= 2 < served[None], served


def test_a_confidence_scale_follows_the_tokens_it_learned_from() -> None:
    scale = ConfidenceScale(prior_weight=2.0, decay=1.0)
    assert scale.scale(torch.tensor([0.8]), torch.tensor([1.0])).tolist() == pytest.approx([0.8])  # the prior
    scale.update(torch.tensor([0.5, 1.0]), torch.tensor([6, 0]))  # a row that drafted nothing teaches nothing
    assert scale.mean == pytest.approx((2.0 + 3.0) / 8.0)
    assert scale.scale(torch.tensor([0.6, 0.6]), torch.tensor([0.625, 1.0])).tolist() == pytest.approx([0.6, 0.96])
    assert scale.scale(torch.tensor([0.9]), torch.tensor([1.0])).tolist() == [1.0]  # at most 1


def alternate_copies_and_misses(policy: GoodputPolicy, steps: int = 12) -> None:
    """Row 0 alternates between copying a span (anchored by 12 tokens: all 10 lookup tokens accepted) and short
    n-gram matches (anchored by 1: none accepted), served by lookup every step."""
    policy.reset(1)
    for step in range(steps):
        copying = step % 2 == 0
        policy.draft_lengths(lookup_request(12 if copying else 1))
        accepted = 10 if copying else 0
        policy.observe(StepFeedback(torch.tensor([0]), torch.tensor([10]), torch.tensor([10]), torch.tensor([accepted]),
                                    0.0, 0.6, 11, free_rows=torch.tensor([True])))


def served_by_lookup(policy: GoodputPolicy, anchor: int) -> int:
    """Lookup tokens the policy asks of row 0 when its continuation is anchored by `anchor` tokens (0: none)."""
    lengths = policy.draft_lengths(lookup_request(anchor))
    free = policy.free_rows(lookup_request(anchor))
    return int(lengths[0]) if free is not None and bool(free[0]) else 0


def test_hybrid_learns_that_copies_are_accepted_where_other_lookups_are_not() -> None:
    policy = GoodputPolicy(GoodputSettings(loss_budget=None), cost_model=in_memory_cost())
    alternate_copies_and_misses(policy)
    assert served_by_lookup(policy, 12) >= 8  # a copy: a long lookup draft, no draft forward
    assert served_by_lookup(policy, 1) == 0  # a short match: the draft model, or no draft at all
    unsplit = GoodputPolicy(GoodputSettings(loss_budget=None, copy_anchor=0), cost_model=in_memory_cost())
    alternate_copies_and_misses(unsplit)  # one estimate for every lookup: both kinds are priced alike
    assert served_by_lookup(unsplit, 12) == served_by_lookup(unsplit, 1)


def draft_steps_between_copies(policy: GoodputPolicy, steps: int = 64) -> list[int]:
    """Steps at which the draft model ran, for one row whose even steps offer a copy (anchored by 12 tokens, all 10
    tokens accepted) and whose odd steps offer none; the draft (in sync with the row) is never accepted."""
    policy.reset(1)
    drafted = []
    for step in range(steps):
        copying = step % 2 == 0
        request = PolicyInput(step=step, row_ids=torch.tensor([0]), remaining_tokens=torch.tensor([1000]),
                              max_draft_tokens=4, free_lengths=torch.tensor([10 if copying else 0]),
                              free_anchors=torch.tensor([12 if copying else 0]), backlog=torch.tensor([1]))
        lengths, free = policy.draft_lengths(request), policy.free_rows(request)  # [1], [1] or None
        copied = free is not None and bool(free[0])
        k = int(lengths[0])
        if k and not copied:
            drafted.append(step)
        policy.observe(StepFeedback(torch.tensor([0]), lengths, lengths, torch.tensor([k if copied else 0]),
                                    0.0 if copied else 0.05 * k, 0.15 + 0.05 * k, 1 + k,
                                    free_rows=torch.tensor([copied])))
    return drafted


def test_the_draft_is_measured_while_copies_win_part_of_the_answer() -> None:
    """Copies win every other step and the draft's estimate (the prior, 0.5) does not pay: the draft is still
    measured (steps that copy leave its estimate as uncertain as plain steps do), then, once it proves poor, seldom;
    with no optimism allowed (`probe_z=0`) never."""
    policy = GoodputPolicy(GoodputSettings(prior_acceptance=0.5, loss_budget=None), cost_model=in_memory_cost())
    probes = draft_steps_between_copies(policy)
    assert probes and probes[0] <= 8, probes
    assert len(probes) <= 8, probes  # of 32 steps without a copy
    never = GoodputPolicy(GoodputSettings(prior_acceptance=0.5, probe_z=0.0, loss_budget=None),
                          cost_model=in_memory_cost())
    assert draft_steps_between_copies(never) == []


def copies_beside_a_draft(copy_right: int, draft_right: int, tokens: int = 192) -> tuple[int, int]:
    """(steps, steps that ran the draft model) of one row of `tokens` tokens that is offered a 12-token copy every
    step, of which the first `copy_right` tokens are right, beside a draft whose first `draft_right` are; a verify
    forward costs 1 s at any width, a draft forward 0.1 s."""
    cost = PaddedCostModel(PiecewiseLinear.fit({1: (1.0, 1), 64: (1.0, 1)}), PiecewiseLinear.fit({1: (0.1, 1)}))
    policy = GoodputPolicy(GoodputSettings(), cost_model=cost)
    policy.reset(1)
    left, steps, drafted = tokens, 0, 0
    while left > 0:
        request = PolicyInput(step=steps, row_ids=torch.tensor([0]), remaining_tokens=torch.tensor([left]),
                              max_draft_tokens=8, free_lengths=torch.tensor([12]), free_anchors=torch.tensor([12]),
                              backlog=torch.tensor([1]), draft_tries_free=True)
        lengths, free = policy.draft_lengths(request), policy.free_rows(request)  # [1], [1] or None
        k, copied = int(lengths[0]), free is not None and bool(free[0])
        accepted = min(k, copy_right if copied else draft_right)
        drafted += k > 0 and not copied
        policy.observe(StepFeedback(torch.tensor([0]), lengths, lengths, torch.tensor([accepted]),
                                    0.0 if copied else 0.1 * k, 1.0, 1 + k, free_rows=torch.tensor([copied])))
        left, steps = left - accepted - 1, steps + 1
    return steps, drafted


def test_a_sure_draft_is_found_beside_copies_that_look_worth_taking() -> None:
    """Copies that are right for one or two tokens of twelve at first look better than a draft nobody has measured
    (the prior, 0.6); a draft that is always right is far better. The draft is measured and then kept: it runs on
    most steps, or, where copies are right for two, on more than a third of them (probes after a count of steps
    without the draft ran it on 15 of 46 steps and on 11 of 42)."""
    steps, drafted = copies_beside_a_draft(1, 99)
    assert drafted > steps / 2, (steps, drafted)
    steps, drafted = copies_beside_a_draft(2, 99)
    assert drafted > steps / 3, (steps, drafted)
    steps, drafted = copies_beside_a_draft(99, 0)  # the reverse: copies always right, a draft never
    assert drafted <= 1, (steps, drafted)


def test_a_draft_without_lookahead_leaves_any_sure_lookup_a_verify_of_its_own() -> None:
    """Short matches that were always accepted: beside a draft whose lookahead already tries them they are not served
    alone (only copies are); beside a draft without lookahead (`draft_tries_free=False`: draft_lookahead=0, or
    continuous batching) they are."""
    policy = GoodputPolicy(GoodputSettings(loss_budget=None), cost_model=in_memory_cost())
    policy.reset(1)
    for _ in range(12):
        policy.draft_lengths(lookup_request(1))
        policy.observe(StepFeedback(torch.tensor([0]), torch.tensor([10]), torch.tensor([10]), torch.tensor([10]),
                                    0.0, 0.6, 11, free_rows=torch.tensor([True])))
    served = {}
    for tries in (True, False):
        request = lookup_request(1)
        request.backlog, request.draft_tries_free = torch.tensor([0]), tries
        lengths, free = policy.draft_lengths(request), policy.free_rows(request)
        served[tries] = int(lengths[0]) if free is not None and bool(free[0]) else 0
    assert served[True] == 0 and served[False] >= 8, served


@pytest.mark.parametrize("option", [{"copy_anchor": -1}, {"copy_anchor": 2.5}, {"copy_prior_acceptance": 1.0}])
def test_copy_options_are_checked(option) -> None:
    with pytest.raises(ValueError, match=next(iter(option))):
        GoodputSettings(**option)


# ---- goodput: the search at scale ----------------------------------------------------------------------------------
class VectorsOnly(StepCostModel):
    """A padded model that hides `summary_seconds`, so the search prices length vectors."""

    def __init__(self, model: PaddedCostModel) -> None:
        self.model = model

    def step_seconds(self, batch_size: int, lengths: torch.LongTensor) -> float:
        return self.model.step_seconds(batch_size, lengths)

    def candidate_seconds(self, batch_size: int, lengths: torch.LongTensor) -> torch.Tensor:
        return self.model.candidate_seconds(batch_size, lengths)


def scale_cost_model() -> PaddedCostModel:
    verify = PiecewiseLinear.fit({1: (1.0, 1.0), 64: (1.05, 1.0), 512: (1.2, 1.0), 16384: (3.0, 1.0)})
    return PaddedCostModel(verify, PiecewiseLinear.fit({1: (0.05, 1.0), 1024: (0.1, 1.0)}))


def test_candidate_summaries_match_their_length_vectors() -> None:
    generator = torch.Generator().manual_seed(3)
    for trial in range(60):
        batch, max_k = 1 + trial % 13, 1 + trial % 8
        acceptance = (torch.rand(batch, generator=generator, dtype=torch.float64) * 4).round() / 4  # with ties
        caps = torch.randint(0, max_k + 1, (batch,), generator=generator)
        candidates = Candidates.build(acceptance, caps, max_k)
        lengths = candidates.lengths()  # [candidates, batch]
        assert candidates.longest.tolist() == lengths.max(axis=1).tolist()
        assert candidates.total.tolist() == lengths.sum(axis=1).tolist()
        assert (lengths <= candidates.bound[:, None]).all() and (lengths <= caps.numpy()).all()


@pytest.mark.parametrize("chunk", [7, 1 << 21])
def test_search_by_summaries_equals_search_by_vectors(monkeypatch, chunk) -> None:
    """The built-in models price summaries; with vectors instead (in chunks of `chunk` entries) the choice is the same,
    ties included."""
    monkeypatch.setattr(search_module, "CHUNK_ELEMENTS", chunk)
    model, generator = scale_cost_model(), torch.Generator().manual_seed(5)
    for trial in range(80):
        batch, max_k = 1 + (trial * 7) % 40, 1 + trial % 8
        acceptance = (torch.rand(batch, generator=generator, dtype=torch.float64) * 8).round() / 8
        caps = torch.randint(0, max_k + 1, (batch,), generator=generator)
        options = dict(min_gain=0.02 * (trial % 3), share_per_token=0.005 * (trial % 2))
        by_summary = best_draft_lengths(acceptance, caps, max_k, model, **options)
        assert torch.equal(by_summary, best_draft_lengths(acceptance, caps, max_k, VectorsOnly(model), **options))


def test_search_memory_is_linear_in_the_batch_size() -> None:
    """At batch 1024 the candidates' length vectors would take 0.7 GB; the search by summaries takes a few MB."""
    acceptance = torch.rand(1024, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tracemalloc.start()
    try:
        chosen = best_draft_lengths(acceptance, torch.full((1024,), 8), 8, scale_cost_model())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 * 2**20, peak
    assert chosen.shape == (1024,) and int(chosen.max()) > 0


def test_the_loss_budget_books_only_what_speculation_adds_to_a_forward() -> None:
    """Under continuous batching another request's prompt chunk may share a step's forward: 1 decoding row and 63
    prompt tokens cost 0.9 s. A step that drafts nothing is plain decoding whatever rides along (the balance does not
    move); a drafting step is charged its draft forwards and its draft tokens' share of the verify, and credited the
    same forward without them plus a plain step per accepted token."""
    verify = PiecewiseLinear.fit({1: (0.2, 1), 4: (0.25, 1), 64: (0.9, 1), 67: (0.95, 1)})
    policy = GoodputPolicy(GoodputSettings(), cost_model=PaddedCostModel(verify, PiecewiseLinear.fit({1: (0.05, 1)})))
    policy.reset(1)
    plain = StepFeedback(row_ids=torch.tensor([0]), requested_lengths=torch.tensor([0]),
                         draft_lengths=torch.tensor([0]), accepted=torch.tensor([0]), draft_seconds=0.0,
                         verify_seconds=0.9, target_tokens=64, plain_tokens=64)
    policy.observe(plain)
    assert policy.budget.balance == pytest.approx(0.0) and policy.budget.work == pytest.approx(0.9)
    drafting = replace(plain, requested_lengths=torch.tensor([3]), draft_lengths=torch.tensor([3]),
                       accepted=torch.tensor([2]), draft_seconds=0.15, verify_seconds=0.95, target_tokens=67)
    policy.observe(drafting)
    # credited 0.9 s (the forward without drafts) + 2 x 0.2 s; charged 0.95 s + 3 draft forwards x 0.05 s
    assert policy.budget.balance == pytest.approx(0.9 + 2 * 0.2 - 0.95 - 3 * 0.05)


def test_a_catch_up_is_bought_at_measured_costs_not_at_stale_optimistic_ones() -> None:
    """An RL rollout starts every call at its full batch, where drafting was measured to lose, and spends most of
    its steps in a one-row tail, where it pays. By the next call the full batch's knots are stale: the online model
    prices them at what the fresh (one-row) knots predict, and drafting looks as if it paid. Deciding on that, the
    policy bought the draft's catch-up over every prompt at each call's start and lost it (0.65 s here, 1-2 s in the
    rollout bench). Measured costs decide a step that pays a catch-up."""

    def observed(batch: int, k: int, accepted: int, verify: float, draft: float) -> StepFeedback:
        lengths = torch.full((batch,), k)
        return StepFeedback(torch.arange(batch), lengths, lengths, torch.full((batch,), accepted), draft, verify,
                            batch * (1 + k))

    policy = GoodputPolicy(GoodputSettings(loss_budget=None, probe_z=0.0))
    policy.reset(16)
    policy.observe_prefill(PrefillFeedback(16, 16 * 60, 2.0, 0.33))
    for _ in range(12):
        policy.observe(observed(16, 0, 0, 0.26, 0.0))
    policy.observe(observed(16, 2, 1, 0.42, 0.40))  # drafting at 16 rows, timed once
    for _ in range(100):  # the tail: one row, every draft accepted
        policy.observe(observed(1, 2, 2, 0.20, 0.16))
    policy.reset(16)
    policy.observe_prefill(PrefillFeedback(16, 16 * 60, 2.0, 0.33))
    start = PolicyInput(step=0, row_ids=torch.arange(16), remaining_tokens=torch.full((16,), 255),
                        max_draft_tokens=4, backlog=torch.full((16,), 60))
    rows, caps = torch.arange(16), torch.full((16,), 4)
    share = policy._catchup_seconds(start) / (16 * 255)
    assert share > 0
    acceptance = policy.acceptance.mean(rows)
    optimistic = best_draft_lengths(acceptance, caps, 4, policy.cost_model, 0.0, share)
    assert int(optimistic.max()) > 0  # what the stale knots say
    assert int(policy.draft_lengths(start).max()) == 0
    in_sync = replace(start, backlog=torch.ones(16, dtype=torch.long))  # no catch-up due: optimism may measure
    assert int(policy.draft_lengths(in_sync).max()) > 0


def first_lengths_beside_a_poor_offer(free_lengths: torch.LongTensor | None) -> tuple[int, bool]:
    """The first drafting decision of a new policy for one row (a 400-token prompt the draft has yet to catch up on):
    the online cost model has timed plain steps only, and the draft's forward is known by its parameter ratio alone.
    Returns the draft length and whether a model-free offer serves it. No loss budget: the search's choice is what
    is compared."""
    policy = GoodputPolicy(GoodputSettings(loss_budget=None))
    policy.observe_prefill(PrefillFeedback(1, 400, 2.0, draft_cost_ratio=0.35))
    plain = torch.zeros(1, dtype=torch.long)
    for _ in range(3):
        policy.observe(StepFeedback(torch.tensor([0]), plain, plain, plain, 0.0, 0.27, 1))
    anchors = None if free_lengths is None else torch.zeros(1, dtype=torch.long)
    request = PolicyInput(step=3, row_ids=torch.tensor([0]), remaining_tokens=torch.tensor([45]), max_draft_tokens=8,
                          free_lengths=free_lengths, free_anchors=anchors, backlog=torch.tensor([400]))
    lengths, free = policy.draft_lengths(request), policy.free_rows(request)
    return int(lengths[0]), free is not None and bool(free[0])


def test_a_poor_offer_beside_an_untimed_draft_leaves_the_draft_its_length() -> None:
    """The search prices a draft forward never timed at nothing (the optimism that gets it timed), and the choice
    between its result and the offers must price it alike: at the parameter ratio instead, the draft's length lost to
    plain decoding while a shorter draft that would have paid at that price was never an option, so beside model-free
    offers the draft never ran until a probe, and its acceptance was never learned."""
    alone = first_lengths_beside_a_poor_offer(None)
    assert alone[0] > 0
    assert first_lengths_beside_a_poor_offer(torch.tensor([1])) == alone
