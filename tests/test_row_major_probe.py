"""`evaluation/probes/row_major_probe.py`: it times stock and row-major forwards of the same inputs and compares their logits."""

from __future__ import annotations

import pytest
import torch
from conftest import evaluation_script, tiny_model


@pytest.fixture(scope="module")
def probe_module():
    return evaluation_script("row_major_probe")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_probe_times_both_ways_and_finds_equal_logits(probe_module, dtype):
    model = tiny_model("qwen2", dtype=dtype).requires_grad_(False)  # as accelerate leaves offloaded weights
    ids = torch.randint(4, 60, (1, 12), generator=torch.Generator().manual_seed(0))
    rows = probe_module.probe(model, {"one token": ids[:, -1:], "prompt": ids}, repeats=2)
    assert [(r["forward"], r["tokens"]) for r in rows] == [("one token", 1), ("prompt", 12)]
    for row in rows:
        assert len(row["stock_repeats"]) == len(row["row_major_repeats"]) == 2
        assert row["stock_seconds"] > 0 and row["row_major_seconds"] > 0
        assert row["max_abs_logit_diff"] == 0.0


def test_a_forward_keeps_the_last_logits_only(probe_module):
    model = tiny_model("qwen2", dtype=torch.float32).requires_grad_(False)
    ids = torch.randint(4, 60, (1, 7), generator=torch.Generator().manual_seed(1))
    _, logits = probe_module._forward(model, ids, row_major=True)
    with torch.inference_mode():
        full = model(input_ids=ids, use_cache=False).logits
    assert logits.shape == (1, 1, full.shape[-1])
    torch.testing.assert_close(logits, full[:, -1:])
