"""Acceptance estimation and step cost models: fitting, noise handling, online learning, profiles."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hf_dynspec.cost_models import (
    DraftTiming,
    OnlineCostModel,
    PaddedCostModel,
    PiecewiseLinear,
    Profile,
    ProfileCostModel,
    TargetTiming,
    isotonic_increasing,
)
from hf_dynspec.estimators import AcceptanceEstimator, expected_tokens
from hf_dynspec.policies import GoodputPolicy, GoodputSettings, PolicyInput, StepFeedback, best_draft_lengths


# ---- acceptance ----------------------------------------------------------------------------------------------------
def geometric_accepted(acceptance: torch.Tensor, lengths: torch.LongTensor, generator: torch.Generator) -> torch.Tensor:
    """Accepted draft tokens when each is accepted with probability `acceptance[i]` until the first rejection."""
    width = max(int(lengths.max()), 1)
    draws = torch.rand(acceptance.shape[0], width, generator=generator) < acceptance.unsqueeze(1)
    draws &= torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    return draws.long().cumprod(dim=1).sum(dim=1)


def test_acceptance_estimates_converge_per_row() -> None:
    truth = torch.tensor([0.9, 0.5, 0.2])
    estimator = AcceptanceEstimator(prior_acceptance=0.6, prior_weight=4.0, decay=0.99)
    estimator.reset(3)
    generator = torch.Generator().manual_seed(0)
    rows, lengths = torch.arange(3), torch.full((3,), 4)
    for _ in range(400):
        estimator.update(rows, lengths, geometric_accepted(truth, lengths, generator))
    torch.testing.assert_close(estimator.mean(rows).float(), truth, atol=0.06, rtol=0)


def test_acceptance_uncertainty_shrinks_with_observations() -> None:
    estimator = AcceptanceEstimator(prior_acceptance=0.5, prior_weight=4.0, decay=1.0)
    estimator.reset(2)
    rows = torch.tensor([0, 1])
    fresh_gap = estimator.upper(rows, 2.0) - estimator.mean(rows)
    for _ in range(20):
        estimator.update(torch.tensor([0]), torch.tensor([4]), torch.tensor([2]))
    gap = estimator.upper(rows, 2.0) - estimator.mean(rows)
    assert float(gap[0]) < float(fresh_gap[0]) / 3
    assert float(gap[1]) > 2 * float(gap[0])  # row 1 saw nothing: still uncertain


def test_acceptance_rows_without_drafts_learn_nothing() -> None:
    estimator = AcceptanceEstimator(prior_acceptance=0.6)
    estimator.reset(1)
    estimator.update(torch.tensor([0]), torch.tensor([0]), torch.tensor([0]))
    assert float(estimator.mean(torch.tensor([0]))) == pytest.approx(0.6)


def test_acceptance_of_a_row_that_stopped_drafting_drifts_back_to_the_prior() -> None:
    """Two early rejections pull a row's estimate down; the plain steps that follow teach nothing, so without ageing
    the low estimate (and the decision not to draft) would hold for the rest of the call."""
    estimator = AcceptanceEstimator(prior_acceptance=0.6, prior_weight=4.0, decay=0.95)
    estimator.reset(1)
    row, none = torch.tensor([0]), torch.tensor([0])
    for _ in range(2):
        estimator.update(row, torch.tensor([1]), none)  # one draft token, rejected
    low = float(estimator.mean(row))
    assert low < 0.45
    for _ in range(30):
        estimator.update(row, none, none)  # plain steps
    assert float(estimator.mean(row)) > low + 0.1
    for _ in range(100):
        estimator.update(row, none, none)
    assert float(estimator.mean(row)) == pytest.approx(0.6, abs=0.01)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prior_acceptance": 1.0}, "`prior_acceptance` must be a number strictly between 0 and 1"),
        ({"prior_weight": -1.0}, "`prior_weight` must be a finite number > 0"),
        ({"decay": 1.5}, r"`decay` must be a number in \(0, 1\]"),
    ],
)
def test_acceptance_estimator_rejects_bad_settings(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        AcceptanceEstimator(**kwargs)


def test_acceptance_update_rejects_impossible_counts() -> None:
    estimator = AcceptanceEstimator()
    with pytest.raises(ValueError, match="must lie between 0 and the proposed lengths"):
        estimator.update(torch.tensor([0]), torch.tensor([2]), torch.tensor([3]))


def test_expected_tokens_matches_the_closed_form() -> None:
    acceptance = torch.tensor([0.0, 0.3, 0.8, 1.0], dtype=torch.float64)
    lengths = torch.tensor([3, 2, 5, 4])
    closed = [(1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1 for a, k in zip(acceptance.tolist(), lengths.tolist())]
    torch.testing.assert_close(expected_tokens(acceptance, lengths), torch.tensor(closed, dtype=torch.float64))


# ---- piecewise linear functions ------------------------------------------------------------------------------------
def test_isotonic_regression_pools_adjacent_violators() -> None:
    fitted = isotonic_increasing(np.array([1.0, 3.0, 2.0, 4.0]), np.ones(4))
    np.testing.assert_allclose(fitted, [1.0, 2.5, 2.5, 4.0])
    weighted = isotonic_increasing(np.array([1.0, 3.0, 2.0]), np.array([1.0, 1.0, 3.0]))
    np.testing.assert_allclose(weighted, [1.0, 2.25, 2.25])


def test_piecewise_linear_interpolates_and_extrapolates() -> None:
    curve = PiecewiseLinear.fit({2: (1.0, 1), 4: (2.0, 1), 8: (2.5, 1)})
    np.testing.assert_allclose(curve(np.array([1.0, 2.0, 3.0, 6.0, 12.0])), [0.5, 1.0, 1.5, 2.25, 3.0])
    single = PiecewiseLinear.fit({4: (2.0, 1)})
    np.testing.assert_allclose(single(np.array([2.0, 4.0, 40.0])), [1.0, 2.0, 2.0])
    assert PiecewiseLinear.fit({}) is None


def test_piecewise_linear_follows_the_line_to_a_far_point_past_its_last_knot() -> None:
    flat_end = {8: (1.0, 1), 15: (1.8, 1), 16: (1.8, 1)}  # the last segment is flat
    curve = PiecewiseLinear.fit(flat_end, far=(116.0, 11.8))
    np.testing.assert_allclose(curve(np.array([8.0, 15.5, 16.0, 66.0])), [1.0, 1.8, 1.8, 6.8])
    np.testing.assert_allclose(PiecewiseLinear.fit(flat_end)(np.array([66.0])), [1.8])
    single = PiecewiseLinear.fit({4: (2.0, 1)}, far=(24.0, 4.0))
    np.testing.assert_allclose(single(np.array([2.0, 14.0])), [1.0, 3.0])
    near = PiecewiseLinear.fit({2: (1.0, 1), 4: (2.0, 1)}, far=(3.0, 9.0))  # not past the last knot: ignored
    np.testing.assert_allclose(near(np.array([6.0])), [3.0])
    below = PiecewiseLinear.fit({2: (1.0, 1), 4: (2.0, 1)}, far=(40.0, 1.5))  # cheaper than the last knot: flat
    np.testing.assert_allclose(below(np.array([6.0])), [2.0])


def test_online_cost_model_extends_every_verify_curve_to_the_call_prefill() -> None:
    """The learned curve, the evidence the loss budget books at and the optimistic curve of probes all price a
    verify wider than their last knot on the line to the call's target prefill."""
    model = OnlineCostModel(warmup_steps=0)
    for _ in range(3):
        for batch in (15, 16):
            lengths = torch.zeros(batch, dtype=torch.long)
            model.observe(StepFeedback(torch.arange(batch), lengths, lengths, lengths, 0.0, 0.9, batch))
    model.observe_prefill(9600, 114.0)
    wide = 0.9 + (114.0 - 0.9) * (64 - 16) / (9600 - 16)
    for curve in (model.verify, model.evidence.verify, model.optimistic().verify):
        assert float(curve(np.array([64.0]))[0]) == pytest.approx(wide)


# ---- online cost model ---------------------------------------------------------------------------------------------
def true_verify(tokens: float) -> float:
    """A target whose forward costs 80 ms plus 4 ms per token, growing faster beyond ~64 tokens."""
    return 0.08 + 0.004 * tokens + 0.00003 * tokens**2


def true_draft(batch: int) -> float:
    return 0.02 + 0.002 * batch


def true_step(batch: int, longest: int) -> float:
    return true_verify(batch * (1 + longest)) + longest * true_draft(batch)


class NoisyClock:
    """Timings of `true_step` with 10% log-normal noise and, on 5% of the steps, a 4x stall."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def __call__(self, seconds: float) -> float:
        stall = 4.0 if self.rng.random() < 0.05 else 1.0
        return seconds * float(np.exp(self.rng.normal(0.0, 0.1))) * stall


def run_rollout(policy: GoodputPolicy, clock: NoisyClock, budgets: list[int], acceptance: float, seed: int) -> list:
    """Simulate one `generate` call: rows finish as their budgets run out; returns (batch, longest) per step."""
    generator = torch.Generator().manual_seed(seed)
    remaining = torch.tensor(budgets)
    row_ids = torch.arange(len(budgets))
    policy.reset(len(budgets))
    trace, step = [], 0
    while row_ids.numel():
        lengths = policy.draft_lengths(PolicyInput(step, row_ids, remaining, 8)).minimum(remaining - 1).clamp(min=0)
        accepted = geometric_accepted(torch.full((row_ids.numel(),), acceptance), lengths, generator)
        batch, longest = row_ids.numel(), int(lengths.max())
        draft_seconds = clock(longest * true_draft(batch)) if longest else 0.0
        verify_seconds = clock(true_verify(batch * (1 + longest)))
        policy.observe(StepFeedback(row_ids, lengths, lengths, accepted, draft_seconds, verify_seconds,
                                    batch * (1 + longest)))
        trace.append((batch, longest))
        remaining = remaining - (accepted + 1)
        alive = remaining > 0
        row_ids, remaining, step = row_ids[alive], remaining[alive], step + 1
    return trace


def test_online_cost_model_converges_without_a_profile() -> None:
    model = OnlineCostModel()
    policy = GoodputPolicy(GoodputSettings(prior_acceptance=0.8), cost_model=model)
    clock = NoisyClock(seed=0)
    rng = np.random.default_rng(1)
    for call in range(4):  # one policy object across generate calls keeps learning
        run_rollout(policy, clock, rng.integers(20, 200, size=16).tolist(), acceptance=0.8, seed=call)
    # confirmed knots sit on the true curve despite noise and 4x stalls (read a little low: the fastest sample)
    confirmed = [n for n, samples in model.verify_samples.items() if len(samples) >= model.confirm_samples]
    assert len(confirmed) >= 10
    for tokens in confirmed:
        assert 0.75 < float(model.verify(np.array([tokens]))[0]) / true_verify(tokens) < 1.1
    # and the lengths it picks at every batch size are worth (under the true costs) nearly the best lengths
    for batch in range(1, 17):
        acceptance = torch.full((batch,), 0.8, dtype=torch.float64)
        chosen = int(best_draft_lengths(acceptance, torch.full((batch,), 8), 8, model).max())
        rates = [batch * float(expected_tokens(acceptance[:1], torch.tensor([k]))) / true_step(batch, k) for k in range(9)]
        assert rates[chosen] >= 0.9 * max(rates), (batch, chosen, int(np.argmax(rates)))


def test_online_cost_model_ignores_a_stall_at_a_thinly_measured_point() -> None:
    model = OnlineCostModel(warmup_steps=0)

    def observe(batch: int, longest: int, slowdown: float = 1.0) -> None:
        lengths = torch.full((batch,), longest)
        model.observe(StepFeedback(torch.arange(batch), lengths, lengths, lengths, 0.0,
                                   slowdown * true_verify(batch * (1 + longest)), batch * (1 + longest)))

    for _ in range(3):
        observe(4, 0)
        observe(4, 3)
    observe(4, 1, slowdown=4.0)  # one stalled step at N = 8, between two confirmed knots
    between = true_verify(4) + (true_verify(16) - true_verify(4)) * (8 - 4) / (16 - 4)  # the confirmed knots' line
    assert float(model.verify(np.array([8]))[0]) == pytest.approx(between)
    for _ in range(3):
        observe(4, 1)
    assert float(model.verify(np.array([8]))[0]) == pytest.approx(true_verify(8))


@pytest.mark.parametrize("ratio", [None, 0.4])
def test_online_cost_model_prices_a_lone_slow_draft_step_at_most_at_the_prior(ratio: float | None) -> None:
    """The first draft step timed 5x too slow (a burst of load, a one-off measurement): with a draft/target ratio,
    the draft knot is worth at most that ratio times a plain step until fresh samples confirm it; without one the
    slow sample stands (and would keep the policy from drafting, hence from measuring it again)."""
    model = OnlineCostModel(warmup_steps=0)
    model.draft_ratio = ratio
    plain = torch.zeros(1, dtype=torch.long)
    for _ in range(3):
        model.observe(StepFeedback(torch.arange(1), plain, plain, plain, 0.0, 0.2, 1))
    one = torch.ones(1, dtype=torch.long)
    model.observe(StepFeedback(torch.arange(1), one, one, one, 0.5, 0.21, 2))  # true draft cost: 0.1 s
    priced = float(model.draft(np.array([1]))[0])
    assert priced == (pytest.approx(0.4 * 0.2) if ratio else pytest.approx(0.5))
    assert float(model.evidence.draft(np.array([1]))[0]) == pytest.approx(0.5)  # the budget books what was measured
    for _ in range(2):
        model.observe(StepFeedback(torch.arange(1), one, one, one, 0.1, 0.21, 2))
    assert float(model.draft(np.array([1]))[0]) == pytest.approx(0.1)  # confirmed: the median of three samples


def test_goodput_runs_the_lengths_a_fresh_online_model_asks_for() -> None:
    policy = GoodputPolicy(GoodputSettings(warmup_steps=0), cost_model=OnlineCostModel(warmup_steps=0))
    policy.reset(4)
    request = PolicyInput(0, torch.arange(4), torch.tensor([50, 50, 50, 3]), 6)
    assert policy.draft_lengths(request).tolist() == [0, 0, 0, 0] and policy.last_exploration == 0
    lengths = torch.zeros(4, dtype=torch.long)
    policy.observe(StepFeedback(torch.arange(4), lengths, lengths, lengths, 0.0, 0.1, 4))
    assert policy.draft_lengths(request).tolist() == [6, 6, 6, 2] and policy.last_exploration == 6


def test_online_cost_model_asks_for_the_points_it_lacks() -> None:
    model = OnlineCostModel(explore_interval=2, warmup_steps=1)
    assert model.exploration_length(4, 8) == 0  # nothing known: a plain step first

    def observe(batch: int, longest: int) -> None:
        lengths = torch.full((batch,), longest)
        model.observe(StepFeedback(torch.arange(batch), lengths, lengths, lengths, 0.01 * longest,
                                   true_verify(batch * (1 + longest)), batch * (1 + longest)))

    observe(4, 0)  # the warm-up step is ignored
    assert model.steps_observed == 1 and not model.verify_samples
    observe(4, 0)
    assert model.exploration_length(4, 8) == 8  # the plain step is known; now the longest draft
    observe(4, 8)
    assert model.exploration_length(4, 8) is None  # bracketed: gap filling waits for explore_interval steps
    gap = model.exploration_length(4, 8)
    assert gap is not None and 1 <= gap <= 7
    assert model.exploration_length(2, 8) == 0  # a smaller batch: its plain step is below every knot
    assert model.exploration_length(40, 8) == 8  # a larger one: its longest draft is above every knot


@pytest.mark.parametrize("confirm_samples", [3, 1])
def test_online_cost_model_explores_a_knot_measured_once_again(confirm_samples: int) -> None:
    """A knot with one sample is priced optimistically and may be vetoed by the loss budget for good: exploration
    treats it as a gap until a second sample lands (unless one sample confirms a knot: then nothing is optimistic)."""
    model = OnlineCostModel(explore_interval=1, warmup_steps=0, confirm_samples=confirm_samples)

    def observe(batch: int, longest: int) -> None:
        lengths = torch.full((batch,), longest)
        model.observe(StepFeedback(torch.arange(batch), lengths, lengths, lengths, 0.01 * longest,
                                   true_verify(batch * (1 + longest)), batch * (1 + longest)))

    for _ in range(2):
        observe(4, 0)
        observe(4, 8)
    observe(4, 3)  # N = 16, once: no knot yet, so N = 12 is the farthest from the knots at 4 and 36
    assert model.exploration_length(4, 8) == (2 if confirm_samples > 1 else 1)
    observe(4, 3)  # N = 16 seen twice: now N = 8 is the farthest from every knot
    assert model.exploration_length(4, 8) == 1


def test_profile_cost_model_never_explores_and_merges_equal_token_counts() -> None:
    profile = Profile(
        target_forward=[TargetTiming(1, 4, 0.30), TargetTiming(4, 1, 0.20), TargetTiming(2, 2, 0.22),
                        TargetTiming(1, 1, 0.10), TargetTiming(2, 1, 0.09)],
        draft_forward=[DraftTiming(1, 0.02)],
    )
    model = ProfileCostModel(profile)
    assert model.exploration_length(1, 8) is None
    np.testing.assert_allclose(model.verify.xs, [1.0, 2.0, 4.0])
    np.testing.assert_allclose(model.verify.ys, [0.095, 0.095, 0.22])  # median at N=4, then made nondecreasing


def test_online_model_starts_from_a_profile_and_follows_a_slower_machine() -> None:
    profile = Profile(
        target_forward=[TargetTiming(b, t, true_verify(b * t)) for b in (1, 4) for t in (1, 3, 9)],
        draft_forward=[DraftTiming(b, true_draft(b)) for b in (1, 4)],
    )
    model = OnlineCostModel(window=5, warmup_steps=0, profile=profile)
    assert model.step_seconds(4, torch.tensor([2, 0, 0, 0])) == pytest.approx(true_step(4, 2))
    for _ in range(5):  # this machine is twice as slow
        lengths = torch.full((4,), 2)
        model.observe(StepFeedback(torch.arange(4), lengths, lengths, lengths, 2 * 2 * true_draft(4),
                                   2 * true_verify(12), 12))
    assert model.step_seconds(4, torch.tensor([2, 2, 2, 2])) == pytest.approx(2 * true_step(4, 2), rel=0.01)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"window": 0}, "`window` must be an integer >= 1"),
        ({"tolerance": 0}, "`tolerance` must be a finite number > 0"),
        ({"explore_interval": 0}, "`explore_interval` must be an integer >= 1"),
        ({"warmup_steps": -1}, "`warmup_steps` must be an integer >= 0"),
    ],
)
def test_online_cost_model_rejects_bad_settings(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        OnlineCostModel(**kwargs)


# ---- profiles ------------------------------------------------------------------------------------------------------
def small_profile() -> Profile:
    return Profile(
        target_forward=[TargetTiming(1, 1, 0.1, [0.1, 0.11]), TargetTiming(1, 2, 0.12, [0.12])],
        draft_forward=[DraftTiming(1, 0.03, [0.03])],
        target="t",
        draft="d",
    )


def test_profile_round_trips_through_json(tmp_path) -> None:
    path = tmp_path / "profile.json"
    small_profile().save(path)
    data = json.loads(path.read_text())
    assert data["format"] == "hf_dynspec.profile" and data["version"] == 1
    assert Profile.load(path) == small_profile()
    assert Profile.load(data) == small_profile()


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(format="vllm"), "Not a calibration profile: `format` is 'vllm'"),
        (lambda d: d.update(version=7), "Unsupported profile `version` 7"),
        (lambda d: d.update(gpu="a100"), r"Unknown profile key\(s\) \['gpu'\]"),
        (lambda d: d["target_forward"][1].update(seconds=-1.0), r"`target_forward\[1\].seconds` must be a finite number > 0"),
        (lambda d: d["target_forward"][0].update(tokens_per_row=0), r"`target_forward\[0\].tokens_per_row`"),
        (lambda d: d["draft_forward"][0].update(batch_size=0), r"`draft_forward\[0\].batch_size`"),
        (lambda d: d["target_forward"][0].pop("seconds"), "Malformed timing entry"),
        (lambda d: d.update(target_forward=[]), "at least one `target_forward` timing"),
    ],
)
def test_profile_rejects_malformed_files_naming_the_field(mutate, message) -> None:
    data = small_profile().to_dict()
    mutate(data)
    with pytest.raises(ValueError, match=message):
        Profile.from_dict(data)


def test_profile_load_reports_a_missing_file() -> None:
    with pytest.raises(ValueError, match="does not exist; create it with `hf-dynspec calibrate`"):
        Profile.load("/nonexistent/profile.json")



def test_online_cost_model_times_draft_forwards_of_draft_model_rows_only() -> None:
    """A hybrid's prompt-lookup rows propose without a draft forward: a step served by lookup alone must not teach
    the model that draft forwards are free, and a mixed step divides its draft time by the draft rows' longest."""
    model = OnlineCostModel(warmup_steps=0)
    lengths = torch.tensor([10, 3])

    def observe(free: list[bool], draft_seconds: float) -> None:
        model.observe(StepFeedback(torch.arange(2), lengths, lengths, lengths, draft_seconds, 0.2, 22,
                                   free_rows=torch.tensor(free)))

    observe([True, True], 1e-5)  # lookup only: the few microseconds are bookkeeping, not a forward
    assert 2 not in model.draft_samples
    observe([True, False], 0.3)  # row 1 drafted 3 tokens with the model; row 0 took 10 from lookup
    assert float(model.draft(np.array([2]))[0]) == pytest.approx(0.1)


def test_online_cost_model_prices_a_draft_that_runs_rows_apart_by_its_rows_drafts() -> None:
    """A draft that drafts each row in forwards of its own (another tokenizer's, re-encoded row by row): a step's draft
    seconds are per row-forward, learned at one row, and a step's price grows with every row's draft, not its longest
    alone. A change of mode forgets the knots learned the other way."""
    model = OnlineCostModel(warmup_steps=0)
    model.observe(StepFeedback(torch.arange(4), torch.full((4,), 4), torch.full((4,), 4), torch.zeros(4, dtype=torch.long),
                               0.8, 0.2, 20))
    assert sorted(model.draft_samples) == [4]  # batched: 4 forwards over 4 rows, 0.2 s each
    model.set_rows_apart(True)
    assert not model.draft_samples
    lengths = torch.tensor([3, 0, 2, 1])
    model.observe(StepFeedback(torch.arange(4), lengths, lengths, torch.zeros(4, dtype=torch.long), 0.6, 0.2, 16))
    assert sorted(model.draft_samples) == [1]
    assert float(model.draft(np.array([1]))[0]) == pytest.approx(0.1)  # 6 one-row forwards in 0.6 s
    verify = float(model.verify(np.array([12.0]))[0])
    assert model.step_seconds(4, torch.tensor([2, 2, 2, 2])) == pytest.approx(verify + 8 * 0.1)
    assert model.step_seconds(4, torch.tensor([2, 0, 0, 0])) == pytest.approx(verify + 2 * 0.1)
    candidates = torch.tensor([[2, 2, 2, 2], [2, 0, 0, 0]])
    assert model.candidate_seconds(4, candidates).tolist() == pytest.approx([verify + 0.8, verify + 0.2])
    assert model.evidence.rows_apart and model.optimistic().rows_apart


def test_a_draft_forward_past_the_last_draft_knot_grows_with_rows_as_the_target_does() -> None:
    """Drafts timed only at batch 1 (a run of one-row calls) must not price a forward over 16 rows at one row's cost:
    past its last knot the draft curve is scaled by the verify curve (on an Intel Xeon in float32 a 16-row draft
    forward cost 0.22 s against 0.06 s for one row, and the flat curve made a batch of 16 draft at a loss)."""
    verify = PiecewiseLinear.fit({1: (0.2, 1), 16: (0.5, 1), 64: (1.4, 1)})
    model = PaddedCostModel(verify, PiecewiseLinear.fit({1: (0.06, 1)}))
    assert model.draft_forward(1) == pytest.approx(0.06)
    assert model.draft_forward(16) == pytest.approx(0.06 * 0.5 / 0.2)
    assert model.step_seconds(16, torch.full((16,), 2)) == pytest.approx(float(verify(np.array([48.0]))[0]) + 0.3)
    measured = PaddedCostModel(verify, PiecewiseLinear.fit({1: (0.06, 1), 16: (0.22, 1)}))
    assert measured.draft_forward(16) == pytest.approx(0.22)  # a measured knot is taken as it is
    assert measured.draft_forward(8) == pytest.approx(0.06 + 7 * 0.16 / 15)
    assert PaddedCostModel(verify, None).draft_forward(16) == 0.0


def _observe_one_row(model: OnlineCostModel, longest: int, verify_seconds: float, draft_seconds: float = 0.0) -> None:
    lengths = torch.full((1,), longest)
    model.observe(StepFeedback(torch.arange(1), lengths, lengths, lengths, draft_seconds, verify_seconds, 1 + longest))


def test_evidence_books_a_cost_measured_once_in_full() -> None:
    """Float32 on a CPU with AVX2 only: verifying 2 tokens costs 2.2x one. The search may stay optimistic about a
    point measured once (it could have been a burst of interference), the loss budget may not."""
    model = OnlineCostModel(warmup_steps=0)
    for _ in range(3):
        _observe_one_row(model, 0, 0.36)
    _observe_one_row(model, 1, 0.8, draft_seconds=0.16)
    assert float(model.verify(np.array([2]))[0]) == pytest.approx(0.36)  # provisional: capped by the confirmed knot
    assert float(model.evidence.verify(np.array([2]))[0]) == pytest.approx(0.8)
    assert float(model.evidence.verify(np.array([1]))[0]) == pytest.approx(0.36)


def test_a_capped_knot_never_pulls_a_measured_one_down() -> None:
    """A knot measured once is capped by the confirmed knots' prediction, but never below a measured knot with fewer
    tokens: the isotonic fit would pool the two and lose a cost that rises steeply from the second token on."""
    model = OnlineCostModel(warmup_steps=0, stale_after=4)
    for _ in range(3):
        _observe_one_row(model, 1, 0.8, draft_seconds=0.16)  # 2 tokens: 2.2x one; stale after the next steps
    for _ in range(3):
        _observe_one_row(model, 0, 0.36)  # the only fresh confirmed knot: flat beyond 1 token
    _observe_one_row(model, 5, 1.2, draft_seconds=0.8)  # 6 tokens, once: provisional
    verify = model.verify(np.array([2, 6]))
    assert verify[0] == pytest.approx(0.8) and verify[1] == pytest.approx(0.8)


def test_draft_knots_take_the_median_not_the_luckiest_step() -> None:
    """With draft lookahead one forward may yield several draft tokens, so seconds per draft token vary with the
    content: the fastest step would price every draft token at its luckiest."""
    model = OnlineCostModel(warmup_steps=0)
    for draft_seconds in (0.24, 1.6, 1.6, 1.7):  # 8 draft tokens each: 0.03 s per token once, 0.2 s otherwise
        _observe_one_row(model, 8, 1.3, draft_seconds=draft_seconds)
    assert float(model.draft(np.array([1]))[0]) == pytest.approx(0.2)
