"""The rollout scenario: samples of each prompt in adjacent rows, RL sampling settings, active rows over time."""

from __future__ import annotations

import pytest

from hf_dynspec.commands.bench import add_parser, settings_from_args
from hf_dynspec.evaluation import bench
from hf_dynspec.evaluation.methods import NO_SPECULATION, MethodError, parse_method
from hf_dynspec.evaluation.plots import write_plots
from hf_dynspec.evaluation.rollout import BUCKETS, bucket_seconds, forward_seconds, matched_seconds, rollout_table


def test_the_preset_is_trl_s_layout_and_rl_sampling():
    import argparse

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    settings = settings_from_args(parser.parse_args(["bench", "--scenario", "rollout"]))
    assert settings.do_sample and settings.sampling == {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
    assert (settings.num_prompts, settings.samples_per_prompt, settings.batch_sizes) == (2, 8, [16])
    assert settings.max_new_tokens == 512 and settings.records_timeline
    assert NO_SPECULATION in settings.methods.split(",")
    settings = settings_from_args(parser.parse_args(["bench", "--scenario", "rollout", "--top-k", "5",
                                                     "--samples-per-prompt", "4", "--max-new-tokens", "256"]))
    assert settings.sampling["top_k"] == 5 and settings.prompts_for(16) == 8 and settings.max_new_tokens == 256


def test_the_loop_without_speculation_proposes_nothing():
    method = parse_method(NO_SPECULATION)
    assert method.dynspec_config.num_speculative_tokens == 0 and not method.uses_draft
    tagged = parse_method(f"{NO_SPECULATION}@unfolded", {"nospec@unfolded": {"fold_attention": False}})
    assert tagged.dynspec_config.num_speculative_tokens == 0 and not tagged.dynspec_config.fold_attention
    assert method.dynspec_config.fold_attention


def test_buckets_split_a_timeline_by_active_rows():
    timeline = [(0.0, 16), (1.0, 9), (1.5, 8), (2.0, 7), (4.0, 2), (5.0, 1), (8.0, 0)]
    assert bucket_seconds(timeline) == {"8+": 2.0, "2-7": 3.0, "1": 3.0}


def test_the_loop_without_speculation_is_priced_by_active_rows():
    """`forward_seconds` prices that loop's later forwards by active rows (medians over calls) and its set-up and
    prefill apart; `matched_seconds` adds up its forwards for other lengths, interpolating between row counts."""
    calls = [
        [(0.0, 4), (2.0, 4), (2.5, 3), (2.9, 1), (3.1, 1), (3.3, 0)],  # lengths 2, 3, 3, 5: a 2 s prefill
        [(0.1, 4), (1.0, 3), (1.6, 2), (1.9, 0)],  # lengths 1, 2, 3, 3 (a faster 0.9 s prefill)
    ]
    start, by_rows = forward_seconds(calls)
    assert start == pytest.approx(1.5)  # the median of 2.0 and 1.0
    assert by_rows == pytest.approx({1: 0.2, 2: 0.3, 3: 0.5, 4: 0.5})  # 3 rows: the median of 0.4 and 0.6
    # rows of 1, 3 and 4 tokens: after the prefill, forwards over 2, 2 and 1 rows
    assert matched_seconds([1, 3, 4], start, by_rows) == pytest.approx(1.5 + 0.3 + 0.3 + 0.2)
    assert matched_seconds([6, 6, 6, 6, 6, 6], start, {2: 0.3, 4: 0.5}) == pytest.approx(1.5 + 5 * 0.5)  # nearest
    assert matched_seconds([2, 2, 2], start, {2: 0.3, 4: 0.5}) == pytest.approx(1.5 + 0.4)  # linear
    with pytest.raises(ValueError, match="two forwards"):
        forward_seconds([[(0.0, 2), (1.0, 0)]])


def test_a_tiny_rollout_records_who_is_active_and_where_the_time_goes(tmp_path):
    settings = bench.BenchSettings(
        tiny=True, num_prompts=2, samples_per_prompt=3, batch_sizes=[6], max_new_tokens=12, repetitions=2,
        warmup_tokens=0, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
        methods=f"plain,{NO_SPECULATION},dynspec-static:2",
    )
    results = bench.run_benchmark(settings, progress=False)
    lengths = results["config"]["prompt_lengths"]
    assert len(lengths) == 6 and lengths[:3] == [lengths[0]] * 3 and lengths[3:] == [lengths[3]] * 3
    timelines = {entry["method"]: entry["calls"] for entry in results["timelines"]}
    assert set(timelines) == {"plain", NO_SPECULATION, "dynspec-static:2"}
    for method, calls in timelines.items():
        (timeline,) = calls  # one call of 6 rows
        rows = [active for _, active in timeline]
        assert rows[0] == 6 and rows[-1] == 0 and rows == sorted(rows, reverse=True), method
        seconds = [t for t, _ in timeline]
        assert seconds == sorted(seconds) and seconds[0] >= 0
    runs = {run["method"]: run for run in results["runs"]}
    for run in runs.values():
        assert set(run["active_seconds"]) == set(BUCKETS)
        assert sum(run["active_seconds"].values()) == pytest.approx(run["wall_s"], rel=0.5)
    plain_forwards = len(timelines["plain"][0]) - 1
    assert plain_forwards == runs["plain"]["target_forwards"]  # one timeline entry per forward (last repetition)
    for run in runs.values():  # per repetition, each method against the loop without speculation at its lengths
        assert len(run["vs_nospec_same_lengths"]) == 2 and all(ratio > 0 for ratio in run["vs_nospec_same_lengths"])
    table = rollout_table(results, NO_SPECULATION)
    assert all(f"| {name} |" in table for name in timelines) and f"vs {NO_SPECULATION}" in table
    assert any(path.name == "active_rows.png" for path in write_plots(results, tmp_path))


def test_suffix_methods_and_their_modifiers():
    cold, warm, both = (parse_method(name) for name in ("dynspec-suffix:6", "dynspec-suffix+warm",
                                                        "dynspec-suffix+draft+warm"))
    assert cold.suffix and not cold.uses_draft and not cold.warm
    assert cold.dynspec_config.prompt_lookup_max_tokens == 6 and cold.dynspec_config.policy == "goodput"
    assert warm.warm and not warm.uses_draft and both.warm and both.uses_draft
    foreign = parse_method("dynspec-suffix+foreign")
    assert foreign.foreign and not foreign.warm and not cold.foreign
    for name in ("dynspec-goodput+warm", "dynspec-goodput+foreign"):
        with pytest.raises(MethodError, match="applies to dynspec-suffix methods only"):
            parse_method(name)


def test_foreign_runs_start_from_a_cache_of_another_tasks_text():
    from hf_dynspec.candidates.suffix import _CACHES
    from hf_dynspec.evaluation.runner import Runner
    from hf_dynspec.evaluation.tiny import tiny_pair

    target, draft = tiny_pair()
    prompts = [[5, 6, 7, 8]] * 2 + [[9, 10, 11]] * 2
    foreign = [[3, 4, 5, 6, 7] * 4, [12, 13, 14] * 5, [20, 21] * 8]
    without = Runner(target, draft, max_new_tokens=8, seed=0)
    with pytest.raises(ValueError, match="another task's text"):
        without.run(parse_method("dynspec-suffix+foreign"), prompts, batch_size=4, progress=False)
    without.close()
    runner = Runner(target, draft, max_new_tokens=8, seed=0, foreign_text=foreign)
    try:
        for name, outputs in (("dynspec-suffix+foreign", 3 + 4), ("dynspec-suffix+foreign", 3 + 4),
                              ("dynspec-suffix", 4)):
            plain = runner.run(parse_method("plain"), prompts, batch_size=4, progress=False)
            outcome = runner.run(parse_method(name), prompts, batch_size=4, progress=False)
            (cache,) = _CACHES[target].values()
            assert cache.num_outputs == outputs, name  # the other task's texts, then this run's outputs
            assert outcome.tokens == plain.tokens
    finally:
        runner.close()


def test_suffix_runs_start_from_an_empty_cache_and_warm_ones_after_an_untimed_pass():
    from hf_dynspec.candidates.suffix import _CACHES
    from hf_dynspec.evaluation.runner import Runner
    from hf_dynspec.evaluation.tiny import tiny_pair

    target, draft = tiny_pair()
    runner = Runner(target, draft, max_new_tokens=8, do_sample=True, seed=0)
    prompts = [[5, 6, 7, 8]] * 3 + [[9, 10, 11]] * 3
    try:
        for name, outputs in (("dynspec-suffix", 6), ("dynspec-suffix+warm", 12), ("dynspec-suffix", 6)):
            outcome = runner.run(parse_method(name), prompts, batch_size=6, progress=False)
            (cache,) = _CACHES[target].values()
            assert cache.num_outputs == outputs, name  # the cache holds this run's outputs (and the untimed pass's)
            assert outcome.target_forwards <= 8  # the untimed pass's forwards are not counted
    finally:
        runner.close()


def test_a_tiny_bench_runs_foreign_suffix_methods_identical_to_plain():
    from hf_dynspec.evaluation import bench

    settings = bench.BenchSettings(tiny=True, num_prompts=4, batch_sizes=[4], max_new_tokens=10,
                                   methods="plain,dynspec-suffix,dynspec-suffix+foreign", repetitions=1,
                                   warmup_tokens=0)
    assert len(bench.foreign_texts(settings)) == bench.FOREIGN_TEXTS
    results = bench.run_benchmark(settings, progress=False)
    runs = {run["method"]: run for run in results["runs"]}
    assert runs["dynspec-suffix+foreign"]["matches_plain"] and runs["dynspec-suffix"]["matches_plain"]


def test_packed_verify_forwards_count_every_row_they_pack():
    import time

    from conftest import left_padded_prompts, perturbed, tiny_model
    from test_packing import run

    from hf_dynspec.evaluation.rollout import ActiveRowsTimeline

    target = tiny_model("llama", seed=1)
    ids, mask = left_padded_prompts([6, 9, 11, 5], seed=2)
    timeline = ActiveRowsTimeline(target)
    start = time.perf_counter()
    out = run(target, perturbed(target, scale=0.05), ids, mask, True, 0)  # ragged draft lengths: packed verifies
    rows = [active for _, active in timeline.take(start, time.perf_counter())][:-1]
    timeline.remove()
    steps = out.dynspec_stats.steps
    assert any(s.target_tokens < s.batch_size * (1 + max(s.draft_lengths)) for s in steps)  # some step was packed
    assert rows == [4] + [s.batch_size for s in steps]  # the prefill, then each verify forward's rows
