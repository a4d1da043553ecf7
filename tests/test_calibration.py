"""Calibration: timing tiny models, the profile it writes, the vLLM table derived from it, and the command line."""

from __future__ import annotations

import json

import pytest
import torch

from hf_dynspec import DynSpecConfig
from hf_dynspec.calibration import (
    CalibrationSettings,
    _CachedForward,
    calibrate,
    parse_int_list,
    uniform_draft_length,
    vllm_speculative_config,
)
from hf_dynspec.cli import main
from hf_dynspec.clocks import time_call
from hf_dynspec.cost_models import DraftTiming, Profile, ProfileCostModel, TargetTiming
from hf_dynspec.evaluation.tiny import tiny_pair
from hf_dynspec.policies import BatchTablePolicy, PolicyInput, build_policy

FAST = dict(batch_sizes=[1, 2], tokens_per_row=[1, 3], context_length=8, warmup=1, repeats=2)


def linear_profile() -> Profile:
    """Target: 0.2 s + 10 ms per token; draft: 50 ms + 5 ms per row."""
    sizes, tokens = [1, 2, 4, 8, 16, 32], [1, 2, 3, 5, 9]
    return Profile(
        target_forward=[TargetTiming(b, t, 0.2 + 0.01 * b * t) for b in sizes for t in tokens],
        draft_forward=[DraftTiming(b, 0.05 + 0.005 * b) for b in sizes],
        draft="my-draft",
    )


def test_time_call_runs_warmup_then_timed_repeats() -> None:
    calls = []
    samples = time_call(lambda: calls.append(1), warmup=2, repeats=3)
    assert len(calls) == 5 and len(samples) == 3 and all(s >= 0 for s in samples)


def test_cached_forward_keeps_the_context_length() -> None:
    target, _ = tiny_pair(seed=0)
    forward = _CachedForward(target, batch_size=2, context_length=6, generator=torch.Generator().manual_seed(0))
    assert forward.cache.get_seq_length() == 6
    forward(3, keep=3)
    forward(1, keep=1)
    assert forward.cache.get_seq_length() == 6


def test_calibrate_times_every_point_of_tiny_models() -> None:
    target, draft = tiny_pair(seed=0)
    profile = calibrate(target, draft, CalibrationSettings(**FAST), "t", "d", progress=False)
    assert [(t.batch_size, t.tokens_per_row) for t in profile.target_forward] == [(1, 1), (1, 3), (2, 1), (2, 3)]
    assert [t.batch_size for t in profile.draft_forward] == [1, 2]
    for timing in [*profile.target_forward, *profile.draft_forward]:
        assert len(timing.samples) == 2 and timing.seconds > 0
        assert min(timing.samples) <= timing.seconds <= max(timing.samples)
    assert (profile.target, profile.draft, profile.context_length, profile.dtype) == ("t", "d", 8, "float32")
    assert Profile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile


def test_calibrate_times_forwards_with_the_loops_kernel_and_records_it(monkeypatch) -> None:
    from hf_dynspec import kernels

    routed: list[int] = []
    original = kernels.weight_first_linear
    monkeypatch.setattr(kernels, "weight_first_linear", lambda x, w, b=None: routed.append(1) or original(x, w, b))
    target, draft = tiny_pair(seed=0)
    profile = calibrate(target, draft, CalibrationSettings(**FAST, narrow_linear="on"), progress=False)
    assert routed and profile.narrow_rows == {"target": 64, "draft": 64}
    assert Profile.from_dict(json.loads(json.dumps(profile.to_dict()))).narrow_rows == profile.narrow_rows
    routed.clear()
    off = calibrate(target, draft, CalibrationSettings(**FAST, narrow_linear="off"), progress=False)
    assert not routed and off.narrow_rows == {"target": 0, "draft": 0}
    with pytest.raises(ValueError, match="narrow_linear"):
        CalibrationSettings(narrow_linear="fast")


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"tokens_per_row": [2, 3]}, "`tokens_per_row` must include 1"),
        ({"batch_sizes": [4, 2]}, "`batch_sizes` must be strictly increasing"),
        ({"batch_sizes": [0, 2]}, "`batch_sizes` must hold integers >= 1"),
        ({"batch_sizes": []}, "`batch_sizes` must be a non-empty list"),
        ({"repeats": 0}, "`repeats` must be an integer >= 1"),
        ({"context_length": 0}, "`context_length` must be an integer >= 1"),
    ],
)
def test_calibration_settings_reject_bad_values(settings, message) -> None:
    with pytest.raises(ValueError, match=message):
        CalibrationSettings(**settings)


def test_parse_int_list() -> None:
    assert parse_int_list("1, 2,4", "--batch-sizes") == [1, 2, 4]
    with pytest.raises(ValueError, match="--batch-sizes must be comma-separated integers"):
        parse_int_list("1,two", "--batch-sizes")
    with pytest.raises(ValueError, match="--batch-sizes must list at least one integer"):
        parse_int_list(",", "--batch-sizes")


# ---- the vLLM table ------------------------------------------------------------------------------------------------
def test_vllm_table_covers_every_batch_size_and_matches_goodput() -> None:
    profile = linear_profile()
    config = vllm_speculative_config(profile, acceptance=0.8, num_speculative_tokens=6, max_batch_size=128)
    assert config["method"] == "draft_model" and config["model"] == "my-draft"
    assert config["num_speculative_tokens"] == 6
    table = config["num_speculative_tokens_per_batch_size"]
    assert table[0][0] == 1 and table[-1][1] == 128
    assert all(a[1] + 1 == b[0] for a, b in zip(table, table[1:]))  # contiguous
    assert [k for _, _, k in table] == sorted((k for _, _, k in table), reverse=True)  # fewer tokens under load
    assert table[0][2] > 0 and table[-1][2] == 0
    # the table says what goodput would do with every row at that acceptance
    loaded = BatchTablePolicy.from_vllm_config(json.loads(json.dumps(config)))
    goodput = build_policy(DynSpecConfig(
        num_speculative_tokens=6,
        policy="goodput",
        policy_options={"cost_model": "profile", "profile": profile.to_dict(), "prior_acceptance": 0.8,
                        "loss_budget": None, "probe_z": 0.0},  # the table is the search alone
    ))
    goodput.reset(128)
    for batch in (1, 3, 8, 20, 40, 100):
        request = PolicyInput(0, torch.arange(batch), torch.full((batch,), 1000), 6)
        assert loaded.length_for(batch) == int(goodput.draft_lengths(request).max())


def test_uniform_draft_length_prefers_plain_decoding_on_ties() -> None:
    flat = Profile(target_forward=[TargetTiming(1, 1, 1.0), TargetTiming(1, 9, 1.0)], draft_forward=[DraftTiming(1, 0.0001)])
    assert uniform_draft_length(ProfileCostModel(flat), 1, 0.0, 8) == 0
    assert uniform_draft_length(ProfileCostModel(flat), 1, 0.9, 8) == 8


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"acceptance": 1.5}, "`acceptance` must be a number in \\[0, 1\\]"),
        ({"num_speculative_tokens": 0}, "`num_speculative_tokens` must be an integer >= 1"),
        ({"max_batch_size": 0}, "`max_batch_size` must be an integer >= 1"),
    ],
)
def test_vllm_table_rejects_bad_arguments(kwargs, message) -> None:
    arguments = {"acceptance": 0.7, "num_speculative_tokens": 4, "max_batch_size": 8, **kwargs}
    with pytest.raises(ValueError, match=message):
        vllm_speculative_config(linear_profile(), **arguments)


# ---- the command line ----------------------------------------------------------------------------------------------
TINY_ARGS = ["--tiny", "--batch-sizes", "1,2", "--tokens-per-row", "1,2", "--context-length", "8", "--warmup", "0",
             "--repeats", "2", "--no-progress"]


def test_calibrate_command_writes_a_profile_goodput_loads(tmp_path, capsys) -> None:
    out = tmp_path / "profile.json"
    assert main(["calibrate", *TINY_ARGS, "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and f"Wrote {out}" in captured.err and "batch | target t=1" in captured.err
    profile = Profile.load(out)
    assert profile.target == "tiny-target" and len(profile.target_forward) == 4
    policy = build_policy(DynSpecConfig(policy="goodput", policy_options={"cost_model": "profile", "profile": str(out)}))
    assert policy.cost_model.exploration_length(2, 4) is None


def test_calibrate_command_prints_only_the_vllm_config_on_stdout(tmp_path, capsys) -> None:
    path = tmp_path / "profile.json"
    linear_profile().save(path)
    arguments = ["--load", str(path), "--vllm-table", "--acceptance", "0.8", "--num-speculative-tokens", "6",
                 "--vllm-max-batch-size", "64", "--vllm-method", "eagle"]
    assert main(["calibrate", *arguments]) == 0
    config = json.loads(capsys.readouterr().out)
    assert config == vllm_speculative_config(linear_profile(), 0.8, 6, 64, method="eagle")
    assert BatchTablePolicy.from_vllm_config(config).num_speculative_tokens == 6


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--out", "p.json"], "give both --target and --draft"),
        (["--target", "t", "--out", "p.json"], "give both --target and --draft"),
        (["--tiny", "--target", "t", "--out", "p.json"], "--tiny builds its own models"),
        (["--tiny"], "nothing to do"),
        (["--load", "p.json", "--tiny"], "--load uses a saved profile"),
        (["--load", "/nonexistent/p.json", "--vllm-table"], "does not exist"),
        (["--tiny", "--batch-sizes", "1,x", "--out", "p.json"], "--batch-sizes must be comma-separated integers"),
        (["--tiny", "--tokens-per-row", "2,3", "--out", "p.json"], "`tokens_per_row` must include 1"),
    ],
)
def test_calibrate_command_reports_bad_usage(arguments, message, capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["calibrate", *arguments]) == 2
    assert message in capsys.readouterr().err
