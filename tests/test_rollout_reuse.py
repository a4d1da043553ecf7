"""The rollout cache: later calls reuse earlier samples of the same streams, exactly, and nothing else."""

from __future__ import annotations

import pytest
import torch
from conftest import left_padded_prompts, perturbed, tiny_model

import hf_dynspec
from hf_dynspec import DynSpecConfig
from hf_dynspec.candidates.rollout import RolloutCache, RolloutSettings, rollout_cache_for
from hf_dynspec.coupling import stream_keys

NEW = 24


def _call(model, ids, mask, config: dict | None = None, **kwargs):
    settings = dict(do_sample=True, temperature=1.0, top_k=None, top_p=None, max_new_tokens=NEW,
                    return_dict_in_generate=True)
    settings.update(kwargs)
    # a static policy: the tests are about what reuse proposes and emits, not whether the timings say it pays
    config = DynSpecConfig(**{"sampling": "coupled", "seed": 5, "reuse_rollouts": True, "policy": "static",
                              **(config or {})})
    return hf_dynspec.generate(model, input_ids=ids, attention_mask=mask, dynspec_config=config, **settings)


def _plain(model, ids, mask, **kwargs) -> torch.Tensor:
    """The loop without speculation or reuse, coupled with the same seed."""
    return _call(model, ids, mask, {"reuse_rollouts": False, "num_speculative_tokens": 0},
                 prompt_lookup_num_tokens=1, **kwargs).sequences


@pytest.fixture()
def target():
    return tiny_model("llama", seed=0, dtype=torch.float32, initializer_range=0.15)


@pytest.fixture(scope="module")
def group():
    """Two prompts, three samples each (GRPO's layout)."""
    ids, mask = left_padded_prompts([6, 4], seed=3)
    return ids.repeat_interleave(3, dim=0), mask.repeat_interleave(3, dim=0)


def test_a_second_epoch_reuses_the_first_exactly(target, group):
    first = _call(target, *group)
    second = _call(target, *group)
    assert torch.equal(first.sequences, _plain(target, *group))
    assert torch.equal(second.sequences, first.sequences)
    assert first.dynspec_stats.rollout_rows == 0 and first.dynspec_stats.reused_tokens == 0
    assert second.dynspec_stats.rollout_rows == 6
    # 4 draft tokens a step (static:4), all taken, and the target's own: 4 of every 5 tokens after the first
    assert second.dynspec_stats.reused_tokens > 0.7 * (second.dynspec_stats.emitted_tokens - 6)
    assert second.dynspec_stats.target_forwards < first.dynspec_stats.target_forwards / 3


def test_reuse_beside_the_draft_model(target, group):
    draft = perturbed(target, scale=0.2)
    first = _call(target, *group, assistant_model=draft)
    second = _call(target, *group, assistant_model=draft)
    assert torch.equal(first.sequences, _plain(target, *group))
    assert torch.equal(second.sequences, first.sequences)
    assert second.dynspec_stats.reused_tokens > 0


def test_after_an_update_the_new_policys_samples_reuse_what_agrees(target, group):
    """Sampled again after a small change of the weights, rows repeat their earlier samples where the new policy
    agrees (reused tokens) and follow the new policy everywhere (the loop without speculation's tokens)."""
    first = _call(target, *group)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(1)
        for parameter in target.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.02 * parameter.std())
    second = _call(target, *group)
    assert torch.equal(second.sequences, _plain(target, *group))
    assert not torch.equal(second.sequences, first.sequences)  # the policy moved
    assert second.dynspec_stats.reused_tokens > 0


def test_a_stale_cache_is_never_accepted_wrongly(target, group):
    """Responses of another model, or other tokens entirely, stored under this call's streams: the output is still
    the target's own samples."""
    other = tiny_model("llama", seed=7, dtype=torch.float32, initializer_range=0.15)
    stale = _call(other, *group).sequences[:, group[0].shape[1] :]
    cache = rollout_cache_for(target, RolloutSettings.from_config(DynSpecConfig()))
    prompts = [row[keep.bool()].tolist() for row, keep in zip(*group)]
    for stream, response in zip(stream_keys(prompts, seed=5).tolist(), stale):
        cache.store(stream, response)
    out = _call(target, *group)
    assert torch.equal(out.sequences, _plain(target, *group))
    cache.store(stream_keys(prompts, seed=5)[0].item(), torch.arange(3, 3 + NEW))  # tokens of no model
    assert torch.equal(_call(target, *group, assistant_model=perturbed(target, 0.2)).sequences[:1],
                       out.sequences[:1])


def test_greedy_calls_reuse_earlier_greedy_answers(target, group):
    greedy = target.generate(input_ids=group[0], attention_mask=group[1], do_sample=False, max_new_tokens=NEW)
    first = _call(target, *group, do_sample=False)
    second = _call(target, *group, do_sample=False)
    assert torch.equal(first.sequences, greedy) and torch.equal(second.sequences, greedy)
    assert second.dynspec_stats.reused_tokens > 0


def test_clear_rollouts_empties_the_cache(target, group):
    _call(target, *group)
    hf_dynspec.clear_rollouts(target)
    out = _call(target, *group)
    assert out.dynspec_stats.rollout_rows == 0 and out.dynspec_stats.reused_tokens == 0


def test_an_enabled_model_reuses_across_calls_without_naming_a_proposer(target, group):
    bound = DynSpecConfig(sampling="coupled", seed=5, reuse_rollouts=True, policy="static")
    hf_dynspec.enable(target, dynspec_config=bound)
    try:
        runs = [target.generate(input_ids=group[0], attention_mask=group[1], do_sample=True, max_new_tokens=NEW,
                                top_k=None, return_dict_in_generate=True) for _ in range(2)]
    finally:
        hf_dynspec.disable(target)
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert runs[1].dynspec_stats.reused_tokens > 0


def test_the_cache_keeps_its_bounds():
    cache = RolloutCache(RolloutSettings(max_samples=3, max_tokens=10))
    for stream in range(4):
        cache.store(stream, torch.arange(2))
    assert cache.num_samples == 3 and cache.get(0) is None and cache.get(3) is not None
    cache.store(1, torch.arange(8))  # replaces stream 1's response and makes it the newest
    assert cache.num_tokens <= 10 and cache.get(1).shape[0] == 8 and cache.get(2) is None
    cache.clear()
    assert cache.num_samples == 0 and cache.num_tokens == 0


@pytest.mark.parametrize(
    ("config", "kwargs", "message"),
    [
        ({"tree_node_budget": 4}, {}, "tree_node_budget=0"),
        ({"proposer": "hybrid"}, {"assistant_model": "draft"}, "proposer='auto'"),
        ({}, {"prompt_lookup_num_tokens": 3}, "drop `prompt_lookup_num_tokens`"),
    ],
)
def test_what_reuse_cannot_combine_with_is_refused(target, group, config, kwargs, message):
    if kwargs.get("assistant_model") == "draft":
        kwargs = {**kwargs, "assistant_model": perturbed(target, 0.2)}
    with pytest.raises(ValueError, match=message):
        _call(target, *group, config, **kwargs)


def test_reuse_needs_coupled_sampling():
    with pytest.raises(ValueError, match="sampling='coupled'"):
        DynSpecConfig(reuse_rollouts=True)


def test_an_unknown_keying_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"`coupling_keys` must be one of \[.context., .position.\], got .hash."):
        DynSpecConfig(sampling="coupled", coupling_keys="hash")


def test_an_epoch_of_any_number_of_prompts_is_kept_whole_and_the_oldest_epoch_goes_first():
    """A bound on the count dropped an epoch's first samples before the next epoch reached them (then that epoch,
    visiting in the same order, found none); bounded by tokens, an epoch of 600 prompts x 8 samples is kept whole."""
    cache = RolloutCache(RolloutSettings(max_tokens=3 * 4800))
    for epoch in range(2):
        for stream in range(4800):
            if epoch:
                assert cache.get(stream) is not None, stream  # the previous epoch's sample is still there
            cache.store(stream, torch.full((3,), epoch))
    assert cache.num_samples == 4800 and cache.get(0).dtype == torch.long and int(cache.get(0)[0]) == 1
    cache.store(10_000, torch.arange(6))  # a new stream over the bound: the oldest samples go
    assert cache.get(0) is None and cache.get(1) is None and cache.get(2) is not None and cache.get(10_000) is not None
