"""The in-memory replay of the offload scenario (`evaluation/probes/offload_replay.py`): how it prices target forwards and
which methods it gives the offload profile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import evaluation_script, tiny_model


@pytest.fixture(scope="module")
def replay():
    return evaluation_script("offload_replay")


def profile(path: Path, seconds: dict[int, float]) -> Path:
    rows = [{"batch_size": 1, "tokens_per_row": n, "seconds": s} for n, s in seconds.items()]
    rows.append({"batch_size": 4, "tokens_per_row": 2, "seconds": 9.0})  # other batch sizes are ignored
    path.write_text(json.dumps({"target_forward": rows, "draft_forward": [{"batch_size": 1, "seconds": 0.05}]}))
    return path


def test_read_seconds_is_the_median_gap_above_one_token(replay, tmp_path):
    offloaded = replay.batch1_forwards(profile(tmp_path / "o.json", {1: 0.9, 2: 0.40, 3: 0.41, 5: 0.45}))
    in_memory = replay.batch1_forwards(profile(tmp_path / "m.json", {1: 0.1, 2: 0.15, 3: 0.14, 5: 0.15, 9: 0.2}))
    assert replay.read_seconds(offloaded, in_memory) == pytest.approx(0.27)  # gaps 0.25, 0.27, 0.30; 1 token left out
    with pytest.raises(ValueError, match="share no batch-1 token count"):
        replay.read_seconds({1: 0.5, 4: 0.5}, {1: 0.1, 2: 0.1})


def test_target_forwards_are_priced_by_width(replay):
    model = tiny_model("qwen2", seed=0).eval()
    offloaded = {1: 9.0, 2: 0.40, 3: 0.42, 5: 0.46, 9: 0.50}
    pricer = replay.OffloadPricer(model, offloaded, read=0.3)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 50, (1, 4)))  # between 3 and 5 tokens: interpolated
        model(input_ids=torch.randint(0, 50, (1, 1)))  # one token: priced as two (the profile's first ran cold)
        priced, change = pricer.take()
        assert priced == pytest.approx(0.44 + 0.40)
        model(input_ids=torch.randint(0, 50, (1, 12)))  # longer than the profile: a prefill
    priced, change = pricer.take()
    assert len(pricer.prefills) == 1 and priced == pytest.approx(pricer.prefills[0] + 0.3)
    assert change == pytest.approx(0.3)
    pricer.remove()
    with torch.no_grad():
        model(input_ids=torch.randint(0, 50, (1, 2)))
    assert pricer.take() == (0.0, 0.0)  # hooks removed


def test_goodput_methods_get_the_offload_profile(replay, tmp_path):
    names = ["hf-assisted", "dynspec-static:4", "dynspec-goodput@m:16", "dynspec-tree@x:32:24/4bit", "dynspec-tree"]
    options = replay.with_profile({"tree@x": {"early_stop": "marginal"}, "tree": {"cost_model": "online"}}, names,
                                  tmp_path / "p.json")
    assert options["goodput@m"] == {"cost_model": "profile", "profile": str(tmp_path / "p.json")}
    assert options["tree@x"] == {"early_stop": "marginal", "cost_model": "profile", "profile": str(tmp_path / "p.json")}
    assert options["tree"] == {"cost_model": "online"}  # a method that names its cost model keeps it
    assert "static" not in options and "hf-assisted" not in options
