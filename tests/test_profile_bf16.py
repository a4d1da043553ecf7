"""The committed bfloat16 profile of the default pair (docs/benchmarks/profile_bf16.json, `hf-dynspec calibrate`):
the cost model follows its measured curve, flat up to several tokens per row and rising after, without assuming a
shape, and the goodput search drafts longer where verification is nearly free."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from hf_dynspec.cost_models import Profile, ProfileCostModel
from hf_dynspec.policies import best_draft_lengths

PROFILE = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "profile_bf16.json"


def model() -> ProfileCostModel:
    return ProfileCostModel(Profile.load(PROFILE))


def test_profile_is_bfloat16_and_covers_batches_and_widths() -> None:
    profile = Profile.load(PROFILE)
    assert profile.dtype == "bfloat16"
    assert {t.batch_size for t in profile.target_forward} >= {1, 16}
    assert max(t.tokens_per_row for t in profile.target_forward) >= 9


def test_cost_curve_is_flat_then_rising_and_the_model_follows_the_measurements() -> None:
    profile, costs = Profile.load(PROFILE), model()
    for timing in profile.target_forward:  # the fit stays near every measured point (isotonic smoothing only)
        predicted = float(costs.verify(np.array([timing.batch_size * timing.tokens_per_row]))[0])
        assert 0.7 < predicted / timing.seconds < 1.3, timing
    one, nine = costs.verify(np.array([1.0, 9.0]))
    assert nine / one < 1.5  # batch 1: verifying 9 tokens costs little more than 1
    plain16, wide16 = costs.verify(np.array([16.0, 16.0 * 9]))
    assert wide16 / plain16 > 2.0  # batch 16: compute-bound, verification is not free


def test_search_drafts_long_at_batch_1_and_short_or_nothing_at_batch_16() -> None:
    costs = model()

    def longest(batch: int, acceptance: float) -> int:
        a = torch.full((batch,), acceptance, dtype=torch.float64)
        return int(best_draft_lengths(a, torch.full((batch,), 8), 8, costs).max())

    assert longest(1, 0.85) >= 2
    assert longest(16, 0.85) <= 1
    assert longest(16, 0.5) == 0
    assert [longest(b, 0.7) for b in (1, 2, 4, 8, 16)] == sorted([longest(b, 0.7) for b in (1, 2, 4, 8, 16)], reverse=True)


def test_goodput_trees_grow_where_verification_is_nearly_free_and_shrink_under_load() -> None:
    from hf_dynspec.policies import GoodputPolicy, PolicyInput

    policy = GoodputPolicy(cost_model=model())

    def budgets(lengths: list[int]) -> list[int]:
        batch = len(lengths)
        request = PolicyInput(0, torch.arange(batch), torch.full((batch,), 64), 4, max_tree_nodes=16)
        return policy.node_budgets(request, torch.tensor(lengths)).tolist()

    (alone,) = budgets([2])
    assert alone >= 4  # batch 1: a few extra tokens per row cost little, the tree outgrows the chain
    costs = model()
    assert costs.verify(np.array([1.0 + alone]))[0] <= 1.15 * costs.verify(np.array([3.0]))[0] + 1e-12
    assert budgets([0, 2])[0] == 0  # a row that does not draft gets no tree
    assert budgets([1] * 16) == [1] * 16  # batch 16: every token costs, the tree is a chain's size
