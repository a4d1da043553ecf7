"""Folded grouped-query attention (`hf_dynspec.attention`): the same attention as transformers' SDPA function, for
every block shape the loop forwards, and the loop's forwards run it."""

from __future__ import annotations

import pytest
import torch
from conftest import evaluation_script, left_padded_prompts, perturbed, tiny_model
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import hf_dynspec
from hf_dynspec import DynSpecConfig
from hf_dynspec.attention import ATTENTION, MAX_FOLDED_QUERIES, folded_attention, folded_sdpa_attention


class _Layer(torch.nn.Module):
    """What attention functions read off their module."""

    def __init__(self, groups: int, training: bool = False) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True
        self.train(training)


def _block(batch: int, kv_heads: int, groups: int, width: int, length: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, kv_heads * groups, width, 8, generator=generator, dtype=torch.float64)
    key = torch.randn(batch, kv_heads, length, 8, generator=generator, dtype=torch.float64)
    value = torch.randn(batch, kv_heads, length, 8, generator=generator, dtype=torch.float64)
    return query, key, value


def _padded_mask(batch: int, width: int, length: int, seed: int) -> torch.Tensor:
    """A causal block mask over a cache with holes: `[batch, 1, width, length]` booleans."""
    generator = torch.Generator().manual_seed(seed)
    columns = torch.arange(length)
    causal = columns[None, :] <= columns[length - width :, None]  # [width, length]
    holes = torch.rand(batch, 1, 1, length, generator=generator) < 0.3
    holes[..., length - width :] = False  # the block's own tokens are real
    return (causal[None, None] & ~holes).expand(batch, 1, width, length)


@pytest.mark.parametrize("seed", range(24))
def test_folded_attention_matches_transformers_sdpa(seed):
    generator = torch.Generator().manual_seed(1000 + seed)
    batch, kv_heads, groups = (int(torch.randint(low, high, (1,), generator=generator)) for low, high in
                               ((1, 4), (1, 3), (1, 8)))
    width = int(torch.randint(1, 12, (1,), generator=generator)) if seed % 4 else MAX_FOLDED_QUERIES
    length = width + int(torch.randint(0, 40, (1,), generator=generator))
    query, key, value = _block(batch, kv_heads, groups, width, length, seed)
    kinds = {"boolean": _padded_mask(batch, width, length, seed)}
    kinds["additive"] = torch.zeros(kinds["boolean"].shape, dtype=query.dtype).masked_fill(~kinds["boolean"], -1e9)
    kinds["broadcast"] = kinds["boolean"][:1]
    kinds["none"] = None
    layer = _Layer(groups)
    for name, mask in kinds.items():
        if name == "none" and length != width:
            continue  # transformers builds a mask whenever the block follows a cache
        expected, _ = sdpa_attention_forward(layer, query, key, value, mask, scaling=0.3)
        folded, _ = folded_sdpa_attention(layer, query, key, value, mask, scaling=0.3)
        assert folded.shape == expected.shape == (batch, width, kv_heads * groups, 8)
        torch.testing.assert_close(folded, expected, rtol=1e-12, atol=1e-12, msg=f"{name} mask")


def test_folded_attention_leaves_what_it_does_not_fold_to_transformers(monkeypatch):
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[1].shape)
        return sdpa_attention_forward(*args, **kwargs)

    monkeypatch.setattr("hf_dynspec.attention.sdpa_attention_forward", counted)
    query, key, value = _block(2, 2, 3, MAX_FOLDED_QUERIES + 1, MAX_FOLDED_QUERIES + 1, seed=0)
    folded_sdpa_attention(_Layer(3), query, key, value, None)  # a long prefill
    narrow = _block(2, 2, 3, 3, 9, seed=1)
    folded_sdpa_attention(_Layer(3, training=True), *narrow, None, dropout=0.1)  # dropout in training mode
    folded_sdpa_attention(_Layer(3), *narrow, torch.ones(2, 6, 3, 9, dtype=torch.bool))  # a mask per head
    folded_sdpa_attention(_Layer(1), *_block(2, 6, 1, 3, 9, seed=2), None)  # no grouped heads
    assert len(calls) == 4
    folded_sdpa_attention(_Layer(3), *narrow, _padded_mask(2, 3, 9, seed=3))
    assert len(calls) == 4  # folded


def test_folded_attention_switches_sdpa_models_only():
    model = tiny_model("qwen2", seed=0)
    with folded_attention(model):
        assert model.config._attn_implementation == ATTENTION
    assert model.config._attn_implementation == "sdpa"
    with folded_attention(model, enabled=False):
        assert model.config._attn_implementation == "sdpa"
    model.set_attn_implementation("eager")
    with folded_attention(model):
        assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize("do_sample", [False, True])
def test_loop_forwards_run_folded_attention_and_match_unfolded(monkeypatch, do_sample):
    target = tiny_model("qwen2", seed=3)
    draft = perturbed(target, 0.3)
    ids, mask = left_padded_prompts([5, 9, 3, 12], seed=4)
    folded_calls = []

    def counted(module, query, *args, **kwargs):
        folded_calls.append(query.shape[2])
        return folded_sdpa_attention(module, query, *args, **kwargs)

    AttentionInterface.register(ATTENTION, counted)
    try:
        outputs = {}
        for fold in (True, False):
            torch.manual_seed(0)
            config = DynSpecConfig(policy="static", num_speculative_tokens=3, fold_attention=fold)
            outputs[fold] = hf_dynspec.generate(target, input_ids=ids, attention_mask=mask, assistant_model=draft,
                                                dynspec_config=config, max_new_tokens=20, do_sample=do_sample)
            if fold:
                widths = set(folded_calls)
                folded_calls.clear()
    finally:
        AttentionInterface.register(ATTENTION, folded_sdpa_attention)
    assert not folded_calls  # fold_attention=False: transformers' attention alone
    assert 1 in widths and max(widths) > 1  # draft steps, verify forwards and the prefill were folded
    assert torch.equal(outputs[True], outputs[False])
    assert target.config._attn_implementation == draft.config._attn_implementation == "sdpa"


def test_the_probe_times_each_way_and_leaves_the_cache_as_it_found_it():
    probe = evaluation_script("attention_fold")
    costs = probe.layer_attention(batch=2, length=12, width=3, repeats=1, dtype=torch.float32)
    assert set(costs) == {"copied", "shared", "folded"} and all(ms > 0 for ms in costs.values())
    model = tiny_model("qwen2", seed=0)
    assert all(probe.target_forward(model, batch=2, length=10, width=3, repeats=2, fold=fold) > 0
               for fold in (False, True))
    assert model.config._attn_implementation == "sdpa"
