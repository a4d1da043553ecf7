"""Models with sliding-window attention: whole caches in the loop, the window applied in its masks, by position."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
from conftest import BOS, EOS, PAD, VOCAB, left_padded_prompts, perturbed, tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.cache_utils import DynamicSlidingWindowLayer

import hf_dynspec
from hf_dynspec import DynSpecConfig
from hf_dynspec import cache as cache_module
from hf_dynspec.cache import SlidingWindows, sliding_windows
from hf_dynspec.candidates.tree import causal_visibility, windowed_attention_masks

WINDOW = 5
"""Far shorter than prompt and output together, so the window changes what plain decoding emits."""


SETTINGS = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS,
    initializer_range=0.3,
)


def windowed_model(family: str, window: int | None):
    """A tiny model whose every layer slides (`mistral`), or a hybrid one: `qwen2` slides in its second layer,
    `gemma2` in every other layer from the first (eager attention with soft-capping), `gemma3` in five of six.

    Gemma 2 runs in float32: in float64, transformers' eager attention turns its padding mask into `-inf` in a float32
    softmax, and plain `generate` itself returns NaN logits on left-padded rows."""
    span = window or 4096  # `None`: a window longer than every sequence here
    torch.manual_seed(0)
    if family == "mistral":
        model = MistralForCausalLM(MistralConfig(sliding_window=window, **SETTINGS))
    elif family == "qwen2":
        config = Qwen2Config(use_sliding_window=True, sliding_window=span, max_window_layers=1, **SETTINGS)
        model = Qwen2ForCausalLM(config)
    elif family == "gemma2":
        model = Gemma2ForCausalLM(Gemma2Config(sliding_window=span, head_dim=8, **SETTINGS))
    else:
        config = Gemma3TextConfig(sliding_window=span, head_dim=8, **{**SETTINGS, "num_hidden_layers": 6})
        model = Gemma3ForCausalLM(config)
    model = model.to(torch.float32 if family == "gemma2" else torch.float64).eval()
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = PAD, EOS
    return model


PROPOSERS = {
    "chain": (DynSpecConfig(policy="static", num_speculative_tokens=4), "draft"),
    "tree": (DynSpecConfig(policy="static", num_speculative_tokens=4, tree_node_budget=8), "draft"),
    "prefill verifies drafts": (DynSpecConfig(policy="static", prefill_draft_confidence=0.1), "draft"),
    "lookup": (DynSpecConfig(policy="static", num_speculative_tokens=4), "lookup"),
    "tree, compacting every step": (
        DynSpecConfig(policy="static", num_speculative_tokens=4, tree_node_budget=8, compact_min_holes=1,
                      compact_hole_fraction=0.05),
        "draft",
    ),
}


@pytest.fixture(scope="module", params=["mistral", "qwen2", "gemma2", "gemma3"])
def windowed(request):
    """A windowed target, a draft that slides the same way, left-padded prompts and plain greedy output."""
    target = windowed_model(request.param, WINDOW)
    ids, mask = left_padded_prompts([4, 9, 6, 11, 3], seed=11)
    expected = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    unwindowed = windowed_model(request.param, None).generate(
        input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=24
    )
    assert not torch.equal(expected, unwindowed), "the window changes nothing here: the tests would prove nothing"
    return target, perturbed(target, scale=0.05), ids, mask, expected


def test_windows_are_read_from_the_model():
    assert sliding_windows(windowed_model("mistral", WINDOW), "target model") == SlidingWindows(WINDOW, hybrid=False)
    assert sliding_windows(windowed_model("qwen2", WINDOW), "target model") == SlidingWindows(WINDOW, hybrid=True)
    assert sliding_windows(windowed_model("gemma3", WINDOW), "target model") == SlidingWindows(WINDOW, hybrid=True)
    assert sliding_windows(Qwen2ForCausalLM(Qwen2Config(**SETTINGS)), "target model") is None  # no sliding layer
    assert sliding_windows(tiny_model("llama"), "target model") is None


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_sliding_window_models_match_plain_greedy(windowed, proposer):
    target, draft, ids, mask, expected = windowed
    config, kind = PROPOSERS[proposer]
    source = dict(assistant_model=draft) if kind == "draft" else dict(prompt_lookup_num_tokens=3)
    out = hf_dynspec.generate(target, input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=24,
                              dynspec_config=config, return_dict_in_generate=True, **source)
    assert torch.equal(out.sequences, expected)
    assert out.dynspec_stats.accepted_tokens > 0
    if "compacting" in proposer:
        assert out.dynspec_stats.compactions > 0  # rows' tokens moved to other cache columns, positions kept


def test_full_attention_draft_beside_a_windowed_target(windowed):
    target, _, ids, mask, expected = windowed
    draft = tiny_model("llama", seed=0)  # another architecture, the same vocabulary
    out = hf_dynspec.generate(target, input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=24,
                              assistant_model=draft, dynspec_config=DynSpecConfig(policy="static"))
    assert torch.equal(out, expected)


def test_the_window_counts_positions_not_cache_columns():
    """A hole (a rejected entry) between two valid columns does not count toward the window."""
    cache_valid = torch.tensor([[0, 1, 0, 1, 1]])  # padding, position 0, a hole, positions 1 and 2
    positions = torch.tensor([[3]])  # one new token
    visibility = causal_visibility(5, torch.ones_like(positions))
    masks = windowed_attention_masks(cache_valid, visibility, positions, SlidingWindows(2, hybrid=True), torch.float32)
    seen = {kind: (mask[0, 0, 0] == 0).tolist() for kind, mask in masks.items()}
    assert seen["sliding_attention"] == [False, False, False, False, True, True]  # position 2 and itself
    assert seen["full_attention"] == [False, True, False, True, True, True]


def test_windows_that_differ_between_layers_are_refused(monkeypatch):
    layers = [DynamicSlidingWindowLayer(sliding_window=4), DynamicSlidingWindowLayer(sliding_window=8)]
    monkeypatch.setattr(cache_module, "DynamicCache", lambda config=None: SimpleNamespace(layers=layers))
    with pytest.raises(ValueError, match=r"different windows \(\[4, 8\]\).*as the target model[.]$"):
        sliding_windows(windowed_model("mistral", WINDOW), "target model")


def test_chunked_attention_is_refused():
    draft = tiny_model("llama", seed=0)
    draft.config.attention_chunk_size = 4
    ids, mask = left_padded_prompts([4, 6], seed=1)
    with pytest.raises(ValueError, match="chunked_attention.*full or sliding-window attention in every layer as the "
                                         "draft model[.]$"):
        hf_dynspec.generate(tiny_model("llama", seed=0), input_ids=ids, attention_mask=mask, assistant_model=draft,
                            max_new_tokens=4)


def test_sampling_sees_the_windowed_logits(windowed):
    """Sampled tokens come from the windowed target's logits: those returned before each token (`output_logits`)
    are the ones a forward of the whole sampled sequence gives, drafts accepted and rejected along the way."""
    target, draft, ids, mask, _ = windowed
    torch.manual_seed(0)
    out = hf_dynspec.generate(
        target, input_ids=ids, attention_mask=mask, assistant_model=draft, do_sample=True, max_new_tokens=16,
        eos_token_id=None, return_dict_in_generate=True, output_logits=True,
        dynspec_config=DynSpecConfig(policy="static", num_speculative_tokens=4, tree_node_budget=6),
    )
    assert 0 < out.dynspec_stats.accepted_tokens < out.dynspec_stats.draft_tokens
    full_mask = torch.cat([mask, torch.ones_like(out.sequences[:, ids.shape[1] :])], dim=1)
    with torch.no_grad():
        logits = target(out.sequences, attention_mask=full_mask, position_ids=(full_mask.cumsum(-1) - 1).clamp(min=0))
    expected = logits.logits[:, ids.shape[1] - 1 : -1].float()  # [rows, new, vocab] before each new token
    tolerance = 1e-5 if target.dtype == torch.float64 else 1e-4  # float32: wider forwards round differently
    torch.testing.assert_close(torch.stack(out.logits, dim=1), expected, rtol=tolerance, atol=tolerance)


@functools.cache
def _pair(window: int):
    target = windowed_model("qwen2", window)
    return target, perturbed(target, scale=0.05, seed=5)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    window=st.integers(min_value=2, max_value=8),
    lengths=st.lists(st.integers(min_value=1, max_value=12), min_size=1, max_size=5),
    k=st.integers(min_value=0, max_value=6),
    nodes=st.sampled_from([0, 3, 10]),
    max_new_tokens=st.integers(min_value=1, max_value=20),
    seed=st.integers(min_value=0, max_value=10_000),
)
def test_property_random_windows_and_shapes(window, lengths, k, nodes, max_new_tokens, seed):
    """Windows down to two tokens, chains and trees, ragged batches. (At a window of one token, transformers' sliding
    cache layer keeps every entry, as its slice `[-window + 1:]` is `[0:]`, so plain `generate` is no reference.)"""
    target, draft = _pair(window)
    ids, mask = left_padded_prompts(lengths, seed=seed)
    expected = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens)
    config = DynSpecConfig(policy="static", num_speculative_tokens=k, tree_node_budget=nodes)
    out = hf_dynspec.generate(target, input_ids=ids, attention_mask=mask, do_sample=False,
                              max_new_tokens=max_new_tokens, assistant_model=draft, dynspec_config=config)
    assert torch.equal(out, expected)
