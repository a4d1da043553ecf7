"""The KV cache's keyword: `cache` from transformers 5.24 on, `past_key_values` before; the loop handles both."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from transformers.cache_utils import DynamicCache

from hf_dynspec.cache import cache_kwarg, generation_cache


def test_cache_kwarg_follows_the_signature():
    def new(input_ids=None, cache=None, **kwargs): ...

    def old(input_ids=None, past_key_values=None, **kwargs): ...

    assert cache_kwarg(new) == "cache"
    assert cache_kwarg(old) == "past_key_values"


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_installed_models_fill_the_cache_given_by_that_keyword(family):
    model = tiny_model(family, seed=0)
    cache = DynamicCache(config=model.config)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error", FutureWarning)  # a deprecated keyword would warn
        model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True, **{cache_kwarg(model.forward): cache})
    assert cache.get_seq_length() == 3


def test_generation_cache_prefers_the_new_key():
    new, old = DynamicCache(), DynamicCache()
    assert generation_cache({"cache": new, "past_key_values": old}) is new
    assert generation_cache({"past_key_values": old}) is old
    assert generation_cache({}) is None


def test_the_oldest_transformers_tested_is_the_floor_pyproject_declares():
    root = Path(__file__).resolve().parents[1]
    floor = re.search(r'"transformers>=([\d.]+),<\d+"', (root / "pyproject.toml").read_text()).group(1)
    oldest = re.search(r"^TRANSFORMERS_OLDEST \?= ([\d.]+)$", (root / "Makefile").read_text(), re.M).group(1)
    assert oldest.split(".")[:2] == floor.split(".")[:2], (floor, oldest)
