"""Every policy only changes speed: greedy output through the loop equals plain greedy `generate`."""

from __future__ import annotations

import pytest
import torch
from conftest import perturbed, tiny_model

import hf_dynspec
from hf_dynspec import DynSpecConfig
from hf_dynspec.cost_models import DraftTiming, OnlineCostModel, Profile, ProfileCostModel, TargetTiming
from hf_dynspec.policies import GoodputPolicy, GoodputSettings

PAD, VOCAB, NEW_TOKENS = 0, 100, 24

VLLM_EAGLE = {
    "method": "eagle",
    "model": "yuhuili/EAGLE-LLaMA3.1-Instruct-8B",
    "num_speculative_tokens": 3,
    "num_speculative_tokens_per_batch_size": [[1, 64, 3], [65, 128, 1], [129, 512, 0]],
}


def linear_profile() -> dict:
    sizes, tokens = [1, 2, 4, 8], [1, 2, 3, 5]
    return Profile(
        target_forward=[TargetTiming(b, t, 0.02 + 0.01 * b * t) for b in sizes for t in tokens],
        draft_forward=[DraftTiming(b, 0.002 + 0.001 * b) for b in sizes],
    ).to_dict()


@pytest.fixture(scope="module")
def models():
    """A tiny float32 Llama target and a draft that is the target with noise on its weights."""
    target = tiny_model("llama", seed=0, vocab=VOCAB, dtype=torch.float32, max_position_embeddings=256,
                        eos_token_id=None, bos_token_id=None, pad_token_id=PAD)
    draft = perturbed(target, scale=0.1)
    return target, draft


@pytest.fixture(scope="module")
def prompts():
    generator = torch.Generator().manual_seed(1)
    lengths = [5, 9, 3, 12, 7, 4]
    ids = torch.full((len(lengths), max(lengths)), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, -length:] = torch.randint(3, VOCAB, (length,), generator=generator)
        mask[row, -length:] = 1
    return ids, mask


@pytest.fixture(scope="module")
def eos_and_expected(models, prompts):
    """An EOS token that ends rows at different steps (so the batch shrinks), and plain greedy output with it."""
    target, _ = models
    ids, mask = prompts
    free = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS)
    generated = free[:, ids.shape[1] :]
    counts = torch.bincount(generated[:, 2:18].reshape(-1), minlength=VOCAB)
    eos = int(counts.argmax())
    expected = target.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=eos
    )
    return eos, expected


def speculative(models, prompts, eos, **kwargs):
    target, draft = models
    ids, mask = prompts
    return target.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        eos_token_id=eos,
        assistant_model=draft,
        custom_generate=hf_dynspec.speculative_loop,
        return_dict_in_generate=True,
        **kwargs,
    )


POLICY_CONFIGS = {
    "static": DynSpecConfig(num_speculative_tokens=4, policy="static"),
    "threshold": DynSpecConfig(num_speculative_tokens=4, policy="threshold",
                               policy_options={"batch_size_threshold": 3}),
    "batch_table_vllm": DynSpecConfig(num_speculative_tokens=3, policy="batch_table", policy_options=VLLM_EAGLE),
    "batch_table_by_load": DynSpecConfig(num_speculative_tokens=5, policy="batch_table", policy_options={
        "num_speculative_tokens": 5, "num_speculative_tokens_per_batch_size": [[1, 2, 5], [3, 4, 2], [5, 64, 0]]}),
    "goodput_online": DynSpecConfig(num_speculative_tokens=6, policy="goodput"),
    "goodput_profile": DynSpecConfig(num_speculative_tokens=6, policy="goodput",
                                     policy_options={"cost_model": "profile", "profile": linear_profile()}),
    "goodput_early_stop": DynSpecConfig(num_speculative_tokens=6, policy="goodput", policy_options={
        "cost_model": "profile", "profile": linear_profile(), "early_stop": {"threshold": 0.5}}),
    "goodput_marginal_stop": DynSpecConfig(num_speculative_tokens=6, policy="goodput", policy_options={
        "cost_model": "profile", "profile": linear_profile(), "early_stop": "marginal"}),
    "confidence": DynSpecConfig(num_speculative_tokens=6, policy="confidence", policy_options={"threshold": 0.5}),
    "heuristic": DynSpecConfig(num_speculative_tokens=6, policy="heuristic"),
}


@pytest.mark.parametrize("name", sorted(POLICY_CONFIGS))
def test_policy_output_is_token_identical_to_plain_greedy(name, models, prompts, eos_and_expected) -> None:
    eos, expected = eos_and_expected
    out = speculative(models, prompts, eos, dynspec_config=POLICY_CONFIGS[name])
    assert torch.equal(out.sequences, expected), name
    sizes = [step.batch_size for step in out.dynspec_stats.steps]
    assert sizes[0] == 6 and sizes[-1] < 6  # rows finished at different steps


def requested_as_expected(stats, length_for_batch) -> bool:
    """Each row asked for `length_for_batch(batch size)`, cut to its remaining budget (`remaining - 1`)."""
    generated = dict.fromkeys(range(stats.batch_size), 1)  # prefill emits every row's first token
    for step in stats.steps:
        for row, requested, emitted in zip(step.row_ids, step.requested_lengths, step.emitted):
            if requested != max(0, min(length_for_batch(step.batch_size), NEW_TOKENS - generated[row] - 1)):
                return False
            generated[row] += emitted
    return True


def test_threshold_and_tables_follow_the_batch_size(models, prompts, eos_and_expected) -> None:
    eos, _ = eos_and_expected
    threshold = speculative(models, prompts, eos, dynspec_config=POLICY_CONFIGS["threshold"]).dynspec_stats
    assert requested_as_expected(threshold, lambda batch: 0 if batch > 3 else 4)
    table = speculative(models, prompts, eos, dynspec_config=POLICY_CONFIGS["batch_table_by_load"]).dynspec_stats
    assert requested_as_expected(table, lambda batch: 5 if batch <= 2 else 2 if batch <= 4 else 0)
    assert {step.batch_size for step in table.steps} >= {2, 3, 4, 5, 6}


def test_confidence_stops_drafts_early(models, prompts, eos_and_expected) -> None:
    eos, _ = eos_and_expected
    stats = speculative(models, prompts, eos, dynspec_config=POLICY_CONFIGS["confidence"]).dynspec_stats
    cut = [d < r for step in stats.steps for d, r in zip(step.draft_lengths, step.requested_lengths)]
    assert any(cut)


def test_a_policy_object_keeps_learning_across_calls(models, prompts, eos_and_expected) -> None:
    """The cost model's timings carry over: every step of both calls is observed by the same model."""
    eos, expected = eos_and_expected
    cost_model = OnlineCostModel()
    policy = GoodputPolicy(cost_model=cost_model)
    config = DynSpecConfig(num_speculative_tokens=6, policy="goodput")
    first = speculative(models, prompts, eos, dynspec_config=config, dynspec_policy=policy)
    assert cost_model.steps_observed == first.dynspec_stats.num_steps and cost_model.verify_samples
    second = speculative(models, prompts, eos, dynspec_config=config, dynspec_policy=policy)
    assert torch.equal(first.sequences, expected) and torch.equal(second.sequences, expected)
    assert cost_model.steps_observed == first.dynspec_stats.num_steps + second.dynspec_stats.num_steps


def test_a_policy_object_keeps_its_acceptance_across_calls(models, prompts, eos_and_expected) -> None:
    """The pooled acceptance carries over and the per-row state is reset. The step costs are fixed (a verify costs
    the same at any width, a draft forward nearly nothing) so that drafting pays whatever this machine's timings."""
    eos, expected = eos_and_expected
    flat = Profile(target_forward=[TargetTiming(1, 1, 1.0), TargetTiming(1, 512, 1.0)],
                   draft_forward=[DraftTiming(1, 0.0001), DraftTiming(64, 0.0001)])
    policy = GoodputPolicy(GoodputSettings(loss_budget=None), cost_model=ProfileCostModel(flat))
    config = DynSpecConfig(num_speculative_tokens=6, policy="goodput")
    first = speculative(models, prompts, eos, dynspec_config=config, dynspec_policy=policy)
    pooled_after_first = policy.acceptance.pooled_successes + policy.acceptance.pooled_failures
    second = speculative(models, prompts, eos, dynspec_config=config, dynspec_policy=policy)
    assert torch.equal(first.sequences, expected) and torch.equal(second.sequences, expected)
    assert first.dynspec_stats.draft_tokens > 0 and second.dynspec_stats.draft_tokens > 0
    assert 0 < pooled_after_first < policy.acceptance.pooled_successes + policy.acceptance.pooled_failures
    assert policy.acceptance.successes.shape[0] == prompts[0].shape[0]  # per-row state was reset for the call
