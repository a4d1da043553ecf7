"""`evaluation/probes/verify_curve.py`: a target's verify widths past one token per row, and its prefill."""

from __future__ import annotations

import functools

import pytest
from conftest import evaluation_script, tiny_model
from transformers import DynamicCache


@pytest.fixture(scope="module")
def curve():
    return evaluation_script("verify_curve")


def test_measure_times_every_width_over_the_same_cache(curve, monkeypatch):
    model = tiny_model("llama", seed=0)
    lengths = []
    forward = model.forward

    @functools.wraps(forward)  # keeps the signature that names the cache keyword
    def recording(*args, **kwargs):  # the cache length every forward starts from
        cache = next(value for value in kwargs.values() if isinstance(value, DynamicCache))
        lengths.append(cache.get_seq_length())
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", recording)
    result = curve.measure(model, batch=3, widths=[1, 4], context=10, repeats=2)
    assert result["prefill"][0] == 30 and result["prefill"][1] > 0
    assert sorted(result["verify"]) == [3, 12] and all(seconds > 0 for seconds in result["verify"].values())
    assert lengths == [0] + [10] * 6  # the prefill, then 3 forwards per width, each on the 10-token cache

