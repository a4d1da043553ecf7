"""`evaluation/rollout_headroom.py`: a hindsight bound on what suffix trees add to a rollout."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
from conftest import evaluation_script, tiny_model

from hf_dynspec.candidates.suffix import SuffixSettings

PRICES = {1: 1.0, 2: 1.2, 4: 1.5, 8: 2.0}  # seconds of a one-token forward by active rows


@pytest.fixture(scope="module")
def headroom():
    return evaluation_script("rollout_headroom")


def test_rows_that_share_nothing_gain_nothing(headroom):
    prompts = [[1, 2, 3]] * 3
    rows = [list(range(100 + 30 * i, 100 + 30 * i + n)) for i, n in enumerate([20, 12, 7])]  # no token twice
    result = headroom.bound(prompts, rows, [], PRICES, SuffixSettings(), max_tokens=24)
    for kind in ("hindsight", "replayed"):
        assert result[kind]["forwards"] == [19, 11, 6]  # a forward per token after the prefill's
        assert result[kind]["speedup_over_nospec"] == pytest.approx(1.0)


def test_siblings_and_the_epoch_before_are_copied(headroom):
    prompts = [[1, 2, 3]] * 3
    shared = list(range(10, 40))
    rows = [shared, [5, *shared[:20]], list(range(200, 215))]  # the second row writes what the first did
    first = headroom.bound(prompts, rows, [], PRICES, SuffixSettings(), max_tokens=24)
    assert first["hindsight"]["forwards"][1] < 20 and first["hindsight"]["forwards"][2] == 14
    assert first["hindsight"]["speedup_over_nospec"] > 1.0
    second = headroom.bound(prompts, rows, [list(range(200, 215))], PRICES, SuffixSettings(), max_tokens=24)
    for kind in ("hindsight", "replayed"):  # the third row wrote what the epoch before did
        assert second[kind]["forwards"][2] < 14
        assert second[kind]["speedup_over_nospec"] > first[kind]["speedup_over_nospec"]


@pytest.mark.parametrize("seed", range(8))
def test_the_trees_replayed_never_beat_the_hindsight_bound(headroom, seed):
    rng = random.Random(seed)
    prompts = [[rng.randrange(5) for _ in range(rng.randrange(1, 6))] for _ in range(2) for _ in range(3)]
    rows = [[rng.randrange(5) for _ in range(rng.randrange(1, 30))] for _ in prompts]  # 5 tokens: many matches
    earlier = [[rng.randrange(5) for _ in range(20)] for _ in range(rng.randrange(0, 3))]
    result = headroom.bound(prompts, rows, earlier, PRICES, SuffixSettings(max_depth=6), max_tokens=8)
    hindsight, replayed = result["hindsight"]["forwards"], result["replayed"]["forwards"]
    assert all(r >= h for r, h in zip(replayed, hindsight)), (replayed, hindsight)
    assert sum(replayed) < sum(len(row) - 1 for row in rows)  # the trees did propose right tokens


def test_sampled_rows_end_at_their_eos(headroom):
    target = tiny_model("llama", seed=0)
    eos = target.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    settings = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=12)
    rows = headroom.sample_rollout(target, [[5, 9, 13], [5, 9, 13], [3, 8]], settings, seed=0)
    assert len(rows) == 3 and all(1 <= len(row) <= 12 for row in rows)
    assert all(token not in eos for row in rows for token in row[:-1])  # nothing after a row's EOS
    assert rows != headroom.sample_rollout(target, [[5, 9, 13], [5, 9, 13], [3, 8]], settings, seed=1)


def test_prices_come_from_the_loop_s_own_forwards_or_a_profile(headroom, tmp_path):
    calls = [[[0.0, 3], [0.5, 3], [0.8, 2], [1.0, 1], [1.1, 0]]]  # (seconds since the call's start, active rows)
    results = tmp_path / "rollout.json"
    results.write_text(json.dumps({"timelines": [{"method": "dynspec-nospec", "batch_size": 3, "calls": calls}]}))
    assert headroom.one_token_prices(str(results)) == pytest.approx({3: 0.3, 2: 0.2, 1: 0.1})
    profile = tmp_path / "profile.json"
    timings = [{"batch_size": b, "tokens_per_row": t, "seconds": 0.1 * b + t, "samples": []} for b in (1, 4) for t in (1, 2)]
    profile.write_text(json.dumps({"format": "hf_dynspec.profile", "version": 1, "target_forward": timings,
                                   "draft_forward": []}))
    assert headroom.one_token_prices(str(profile)) == pytest.approx({1: 1.1, 4: 1.4})
    wide = [{"batch_size": 1, "tokens_per_row": 2, "seconds": 1.0, "samples": []}]
    profile.write_text(json.dumps({"format": "hf_dynspec.profile", "version": 1, "target_forward": wide,
                                   "draft_forward": []}))
    with pytest.raises(ValueError, match="no one-token target forwards"):
        headroom.one_token_prices(str(profile))
    (tmp_path / "other.json").write_text(json.dumps({"runs": []}))
    with pytest.raises(ValueError, match="neither a calibration profile"):
        headroom.one_token_prices(str(tmp_path / "other.json"))
