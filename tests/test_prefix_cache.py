"""A KV cache that already holds a prompt prefix (transformers' prompt caching): the loop continues from it."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import left_padded_prompts, perturbed, tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.cache_utils import DynamicCache

import hf_dynspec
from hf_dynspec import DynSpecConfig
from hf_dynspec.cache import cache_kwarg

PROPOSERS = {
    "chain": (DynSpecConfig(policy="static", num_speculative_tokens=4), "draft"),
    "tree": (DynSpecConfig(policy="static", num_speculative_tokens=4, tree_node_budget=8), "draft"),
    "prefill verifies drafts": (DynSpecConfig(policy="static", prefill_draft_confidence=0.1), "draft"),
    "tree, prefill verifies drafts": (
        DynSpecConfig(policy="static", tree_node_budget=8, prefill_draft_confidence=0.1), "draft"
    ),
    "lookup": (DynSpecConfig(policy="static", num_speculative_tokens=4), "lookup"),
}
LENGTHS = [4, 9, 6, 11, 3]
"""Prompt lengths (left-padded to 11): a prefix of 5 columns is all padding for two rows and cuts into the others."""


def prefix_cache(model, ids: torch.LongTensor, mask: torch.LongTensor, cached: int) -> DynamicCache:
    """The KV cache of the prompts' first `cached` columns, computed as transformers' prompt caching does (positions
    count each row's real tokens)."""
    cache = DynamicCache(config=model.config)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        model(input_ids=ids[:, :cached], attention_mask=mask[:, :cached], position_ids=positions[:, :cached],
              **{cache_kwarg(model.forward): cache})
    return cache


@pytest.fixture(scope="module")
def llama_draft(llama):
    return perturbed(llama, scale=0.05)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def models(request):
    target = tiny_model(request.param, seed=0)
    ids, mask = left_padded_prompts(LENGTHS, seed=5)
    expected = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    return target, perturbed(target, scale=0.05), ids, mask, expected


@pytest.mark.parametrize("cached", [1, 5, 10])
@pytest.mark.parametrize("proposer", PROPOSERS)
def test_prefix_cache_matches_plain_greedy(models, proposer, cached):
    target, draft, ids, mask, expected = models
    config, kind = PROPOSERS[proposer]
    cache = prefix_cache(target, ids, mask, cached)
    plain = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=24,
                            **{cache_kwarg(target.forward): copy.deepcopy(cache)})
    assert torch.equal(plain, expected)  # plain decoding from the prefix is plain decoding
    source = dict(assistant_model=draft) if kind == "draft" else dict(prompt_lookup_num_tokens=3)
    out = hf_dynspec.generate(target, input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=24,
                              dynspec_config=config, return_dict_in_generate=True,
                              **{cache_kwarg(target.forward): cache}, **source)
    assert torch.equal(out.sequences, expected)
    assert out.dynspec_stats.accepted_tokens > 0


def test_prefix_cache_is_left_as_it_was(llama, llama_draft):
    ids, mask = left_padded_prompts(LENGTHS, seed=5)
    cache = prefix_cache(llama, ids, mask, 6)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    hf_dynspec.generate(llama, input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=16,
                        assistant_model=llama_draft, **{cache_kwarg(llama.forward): cache})
    assert cache.get_seq_length() == 6
    for layer, (keys, values) in zip(cache.layers, before):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)


def test_the_prefill_computes_only_what_is_not_cached(llama, llama_draft):
    """The target's first forward sees the prompt after the prefix, not the whole prompt."""
    ids, mask = left_padded_prompts(LENGTHS, seed=5)
    cache = prefix_cache(llama, ids, mask, 7)
    widths = []
    hook = llama.register_forward_pre_hook(lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]),
                                           with_kwargs=True)
    try:
        hf_dynspec.generate(llama, input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=4,
                            assistant_model=llama_draft, dynspec_config=DynSpecConfig(policy="static"),
                            **{cache_kwarg(llama.forward): cache})
    finally:
        hook.remove()
    assert widths[0] == ids.shape[1] - 7


@pytest.mark.parametrize("config", [DynSpecConfig(policy="static"), DynSpecConfig(policy="static", tree_node_budget=8)],
                         ids=["chain", "tree"])
def test_sampling_from_a_prefix_cache_draws_what_it_draws_without(llama, llama_draft, config):
    """Under one seed and a policy that does not follow time, the loop draws the same random numbers either way, so a
    prefix cache (whose KV equal the prefill's to float64 rounding) changes no sampled token."""
    ids, mask = left_padded_prompts(LENGTHS, seed=5)
    kwargs = dict(input_ids=ids, attention_mask=mask, do_sample=True, top_k=0, max_new_tokens=24,
                  assistant_model=llama_draft, dynspec_config=config)
    torch.manual_seed(3)
    whole = hf_dynspec.generate(llama, **kwargs)
    torch.manual_seed(3)
    cached = hf_dynspec.generate(llama, **kwargs, **{cache_kwarg(llama.forward): prefix_cache(llama, ids, mask, 8)})
    assert torch.equal(cached, whole)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(min_value=2, max_value=12), min_size=1, max_size=5),
    cut=st.floats(min_value=0.0, max_value=1.0),
    k=st.integers(min_value=0, max_value=6),
    nodes=st.sampled_from([0, 3, 10]),
    confidence=st.sampled_from([None, 0.1]),
    max_new_tokens=st.integers(min_value=1, max_value=20),
    seed=st.integers(min_value=0, max_value=10_000),
)
def test_property_random_prefixes_and_shapes(llama, llama_draft, lengths, cut, k, nodes, confidence, max_new_tokens, seed):
    """Prefixes anywhere from the first column to the last but one, ragged batches, chains and trees, with and without
    the prefill verifying drafts."""
    ids, mask = left_padded_prompts(lengths, seed=seed)
    cached = 1 + int(cut * (ids.shape[1] - 2))  # 1 .. width - 1
    expected = llama.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens)
    config = DynSpecConfig(policy="static", num_speculative_tokens=k, tree_node_budget=nodes,
                           prefill_draft_confidence=confidence)
    out = hf_dynspec.generate(llama, input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                              assistant_model=llama_draft, dynspec_config=config,
                              **{cache_kwarg(llama.forward): prefix_cache(llama, ids, mask, cached)})
    assert torch.equal(out, expected)

