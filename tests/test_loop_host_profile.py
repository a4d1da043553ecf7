"""`evaluation/probes/loop_host_profile.py`: operators by place on a small proxy, and pinned linear plans."""

from __future__ import annotations

import copy

import torch
from conftest import evaluation_script

from hf_dynspec import kernels
from hf_dynspec.evaluation.overhead import mirror_head, proxy_target


def test_operators_are_counted_per_place_and_per_function():
    probe = evaluation_script("loop_host_profile")
    target = proxy_target(layers=2, vocab=256)
    head, draft = mirror_head(target), copy.deepcopy(target)
    prompt = torch.randint(3, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    mode = probe.operators("head-static:4", target, head, draft, prompt, 10)
    assert mode.forwards["target"] >= 2 and mode.forwards["draft"] >= 4  # the head is accepted: 10 tokens, K = 4
    assert all(sum(mode.counts[place].values()) > 0 for place in ("target", "draft", "outside"))
    assert sum(mode.by_function.values()) == sum(mode.counts["outside"].values())
    assert any(name.startswith("loop.py:") for name in mode.by_function)
    plain = probe.operators("plain", target, head, draft, prompt, 4)
    assert plain.forwards["target"] == 4 and not plain.forwards["draft"]


def test_pinned_plans_are_saved_then_reused(tmp_path, monkeypatch):
    probe = evaluation_script("loop_host_profile")
    monkeypatch.setattr(kernels, "_MEASURED", {})
    monkeypatch.setattr(kernels, "_measure", lambda shape, dtype, copies, timer: kernels.LinearPlan(2))
    path = tmp_path / "plans.json"
    probe.pin_linear_plans(path)
    model = proxy_target(layers=1, vocab=64)
    assert kernels.linear_plan(model, "auto") == kernels.LinearPlan(2) and path.exists()
    monkeypatch.setattr(kernels, "_MEASURED", {})
    monkeypatch.setattr(kernels, "_measure", lambda shape, dtype, copies, timer: kernels.LinearPlan(8))
    probe.pin_linear_plans(path)  # the saved plan wins over a new measurement
    assert kernels.linear_plan(model, "auto") == kernels.LinearPlan(2)
