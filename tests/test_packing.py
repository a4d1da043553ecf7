"""Packed verify forwards (`hf_dynspec.packing`): the same logits as padded forwards, only the real tokens computed,
and the cost model pricing what is computed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import left_padded_prompts, perturbed, tiny_model

import hf_dynspec
from hf_dynspec import DynSpecConfig
from hf_dynspec.cost_models import PaddedCostModel, PiecewiseLinear
from hf_dynspec.packing import can_pack
from hf_dynspec.policies import DraftLengthPolicy, PolicyInput


class RaggedLengths(DraftLengthPolicy):
    """Each row drafts a pseudo-random 0-4 tokens each step, so most verify blocks have padding."""

    def draft_lengths(self, request: PolicyInput) -> torch.LongTensor:
        return (request.row_ids * 7 + request.step * 3) % 5


def run(target, draft, ids, mask, packed: bool, tree: int):
    config = DynSpecConfig(num_speculative_tokens=4, tree_node_budget=tree, packed_verify=packed)
    return hf_dynspec.generate(
        target, input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=24, assistant_model=draft,
        dynspec_config=config, dynspec_policy=RaggedLengths(), return_dict_in_generate=True, output_logits=True,
    )


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("tree", [0, 6])
@pytest.mark.parametrize("lengths", [[7, 12, 5], [9, 4, 13, 8, 6, 11]])
def test_packed_verify_gives_the_padded_forwards_logits(family, tree, lengths):
    target = tiny_model(family, seed=0)
    draft = perturbed(target, scale=0.05)
    ids, mask = left_padded_prompts(lengths, seed=len(lengths) + tree)
    expected = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    padded, packed = (run(target, draft, ids, mask, on, tree) for on in (False, True))
    assert torch.equal(packed.sequences, expected) and torch.equal(padded.sequences, expected)
    for ours, theirs in zip(packed.logits, padded.logits):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-9)
    steps = packed.dynspec_stats.steps
    assert any(s.target_tokens < s.batch_size * (1 + max(s.draft_lengths)) for s in steps)  # some step was packed
    assert all(s.target_tokens >= s.batch_size + sum(s.draft_lengths) for s in steps)


def test_a_packed_step_books_the_tokens_it_computed():
    target = tiny_model("llama", seed=1)
    ids, mask = left_padded_prompts([6, 9, 11, 5], seed=2)
    out = run(target, perturbed(target, scale=0.05), ids, mask, True, 0)
    for step in out.dynspec_stats.steps:
        assert step.target_tokens == step.batch_size + sum(step.draft_lengths)


def test_models_that_cannot_pack_run_padded():
    target = tiny_model("llama", seed=0, attn_implementation="eager")
    assert not can_pack(target) and can_pack(tiny_model("llama", seed=0))
    ids, mask = left_padded_prompts([7, 12], seed=1)
    expected = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    out = run(target, perturbed(target, scale=0.05), ids, mask, True, 0)
    assert torch.equal(out.sequences, expected)
    steps = out.dynspec_stats.steps
    assert all(s.target_tokens == s.batch_size * (1 + max(s.draft_lengths)) for s in steps)


def test_the_cost_model_prices_packed_steps_by_their_real_tokens():
    verify = PiecewiseLinear.fit({16: (1.0, 1), 80: (2.0, 1)})
    model = PaddedCostModel(verify, None)
    longest, totals = np.array([4.0]), np.array([4.0])  # one row of 16 drafts 4 tokens
    padded = float(model.padded_seconds(16, longest, totals)[0])
    model.set_packed(True)
    packed = float(model.padded_seconds(16, longest, totals)[0])
    assert packed == pytest.approx(float(verify(np.array([20.0]))[0]))
    assert padded == pytest.approx(2.0) and packed < padded


def test_every_cost_model_the_policy_derives_keeps_the_packing():
    from hf_dynspec.cost_models import OnlineCostModel, verify_only

    model = OnlineCostModel()
    model.set_packed(True)
    assert model.evidence.packed and model.optimistic().packed and verify_only(model).packed


def test_packed_verify_must_be_a_bool():
    with pytest.raises(ValueError, match="`packed_verify` must be a bool"):
        DynSpecConfig(packed_verify="yes")
