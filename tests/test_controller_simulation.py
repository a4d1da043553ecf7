"""The goodput controller against synthetic workloads (`hf_dynspec.evaluation.simulate`): bounded loss to plain
decoding and to the best fixed draft length in hindsight, over many random scenarios with bursts of noise.

Bounds, stated once: over a whole run the controller is at most `LOSS_BOUND` slower than plain decoding (its loss
budget plus what one mispriced step and interference can add) and at least `HINDSIGHT_BOUND` times as fast as the
best fixed length, plain included, chosen after the fact (the worst cases are bursts of interference while the
controller is still measuring costs; typical runs reach 0.95x). Times are the runs' seconds without the bursts,
for decisions taken under them. A naive controller (the same search without the loss
budget) and a fixed maximal length must fail the plain bound on the same kind of scenarios.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_dynspec.evaluation.simulate import Burst, Environment, simulate
from hf_dynspec.policies import GoodputPolicy, GoodputSettings, StaticPolicy

LOSS_BOUND = GoodputSettings().loss_budget + 0.05
HINDSIGHT_BOUND = 0.7  # measured: median 0.955 and 10th percentile 0.943 over 60 scenarios; worst seen 0.740
MAX_DRAFT = 6


def environment(rng: np.random.Generator) -> Environment:
    """A random workload: batch size, acceptance per row, cost curve, draft cost, prompt length, bursts of noise."""
    batch = int(rng.choice([1, 2, 4, 8, 16, 32]))
    mean = rng.uniform(0.0, 0.95)
    bursts = tuple(
        Burst(float(rng.uniform(0, 15)), float(rng.uniform(1, 4)), float(rng.uniform(2, 6)))
        for _ in range(int(rng.integers(0, 3)))
    )
    return Environment(
        acceptance=tuple(np.clip(mean + rng.uniform(-0.15, 0.15, batch), 0.0, 0.97).tolist()),
        budgets=tuple(rng.integers(48, 97, batch).tolist()),
        prompt_tokens=int(rng.integers(50, 400)),
        flat_tokens=int(rng.integers(8, 65)),
        draft_ratio=float(rng.uniform(0.05, 0.5)),
        max_draft_tokens=MAX_DRAFT,
        bursts=bursts,
        multi_token_factor=float(rng.choice([1.0, 1.0, 2.2])),  # AMX / bfloat16, or float32 on an AVX2-only CPU
    )


def seconds(policy, env: Environment, seed: int) -> float:
    """The run's seconds without the bursts (its decisions were taken under them): a burst late in a run slows
    whichever run is still going, which says nothing about the decisions."""
    return simulate(policy, env, seed).clean_seconds


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_controller_loses_little_to_plain_and_to_the_best_fixed_length(seed: int) -> None:
    env = environment(np.random.default_rng(seed))
    plain = seconds(StaticPolicy(0), env, seed)
    best_fixed = min([plain] + [seconds(StaticPolicy(k), env, seed) for k in range(1, MAX_DRAFT + 1)])
    controller = seconds(GoodputPolicy(GoodputSettings()), env, seed)
    assert controller <= plain * (1 + LOSS_BOUND), f"{plain / controller:.3f}x plain on {env}"
    assert best_fixed / controller >= HINDSIGHT_BOUND, f"{best_fixed / controller:.3f}x the best fixed length on {env}"


def naive_failures(make_policy, scenarios: int = 30) -> int:
    failures = 0
    for seed in range(scenarios):
        env = environment(np.random.default_rng(seed))
        failures += seconds(make_policy(), env, seed) > seconds(StaticPolicy(0), env, seed) * (1 + LOSS_BOUND)
    return failures


def test_naive_controllers_fail_the_plain_bound() -> None:
    assert naive_failures(lambda: GoodputPolicy(GoodputSettings(loss_budget=None))) > 0
    assert naive_failures(lambda: StaticPolicy(MAX_DRAFT)) > 0


def test_controller_speculates_where_it_pays() -> None:
    """Batch 1, high acceptance, verification nearly free: the controller drafts on most steps and beats plain."""
    env = Environment(acceptance=(0.9,), budgets=(128,), flat_tokens=40, draft_ratio=0.3)
    result = simulate(GoodputPolicy(GoodputSettings()), env)
    plain = seconds(StaticPolicy(0), env, 0)
    assert result.drafting_steps > 0.7 * result.steps
    assert plain / result.seconds > 1.4


def test_controller_never_drafts_when_the_draft_prefill_cannot_pay() -> None:
    """Batch 32, compute-bound verification: the draft's prefill alone exceeds the loss budget, so it is never paid."""
    env = Environment(acceptance=(0.7,) * 32, budgets=(64,) * 32, flat_tokens=16, draft_ratio=0.3)
    result = simulate(GoodputPolicy(GoodputSettings()), env)
    assert result.drafting_steps == 0
    assert result.seconds == seconds(StaticPolicy(0), env, 0)


@pytest.mark.slow
def test_controller_stays_near_plain_where_a_second_token_costs_more() -> None:
    """Float32 on a CPU with AVX2 only (measured: a target forward over 2 tokens costs 2.2x one, a draft forward 44%
    of one): no fixed length beats plain decoding at acceptance 0.8. One policy serves three blocks of 16 calls, as
    the bench reuses it: the first block loses at most the loss budget (5%), and once the costs are known the later
    blocks lose 1% on average. What is left are measurements, each paying the draft's prompt catch-up (about 6 plain
    steps here): one is made only where its expected gain over the tokens it informs exceeds that. A single run's
    later block is no measure of the rate, so this takes six independent runs (measured: the first blocks lose
    0.8-1.0%, the later ones nothing, as no measurement repays its catch-up once acceptance is known; with probes
    after a count of plain steps, as before, the later blocks lost 0.56% on average and at most 1.34%)."""
    env = Environment(acceptance=(0.8,), budgets=(48,), prompt_tokens=100, v0=0.36, flat_tokens=20, draft_ratio=0.44,
                      multi_token_factor=2.2, max_draft_tokens=8)
    later = []
    for run in range(6):
        policy = GoodputPolicy(GoodputSettings())
        for block in range(3):
            calls = [block + 100 * call + 10_000 * run for call in range(16)]
            plain = sum(seconds(StaticPolicy(0), env, seed) for seed in calls)
            if run == 0:
                best_fixed = min(sum(seconds(StaticPolicy(k), env, seed) for seed in calls) for k in range(1, 9))
                assert best_fixed > plain
            loss = sum(seconds(policy, env, seed) for seed in calls) / plain - 1
            bound = GoodputSettings().loss_budget if block == 0 else 0.015
            assert loss <= bound, f"run {run}, block {block}: {1 / (1 + loss):.3f}x plain"
            later += [loss] if block else []
    assert np.mean(later) <= 0.01, f"later blocks lose {np.mean(later):.2%} on average"


def avx2_narrow_calls(acceptance: list[float]) -> list[Environment]:
    """One-row calls of 32 tokens on float32 costs of an AVX2 CPU with narrow products: a step drafting one token
    costs 1.6x a plain one and emits up to 2; each call's draft first catches up on its prompt (about 1.6 plain
    steps)."""
    return [Environment(acceptance=(a,), budgets=(32,), prompt_tokens=20, v0=0.471, flat_tokens=6, draft_ratio=0.4,
                        multi_token_factor=1.07, max_draft_tokens=4) for a in acceptance]


def drafting_steps(calls: list[Environment]) -> list[int]:
    policy = GoodputPolicy(GoodputSettings())  # one policy serves every call, as `generate` keeps it
    return [simulate(policy, env, seed).drafting_steps for seed, env in enumerate(calls)]


def test_new_calls_draft_where_the_catch_up_is_repaid_over_the_call() -> None:
    """Each new call's catch-up is shared by the tokens the call has left. Charged instead to the fewest, longest
    steps, it priced every short draft out of these calls after the second."""
    steps = drafting_steps(avx2_narrow_calls([0.78, 0.83, 0.97, 0.92, 0.69, 0.85, 0.79, 0.86]))
    assert steps[1] > 0 and sum(steps[2:]) >= 30, steps


def test_short_calls_measure_the_draft_again_after_calls_where_it_did_not_pay() -> None:
    """After calls where drafting stopped paying, later calls with high acceptance draft again. A measurement informs
    the rest of its call and, past it, as many steps as the pooled estimate remembers: in 32-token calls that each
    pay the draft's catch-up, the call's own tokens alone never repaid one (no call after the third drafted)."""
    steps = drafting_steps(avx2_narrow_calls([0.77, 0.72, 0.83, 0.89, 0.96, 0.86, 0.79, 0.77]))
    assert sum(steps[3:]) >= 10, steps
