"""`evaluation/draft_costs.py`: what one forward costs, and whether it is bound by its matrix products."""

from __future__ import annotations

import argparse

import pytest
import torch
from conftest import evaluation_script, tiny_model


@pytest.fixture(scope="module")
def costs():
    return evaluation_script("draft_costs")


def test_weight_bytes_count_the_linear_layers_and_not_the_embedding(costs):
    model = tiny_model("llama", seed=0)
    linear = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert costs.linear_weight_bytes(model.to(torch.float32)) == sum(4 * m.weight.numel() for m in linear)
    assert costs.linear_weight_bytes(model.to(torch.bfloat16)) == sum(2 * m.weight.numel() for m in linear)


def test_product_share_is_a_share_that_a_big_product_dominates(costs):
    model = tiny_model("llama", seed=0)
    share = costs.product_share(model, tokens=1, context=8, repeats=2)
    assert 0.0 < share < 0.5  # a tiny model's forward is mostly small operators
    # An output layer of 2 000 000 rows: one product outweighs all the rest, by far enough that the share stays above
    # 0.7 while other processes load the cores (at 400 000 rows it fell to 0.49 under two busy loops).
    head = model.lm_head
    model.lm_head = torch.nn.Linear(head.in_features, 2_000_000, bias=False, dtype=head.weight.dtype)
    assert costs.product_share(model, tokens=1, context=8, repeats=2) > 0.7


def test_measure_reports_eager_and_compiled_rows(costs, monkeypatch):
    model = tiny_model("llama", seed=0)
    model.hf_dynspec_load = {"dtype": "float32"}
    compiled = []
    monkeypatch.setattr(costs.torch, "compile", lambda m, dynamic: compiled.append(dynamic) or m)  # no inductor build
    args = argparse.Namespace(context_length=8, repeats=1, seed=0, compile=True)
    eager, timed = costs.measure(model, "tiny", 2, args)
    assert compiled == [True]
    assert (eager["compiled"], timed["compiled"]) == (False, True)
    assert eager["seconds"] > 0 and eager["linear_weight_gb_per_s"] > 0 and 0 < eager["product_share"] < 1
    assert timed["seconds"] > 0 and timed["compile_seconds"] >= 0
    assert costs.measure(model, "tiny", 2, argparse.Namespace(**{**vars(args), "compile": False}))[0]["compiled"] is False
