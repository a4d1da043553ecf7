"""The suffix proposer (suffix trees over prompts, sibling rows and earlier calls): greedy identity, exact sampling,
what it learns from, its bounds and its errors."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import left_padded_prompts, perturbed, tiny_model
from test_sampling import LOOP_NEW, VOCAB, assert_converges, exact_joint, small_vocab_pair, windows  # noqa: F401
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

import hf_dynspec
from hf_dynspec import DynSpecConfig
from hf_dynspec.candidates.free import ModelFreeProposer
from hf_dynspec.candidates.suffix import (
    SuffixCache,
    SuffixSettings,
    SuffixSource,
    chain_confidence,
    clear_suffix_caches,
    suffix_cache_for,
)
from hf_dynspec.sequences import TokenBatch


def grouped_prompts(lengths: list[int], group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts over a small alphabet, each repeated `group` times in adjacent rows (TRL's layout)."""
    ids, mask = left_padded_prompts(lengths, seed=seed)
    ids = torch.where(mask.bool(), ids % 7 + 3, ids)
    return ids.repeat_interleave(group, dim=0), mask.repeat_interleave(group, dim=0)


def suffix_generate(target, ids, mask, config: DynSpecConfig, max_new_tokens: int = 30, **kwargs):
    return hf_dynspec.generate(
        target, input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, dynspec_config=config,
        return_dict_in_generate=True, **kwargs,
    )


def linear_profile() -> dict:
    """A calibration profile whose verify forward costs 50 ms plus 10 ms per token: priced steps, no timing."""
    timings = [{"batch_size": b, "tokens_per_row": t, "seconds": 0.05 + 0.01 * b * t, "samples": 1}
               for b in (1, 2, 4, 8, 16) for t in (1, 2, 4, 8)]
    return {"format": "hf_dynspec.profile", "version": 1, "target_forward": timings, "draft_forward": []}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize(
    ("policy", "tree", "with_draft"),
    [("static", 0, False), ("goodput", 0, False), ("static", 6, False), ("goodput", 6, False),
     ("static", 0, True), ("goodput", 0, True)],
)
@pytest.mark.parametrize(("lengths", "group"), [([9], 1), ([6, 11], 3), ([5, 12, 8], 2)])
def test_suffix_matches_plain_greedy(family, policy, tree, with_draft, lengths, group):
    target = tiny_model(family, seed=0)
    ids, mask = grouped_prompts(lengths, group, seed=len(lengths) + group)
    expected = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=30)
    priced = {"cost_model": "profile", "profile": linear_profile()} if policy == "goodput" else {}  # not timed
    config = DynSpecConfig(num_speculative_tokens=4, proposer="suffix", policy=policy, policy_options=priced,
                           tree_node_budget=tree)
    draft = perturbed(target, scale=0.05) if with_draft else None
    for call in range(2):  # the second call proposes from the first call's outputs too
        out = suffix_generate(target, ids, mask, config, do_sample=False, assistant_model=draft)
        assert torch.equal(out.sequences, expected), f"call {call}"
    assert out.dynspec_stats.accepted_tokens > 0


def test_rows_learn_from_their_siblings_and_from_earlier_calls():
    target = tiny_model("llama", seed=1)
    ids, mask = grouped_prompts([10], group=4, seed=3)
    config = DynSpecConfig(num_speculative_tokens=8, proposer="suffix", policy="static")
    first = suffix_generate(target, ids[:1], mask[:1], config, do_sample=False)
    # Four greedy siblings write the same text: once a row has written a span, the others are proposed it.
    together = suffix_generate(target, ids, mask, config, do_sample=False)
    assert together.dynspec_stats.accepted_tokens > first.dynspec_stats.accepted_tokens
    # A later call finds the whole continuation in the cache: nearly every draft token is accepted.
    again = suffix_generate(target, ids[:1], mask[:1], config, do_sample=False)
    stats = again.dynspec_stats
    assert stats.accepted_tokens >= 0.9 * stats.draft_tokens > 0
    assert stats.num_steps <= 30 // 8 + 3
    assert torch.equal(again.sequences, first.sequences)


def test_a_cache_carries_across_calls_per_model_and_settings():
    target, other = tiny_model("llama", seed=1), tiny_model("llama", seed=2)
    settings = SuffixSettings(max_depth=16)
    assert suffix_cache_for(target, settings) is suffix_cache_for(target, settings)
    assert suffix_cache_for(target, settings) is not suffix_cache_for(other, settings)
    assert suffix_cache_for(target, settings) is not suffix_cache_for(target, SuffixSettings(max_depth=8))


def test_the_cache_is_bounded_by_outputs_and_by_tokens():
    cache = SuffixCache(SuffixSettings(max_outputs=3, max_tokens=50))
    for start in range(5):
        request = cache.start([1, 2, 3])
        cache.extend(request, list(range(100 + 10 * start, 110 + 10 * start)))
        cache.stop(request)
    assert cache.num_outputs == 3 and cache.num_tokens == 30  # the two oldest outputs are gone
    request = cache.start([9])
    cache.extend(request, list(range(40)))  # 70 tokens in all: the oldest outputs go until at most 50 remain
    assert cache.num_tokens <= 50 and cache.num_outputs == 2
    cache.stop(request)
    cache.clear()
    assert cache.num_outputs == 0 and cache.num_tokens == 0


def test_a_sibling_sees_an_output_while_it_is_written():
    cache = SuffixCache(SuffixSettings(min_token_probability=0.0))
    first, second = cache.start([5, 6, 7]), cache.start([5, 6, 7])
    cache.extend(first, [10, 11, 12, 13, 14, 15])
    cache.extend(second, [10, 11, 12])
    draft = cache.speculate(second, [5, 6, 7, 10, 11, 12], max_tokens=3, tree=False)
    assert draft.token_ids == [13, 14, 15] and draft.match_len >= 3
    cache.stop(first)
    cache.stop(second)


@pytest.mark.slow
@pytest.mark.parametrize("tree", [0, 4])
def test_suffix_samples_follow_target_distribution(small_vocab_pair, tree):  # noqa: F811
    """Siblings of one prompt sample together, and later draws (sample sizes) propose from earlier draws' outputs."""
    target, _ = small_vocab_pair
    prompt = torch.tensor([3, 4, 5, 3, 4, 5, 3, 4])
    temperature, top_k = 0.9, 5
    processors = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k)])
    with torch.no_grad():
        joint = exact_joint(target, prompt, processors, LOOP_NEW).reshape([VOCAB] * LOOP_NEW)
    laws = {"first": joint.sum(dim=(3, 4)).reshape(-1), "last": joint.sum(dim=(0, 1)).reshape(-1)}
    config = DynSpecConfig(num_speculative_tokens=3, proposer="suffix", policy="static", tree_node_budget=tree,
                           suffix_min_token_probability=0.0)
    samples: dict[int, torch.Tensor] = {}
    drafted: list[int] = []

    def draw(n: int) -> torch.Tensor:
        if n not in samples:
            ids = prompt.unsqueeze(0).expand(n, -1)
            out = suffix_generate(target, ids, torch.ones_like(ids), config, do_sample=True, temperature=temperature,
                                  top_k=top_k, top_p=None, max_new_tokens=LOOP_NEW)
            drafted.append(out.dynspec_stats.draft_tokens)
            generated = out.sequences[:, prompt.shape[0] :]
            samples[n] = (generated * torch.tensor([VOCAB**i for i in reversed(range(LOOP_NEW))])).sum(dim=1)
        return samples[n]

    torch.manual_seed(tree)
    for window, law in laws.items():
        assert_converges(lambda n, window=window: windows(draw(n))[window], law, sizes=(200, 2_000, 20_000))
    assert min(drafted) > 0


def priced_seconds(stats) -> float:
    """The steps of a call at `linear_profile`'s prices."""
    return sum(0.05 + 0.01 * step.target_tokens for step in stats.steps)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_cache_full_of_another_tasks_text_costs_at_most_a_few_percent(seed):
    """A cache holding 16 sampled outputs of other prompts proposes continuations for this task's rows that the
    target rejects: drafting every one costs over 5% more than the same call with an empty cache, at a verify curve's
    prices. The goodput policy, pricing them by that curve and learning their acceptance, stays within 3% of the loop
    without speculation."""
    target = tiny_model("llama", seed=0)
    ids, mask = grouped_prompts([9, 13, 7, 11], group=1, seed=seed)
    other, other_mask = left_padded_prompts([12] * 16, seed=100 + seed)
    plain = DynSpecConfig(num_speculative_tokens=0, proposer="suffix", collect_step_stats=True)
    reference = suffix_generate(target, ids, mask, plain, max_new_tokens=60, do_sample=False)
    costs = {}
    for policy, options in (("static", {}), ("goodput", {"cost_model": "profile", "profile": linear_profile()})):
        config = DynSpecConfig(num_speculative_tokens=4, proposer="suffix", policy=policy, policy_options=options,
                               collect_step_stats=True)
        for cache in ("empty", "foreign"):
            clear_suffix_caches(target)
            if cache == "foreign":
                torch.manual_seed(seed)
                suffix_generate(target, other, other_mask, config, max_new_tokens=100, do_sample=True)
                assert suffix_cache_for(target, SuffixSettings.from_config(config)).num_outputs == 16
            out = suffix_generate(target, ids, mask, config, max_new_tokens=60, do_sample=False)
            assert torch.equal(out.sequences, reference.sequences)
            costs[policy, cache] = priced_seconds(out.dynspec_stats)
    assert costs["static", "foreign"] > 1.05 * costs["static", "empty"], costs  # the other task's text proposes
    assert costs["goodput", "foreign"] <= 1.03 * priced_seconds(reference.dynspec_stats), costs


def test_suffix_settings_are_validated():
    with pytest.raises(ValueError, match="suffix_min_token_probability"):
        DynSpecConfig(suffix_min_token_probability=1.5)
    with pytest.raises(ValueError, match="suffix_cache_outputs"):
        DynSpecConfig(suffix_cache_outputs=0)


def test_suffix_refuses_prompt_lookup_and_trees_with_a_draft():
    target = tiny_model("llama", seed=0)
    ids, mask = grouped_prompts([6], 1, seed=0)
    with pytest.raises(ValueError, match="drop `prompt_lookup_num_tokens`"):
        suffix_generate(target, ids, mask, DynSpecConfig(proposer="suffix"), prompt_lookup_num_tokens=3)
    with pytest.raises(ValueError, match="proposes chains"):
        suffix_generate(target, ids, mask, DynSpecConfig(proposer="suffix", tree_node_budget=4),
                        assistant_model=perturbed(target, scale=0.05))


def test_an_enabled_model_speculates_from_suffixes_without_a_draft():
    target = tiny_model("llama", seed=0)
    ids, mask = grouped_prompts([6, 9], 2, seed=1)
    expected = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=20)
    hf_dynspec.enable(target, dynspec_config=DynSpecConfig(proposer="suffix", policy="static"))
    try:
        out = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=20,
                              return_dict_in_generate=True)
    finally:
        hf_dynspec.disable(target)
    assert torch.equal(out.sequences, expected)
    assert out.dynspec_stats.draft_tokens > 0  # the loop ran, and proposed


def test_without_arctic_inference_the_error_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "arctic_inference.suffix_decoding", None)
    with pytest.raises(ImportError, match=r"hf_dynspec\[suffix\]"):
        SuffixCache()


def test_anchors_need_the_steps_offer_first():
    proposer = ModelFreeProposer(SuffixSource(SuffixCache()))
    ids, _ = grouped_prompts([5], 1, seed=0)
    batch = TokenBatch(tokens=ids, prompt_width=ids.shape[1], num_prompt=torch.tensor([ids.shape[1]]),
                       num_generated=torch.zeros(1, dtype=torch.long), pad_id=0, max_new_tokens=8)
    with pytest.raises(RuntimeError, match="call that first"):
        proposer.free_anchors(batch)


def test_a_proposal_says_how_sure_it_is_from_what_followed_its_match_before():
    """Earlier outputs continued `11 12 13` with 14 three times and with 15 once: a row ending in `11 12 13` is
    proposed 14 (then what followed it) three quarters sure; a continuation seen one way only is sure."""
    cache = SuffixCache(SuffixSettings(min_token_probability=0.0, max_spec_factor=4.0))
    for ending in ([14, 16, 17], [14, 16, 17], [14, 16, 17], [15, 18, 19]):
        request = cache.start([])
        cache.extend(request, [11, 12, 13, *ending])
        cache.stop(request)
    proposer = ModelFreeProposer(SuffixSource(cache))
    ids = torch.tensor([[20, 11, 12, 13], [20, 21, 16, 17]])
    batch = TokenBatch(tokens=ids, prompt_width=4, num_prompt=torch.tensor([4, 4]),
                       num_generated=torch.zeros(2, dtype=torch.long), pad_id=0, max_new_tokens=8)
    proposer.start(batch)
    assert proposer.free_lengths(batch, 3).tolist() == [3, 0]
    assert proposer.free_confidence(batch).tolist() == pytest.approx([0.75 ** (1 / 3), 1.0])
    assert chain_confidence([1.0, 0.5, 0.25]) == pytest.approx(0.25 ** (1 / 3)) and chain_confidence([]) == 1.0
    proposer.release()
