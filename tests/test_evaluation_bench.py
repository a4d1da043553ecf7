"""The benchmark harness on tiny random models: methods, runner, comparisons with plain, report, plots, CLI."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from conftest import word_tokenizer
from transformers import StoppingCriteriaList

from hf_dynspec import DynSpecConfig, calibration, kernels
from hf_dynspec.commands import bench as bench_command
from hf_dynspec.evaluation import bench, methods, plots, report, runner
from hf_dynspec.evaluation.data import random_token_prompts
from hf_dynspec.evaluation.methods import MethodError
from hf_dynspec.evaluation.settings import SCENARIOS
from hf_dynspec.evaluation.tiny import TINY_EOS, TINY_PAD, TINY_VOCAB, tiny_pair


@pytest.fixture(scope="module")
def pair():
    return tiny_pair(seed=0)


# ---- methods --------------------------------------------------------------------------------------------------------
def test_method_names_map_to_code_paths():
    parsed = {m.name: m for m in methods.parse_methods("plain,hf-assisted,hf-heuristic,hf-prompt-lookup:7,"
                                                        "dynspec-static:3,dynspec-table,dynspec-prompt-lookup")}
    assert parsed["plain"].kind == "plain" and parsed["plain"].batched
    assert parsed["hf-assisted"].uses_draft and not parsed["hf-assisted"].batched
    assert parsed["hf-heuristic"].assistant_settings == {"num_assistant_tokens_schedule": "heuristic"}
    assert parsed["hf-prompt-lookup:7"].generate_kwargs == {"prompt_lookup_num_tokens": 7}
    assert not parsed["hf-prompt-lookup:7"].uses_draft
    static = parsed["dynspec-static:3"].dynspec_config
    assert (static.policy, static.num_speculative_tokens) == ("static", 3)
    assert parsed["dynspec-table"].dynspec_config.policy == "batch_table"
    lookup = parsed["dynspec-prompt-lookup"]
    assert not lookup.uses_draft and lookup.generate_kwargs == {"prompt_lookup_num_tokens": 10}


def test_policy_options_reach_the_config():
    options = methods.parse_policy_options(["goodput.window=5", "table.vllm_config=t.json", "goodput.cost_model=online"])
    assert options == {"goodput": {"window": 5, "cost_model": "online"}, "batch_table": {"vllm_config": "t.json"}}
    method = methods.parse_method("dynspec-goodput", options)
    assert method.dynspec_config.policy_options == {"window": 5, "cost_model": "online"}
    tagged = methods.parse_method("dynspec-goodput@slow:6", methods.parse_policy_options(["goodput@slow.window=2"]))
    assert tagged.name == "dynspec-goodput@slow:6" and tagged.dynspec_config.policy == "goodput"
    assert tagged.dynspec_config.policy_options == {"window": 2} and tagged.dynspec_config.num_speculative_tokens == 6
    options = methods.parse_policy_options(["tree@stop.early_stop=marginal"])
    stopped, plain_tree = (
        methods.parse_method(name, options).dynspec_config for name in ("dynspec-tree@stop:16:8", "dynspec-tree:16:8")
    )
    assert stopped.policy_options == {"early_stop": "marginal"} and plain_tree.policy_options == {}
    assert (stopped.policy, stopped.tree_node_budget, stopped.num_speculative_tokens) == ("goodput", 16, 8)
    base = {"tree": {"early_stop": "marginal", "tree_branching": 3}, "goodput": {"window": 4}}
    merged = methods.parse_policy_options(["tree.tree_branching=2", "tree@b.window=2"], base)
    assert merged == {"tree": {"early_stop": "marginal", "tree_branching": 2}, "goodput": {"window": 4},
                      "tree@b": {"window": 2}}  # the items win option by option; a tagged method gets only its own
    assert base["tree"]["tree_branching"] == 3  # the base is copied, not changed


def test_method_options_named_like_config_fields_set_the_config():
    options = methods.parse_policy_options(
        ["goodput@stepwise.draft_lookahead=0", "goodput@stepwise.window=3", "hybrid@wide.prompt_lookup_max_tokens=16"]
    )
    stepwise = methods.parse_method("dynspec-goodput@stepwise", options).dynspec_config
    assert stepwise.draft_lookahead == 0 and stepwise.policy_options == {"window": 3}
    wide = methods.parse_method("dynspec-hybrid@wide:3", options).dynspec_config
    assert (wide.proposer, wide.prompt_lookup_max_tokens, wide.num_speculative_tokens) == ("hybrid", 16, 3)
    assert methods.parse_method("dynspec-goodput", options).dynspec_config.draft_lookahead == DynSpecConfig().draft_lookahead
    alone = methods.parse_method("dynspec-draft:5", options)
    assert alone.uses_draft and (alone.dynspec_config.proposer, alone.dynspec_config.num_speculative_tokens) == ("draft", 5)
    assert methods.parse_method("dynspec-goodput", options).dynspec_config.proposer == "auto"


def test_tree_method_options_named_like_config_fields_set_the_config():
    options = methods.parse_policy_options(
        ["tree@pd.prefill_draft_confidence=0.4", "tree@pd.early_stop=marginal", "tree-lookup@x.draft_lookahead=0"]
    )
    tree = methods.parse_method("dynspec-tree@pd:32:24", options).dynspec_config
    assert (tree.prefill_draft_confidence, tree.tree_node_budget, tree.num_speculative_tokens) == (0.4, 32, 24)
    assert tree.policy_options == {"early_stop": "marginal"}
    assert methods.parse_method("dynspec-tree-lookup@x:8", options).dynspec_config.draft_lookahead == 0


@pytest.mark.parametrize(
    "names, message",
    [
        ("plain,beam-search", "Unknown method"),
        ("plain,dynspec-static:x", "positive integer"),
        ("plain,hf-prompt-lookup:0", "positive integer"),
        ("hf-assisted", "must include 'plain'"),
        ("plain,plain", "twice"),
    ],
)
def test_bad_method_lists_are_explained(names, message):
    with pytest.raises(MethodError, match=message):
        methods.parse_methods(names)


def test_draft_variants_in_method_names():
    parsed = {m.name: m for m in methods.parse_methods("plain,dynspec-goodput/4bit,hf-assisted/bf16,dynspec-tree:8/fp32")}
    assert parsed["dynspec-goodput/4bit"].draft_variant == "4bit"
    assert parsed["dynspec-goodput/4bit"].dynspec_config.policy == "goodput"
    assert parsed["hf-assisted/bf16"].kind == "hf" and parsed["hf-assisted/bf16"].draft_variant == "bf16"
    assert parsed["dynspec-tree:8/fp32"].dynspec_config.tree_node_budget == 8
    deep = methods.parse_method("dynspec-tree:32:16").dynspec_config
    assert (deep.tree_node_budget, deep.num_speculative_tokens) == (32, 16)
    assert parsed["plain"].draft_variant is None
    with pytest.raises(MethodError, match="must be one of"):
        methods.parse_method("dynspec-goodput/3bit")
    with pytest.raises(MethodError, match="uses no draft model"):
        methods.parse_method("hf-prompt-lookup/4bit")
    hybrid = methods.parse_method("dynspec-suffix+draft/4bit")  # the variant after the modifier that brings the draft
    assert (hybrid.name, hybrid.suffix, hybrid.uses_draft, hybrid.draft_variant) == (
        "dynspec-suffix+draft/4bit", True, True, "4bit")
    with pytest.raises(MethodError, match="uses no draft model"):
        methods.parse_method("dynspec-suffix+warm/4bit")


def test_a_draft_variant_runs_beside_the_draft_in_one_run(pair):
    settings = bench.BenchSettings(tiny=True, num_prompts=3, batch_sizes=[3], max_new_tokens=8, repetitions=1,
                                   warmup_tokens=0, methods="plain,dynspec-static:3,dynspec-static:3/bf16")
    prompts = random_token_prompts(3, TINY_VOCAB, seed=6)
    results = bench.run_benchmark(settings, target=pair[0], draft=pair[1], prompts=prompts, progress=False)
    runs = {r["method"]: r for r in results["runs"]}
    assert runs["dynspec-static:3/bf16"]["draft_forwards"] > 0
    assert runs["dynspec-static:3/bf16"]["matches_plain"] and runs["dynspec-static:3"]["matches_plain"]
    assert settings.loaded_models["draft/bf16"] == {"dtype": "bfloat16"}
    with pytest.raises(ValueError, match="dtype variants only"):
        bench.load_variant_drafts(settings, ["4bit"], pair[1])
    other = tiny_pair(seed=1)[1]
    run = runner.Runner(pair[0], pair[1], max_new_tokens=4, variant_drafts={"bf16": other})
    assert run._draft(methods.parse_method("dynspec-static:3/bf16")) is other
    assert run._draft(methods.parse_method("dynspec-static:3")) is pair[1]
    with pytest.raises(ValueError, match="not loaded"):
        run.run(methods.parse_method("dynspec-static:3/8bit"), [[5, 6]], batch_size=1, progress=False)


def test_narrow_modifier_runs_plain_and_hf_methods_weight_first(pair, monkeypatch):
    parsed = {m.name: m for m in methods.parse_methods("plain,plain+narrow,hf-assisted/bf16+narrow")}
    assert parsed["plain+narrow"].narrow and parsed["plain+narrow"].kind == "plain" and not parsed["plain"].narrow
    assert parsed["hf-assisted/bf16+narrow"].draft_variant == "bf16" and parsed["hf-assisted/bf16+narrow"].narrow
    with pytest.raises(MethodError, match="narrow_linear"):
        methods.parse_method("dynspec-goodput+narrow")
    with pytest.raises(MethodError, match="may only be"):
        methods.parse_method("plain+wide")
    monkeypatch.setattr(runner, "linear_plan", lambda model, setting: kernels.LinearPlan(64))  # as measured faster
    routed: list[int] = []
    original = kernels.weight_first_linear
    monkeypatch.setattr(kernels, "weight_first_linear", lambda x, w, b=None: routed.append(1) or original(x, w, b))
    settings = bench.BenchSettings(tiny=True, num_prompts=3, batch_sizes=[3], max_new_tokens=6, repetitions=1,
                                   warmup_tokens=0, methods="plain,plain+narrow")
    prompts = random_token_prompts(3, TINY_VOCAB, seed=2)
    results = bench.run_benchmark(settings, target=pair[0], draft=pair[1], prompts=prompts, progress=False)
    runs = {r["method"]: r for r in results["runs"]}
    assert routed, "plain+narrow computes its three-row forwards weight-first"
    assert runs["plain+narrow"]["matches_plain"] and runs["plain+narrow"]["mismatched_prompts"] == 0
    assert runs["plain"]["matches_plain"] is None
    assert set(results["config"]["narrow_rows"]) == {"target", "draft"}
    plans = results["config"]["linear_plans"]
    assert set(plans) == {"target", "draft"} and set(plans["target"]) == {"narrow_rows", "weight_first", "pad_to"}


def test_bad_policy_option_and_unknown_policy():
    with pytest.raises(MethodError, match="POLICY.OPTION=VALUE"):
        methods.parse_policy_options(["window=5"])
    with pytest.raises(MethodError, match="not registered"):
        methods.parse_methods("plain,dynspec-oracle")


# ---- runner ---------------------------------------------------------------------------------------------------------
def test_left_pad_and_trim():
    ids, mask = runner.left_pad([[5, 6], [7]], pad_id=0)
    assert ids.tolist() == [[5, 6], [0, 7]] and mask.tolist() == [[1, 1], [0, 1]]
    generated = torch.tensor([[3, 1, 4, 0], [3, 4, 1, 1], [3, 4, 5, 6]])
    assert runner.trim(generated, eos_ids={1}) == [[3, 1], [3, 4, 1], [3, 4, 5, 6]]
    assert runner.trim(generated, eos_ids={1}, limits=[4, 2, 3]) == [[3, 1], [3, 4], [3, 4, 5]]


def test_row_budgets_stop_each_row_at_its_own_length(pair):
    target, _ = pair
    prompts = random_token_prompts(3, TINY_VOCAB, seed=3)
    ids, mask = runner.left_pad(prompts, TINY_PAD)
    budgets = [3, 12, 7]
    out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                          stopping_criteria=StoppingCriteriaList([runner.RowBudgets(ids, budgets)]))
    generated = out[:, ids.shape[1]:]
    checked = 0
    for row, budget in enumerate(budgets):
        if TINY_EOS not in generated[row, :budget].tolist():  # rows that did not stop at EOS stop at their budget
            assert (generated[row, budget:] == TINY_PAD).all() and (generated[row, :budget] != TINY_PAD).any()
            checked += 1
    assert checked >= 2
    with pytest.raises(ValueError, match="2 budgets for 3 prompts"):
        runner.RowBudgets(ids, [1, 2])


def test_runner_counts_forwards_and_matches_plain(pair):
    target, draft = pair
    run = runner.Runner(target, draft, max_new_tokens=12)
    prompts = random_token_prompts(3, TINY_VOCAB, seed=4)
    plain = run.run(methods.parse_method("plain"), prompts, batch_size=3, progress=False)
    static = methods.parse_method("dynspec-static:3")
    spec = run.run(static, prompts, batch_size=3, progress=False)
    assisted = run.run(methods.parse_method("hf-assisted"), prompts, batch_size=3, progress=False)
    run.close()
    assert spec.tokens == plain.tokens == assisted.tokens
    assert plain.target_forwards == max(len(row) for row in plain.tokens)  # one forward per step, batched
    assert plain.mean_accepted(methods.parse_method("plain")) is None
    assert spec.draft_forwards > 0 and sum(spec.accepted.values()) > 0 and spec.steps
    assert assisted.target_forwards >= 3  # rows ran one at a time
    # the lookahead width the process measured for the draft; none where the loop drove no draft
    assert plain.draft_lookahead is None and assisted.draft_lookahead is None
    assert 0 <= spec.draft_lookahead <= static.dynspec_config.draft_lookahead
    merged = runner.Outcome(tokens=[], seconds=0.0, target_forwards=0, draft_forwards=0)
    for width in (None, 4, 2):
        merged.extend(runner.Outcome(tokens=[], seconds=0.0, target_forwards=0, draft_forwards=0, draft_lookahead=width))
    assert merged.draft_lookahead == 4


def test_runner_refuses_draft_methods_without_a_draft(pair):
    run = runner.Runner(pair[0], None, max_new_tokens=4)
    with pytest.raises(ValueError, match="needs a draft model"):
        run.run(methods.parse_method("hf-assisted"), [[5, 6]], batch_size=1, progress=False)


# ---- the benchmark --------------------------------------------------------------------------------------------------
def test_long_tail_budgets_shape():
    budgets = bench.long_tail_budgets(32, 128, seed=0)
    assert budgets == bench.long_tail_budgets(32, 128, seed=0)
    assert budgets[0] == 128 and all(8 <= b <= 128 for b in budgets)
    assert sorted(budgets)[16] < 64  # most rows are short


def test_compare_counts_prompts_and_tokens():
    assert bench.compare([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6, 7]]) == (1, 2)
    assert bench.compare([[1]], [[1]]) == (0, 0)


def test_settings_are_validated():
    with pytest.raises(ValueError, match="output_lengths"):
        bench.BenchSettings(output_lengths="random")
    with pytest.raises(ValueError, match="batch_sizes"):
        bench.BenchSettings(batch_sizes=[0])
    with pytest.raises(ValueError, match="repetitions"):
        bench.BenchSettings(repetitions=0)
    with pytest.raises(ValueError, match="prompt_offset"):
        bench.BenchSettings(prompt_offset=-2)


def test_prompt_offset_holds_out_the_first_prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"p{i}"}) for i in range(5)))
    held_out = bench_command.settings_from_args(_parse(["--tiny", "--prompt-offset", "3", "--num-prompts", "2",
                                                         "--batch-sizes", "2"]))
    assert held_out.prompt_offset == 3
    first = bench.BenchSettings(tiny=True, num_prompts=5, batch_sizes=[5])
    assert bench.load_inputs(held_out)[2] == bench.load_inputs(first)[2][3:]
    def tokenizer(text):  # one id per character
        return {"input_ids": [ord(c) for c in text]}

    settings = bench.BenchSettings(dataset=str(path), prompt_offset=1, num_prompts=2)
    assert bench.prompt_ids(settings, tokenizer, 2) == [[112, 49], [112, 50]]  # "p1", "p2"
    settings = bench.BenchSettings(dataset=str(path), prompt_offset=4, num_prompts=2)
    with pytest.raises(ValueError, match="Only 1 prompts .* after the first 4"):
        bench.prompt_ids(settings, tokenizer, 2)


def test_tiny_benchmark_end_to_end(pair, tmp_path):
    settings = bench.BenchSettings(
        tiny=True,
        num_prompts=4,
        batch_sizes=[1, 4],
        batch_size_prompts={1: 2},
        max_new_tokens=10,
        methods="dynspec-static:3,plain,hf-assisted,hf-prompt-lookup,dynspec-goodput",
        repetitions=2,
        warmup_tokens=2,
    )
    prompts = random_token_prompts(4, TINY_VOCAB, seed=5)
    results = bench.run_benchmark(settings, target=pair[0], draft=pair[1], prompts=prompts, progress=False)
    assert set(results) == {"machine", "config", "runs", "traces"}
    runs = {(r["method"], r["batch_size"]): r for r in results["runs"]}
    assert len(runs) == 10
    assert runs[("plain", 1)]["num_prompts"] == 2 and runs[("plain", 4)]["num_prompts"] == 4
    for (name, _), run in runs.items():
        assert run["matches_plain"] is (None if name == "plain" else True)
        assert len(run["wall_s_repetitions"]) == 2 and run["tokens_per_s"] > 0
        assert run["speedup_repetitions"] is None if name == "plain" else len(run["speedup_repetitions"]) == 2
    assert runs[("hf-assisted", 4)]["rows_one_at_a_time"] and not runs[("hf-assisted", 1)]["rows_one_at_a_time"]
    assert runs[("plain", 1)]["draft_lookahead"] is None and isinstance(runs[("dynspec-static:3", 1)]["draft_lookahead"], int)
    for size in (1, 4):  # an adaptive policy may draft nothing on a call (tiny models, noisy costs): then None
        goodput = runs[("dynspec-goodput", size)]
        assert isinstance(goodput["draft_lookahead"], int) is (goodput["draft_forwards"] > 0)
    assert {(t["method"], t["batch_size"]) for t in results["traces"]} == {
        ("dynspec-static:3", 1), ("dynspec-static:3", 4), ("dynspec-goodput", 1), ("dynspec-goodput", 4)
    }
    json.dumps(results)  # the results file must be plain JSON
    table = report.markdown_table(results)
    assert "| 4 | hf-assisted † |" in table and "ran one at a time" in table
    assert "| 1 | dynspec-goodput * |" in table and "what `DynSpecConfig()` runs" in table  # the default is marked
    results["config"]["policy_options"] = {"goodput": {"loss_budget": 0.1}}
    assert "dynspec-goodput *" not in report.markdown_table(results)  # not the default once its options change
    for path in plots.write_plots(results, tmp_path / "plots"):
        assert path.read_bytes()[:4] == b"\x89PNG"


def test_warm_up_pays_the_drafts_lookahead_measurement_even_when_no_call_drafts():
    target, draft = tiny_pair(seed=3)  # a draft no other test has measured
    settings = bench.BenchSettings(tiny=True, num_prompts=2, batch_sizes=[1], max_new_tokens=4,
                                   methods="plain,dynspec-goodput", repetitions=1, warmup_tokens=1)
    parsed = methods.parse_methods(settings.methods)
    bench_runner = runner.Runner(target, draft, settings.max_new_tokens)
    prompts = random_token_prompts(2, TINY_VOCAB, seed=5)
    bench._warm_up(bench_runner, parsed, settings, prompts, None, progress=False)  # one token: nothing is drafted
    config = parsed[1].dynspec_config
    measured = calibration._AFFORDABLE.get(draft, {})
    assert any(key[:2] == (config.draft_lookahead, config.draft_lookahead_max_cost) for key in measured)
    outcome = bench_runner.run(parsed[0], prompts, 1, progress=False)
    assert outcome.draft_forwards == 0  # the measurement's draft forwards are counted for no method
    bench_runner.close()


def test_long_tail_run_matches_plain(pair):
    settings = bench.BenchSettings(
        tiny=True, num_prompts=6, batch_sizes=[6], max_new_tokens=24, output_lengths="long-tail",
        methods="plain,dynspec-static:3", repetitions=1, warmup_tokens=0,
    )
    prompts = random_token_prompts(6, TINY_VOCAB, seed=6)
    results = bench.run_benchmark(settings, target=pair[0], draft=pair[1], prompts=prompts, progress=False)
    assert all(r["matches_plain"] in (None, True) for r in results["runs"])
    assert results["config"]["row_budgets"] == bench.long_tail_budgets(6, 24, 0)
    sizes = [s["batch_size"] for s in results["traces"][0]["steps"]]
    assert sizes[0] == 6 and sizes[-1] < 6  # the batch shrinks as rows finish


# ---- command line ---------------------------------------------------------------------------------------------------
def _parse(argv):
    parser = argparse.ArgumentParser()
    bench_command.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def test_scenario_presets_and_overrides():
    settings = bench_command.settings_from_args(_parse(["--scenario", "long-tail", "--max-new-tokens", "64"]))
    assert settings.output_lengths == "long-tail" and settings.batch_sizes == [32] and settings.max_new_tokens == 64
    settings = bench_command.settings_from_args(
        _parse(["--batch-sizes", "2,8", "--batch-size-prompts", "2=1", "--policy-option", "goodput.window=3"])
    )
    assert settings.batch_sizes == [2, 8] and settings.prompts_for(2) == 1 and settings.prompts_for(8) == 16
    assert settings.policy_options == {"goodput": {"window": 3}}
    settings = bench_command.settings_from_args(_parse(["--scenario", "offload", "--policy-option",
                                                        "goodput@marginal.window=5"]))
    marginal = {"early_stop": "marginal", "prefill_draft_confidence": 0.4}
    tree = {**marginal, "tree_branching": 3, "tree_stop_judges": "tree"}
    assert settings.policy_options == {"goodput@marginal": {**marginal, "window": 5}, "tree": tree}
    assert "dynspec-goodput@marginal:16" in settings.methods and settings.target_max_memory == {"cpu": "35%"}
    assert SCENARIOS["offload"]["policy_options"] == {"goodput@marginal": marginal, "tree": tree}
    parsed = methods.parse_methods(settings.methods, settings.policy_options)
    assert [m.dynspec_config.prefill_draft_confidence for m in parsed if m.kind == "dynspec"] == [0.4, 0.4]
    trees = [m.dynspec_config for m in parsed if m.name == "dynspec-tree:32:40"]
    assert [(c.tree_branching, c.tree_stop_judges, c.tree_node_budget) for c in trees] == [(3, "tree", 32)]
    assert [c.num_speculative_tokens for c in trees] == [40]


def test_command_line_errors(capsys):
    with pytest.raises(SystemExit):
        _parse(["--batch-sizes", "1,x"])
    assert "comma-separated integers" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="must include 'plain'"):
        bench_command.run(_parse(["--tiny", "--methods", "hf-assisted"]))


def test_command_runs_tiny_and_writes_files(tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["--tiny", "--methods", "plain,dynspec-static:2", "--batch-sizes", "2", "--num-prompts", "2",
            "--max-new-tokens", "6", "--repetitions", "1", "--out", str(out), "--plots", str(tmp_path / "p"), "--quiet"]
    assert bench_command.run(_parse(argv)) == 0
    assert "| 2 | dynspec-static:2 |" in capsys.readouterr().out
    assert json.loads(out.read_text())["runs"][1]["matches_plain"] is True
    assert (tmp_path / "p" / "speedup.png").is_file()


# ---- batch tables ---------------------------------------------------------------------------------------------------
def test_table_options_from_a_vllm_config_or_a_profile(tmp_path):
    from hf_dynspec.cost_models import DraftTiming, Profile, TargetTiming
    from hf_dynspec.policies import build_policy

    table = {"num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[1, 4, 3], [5, 64, 1]]}
    (tmp_path / "table.json").write_text(json.dumps(table))
    options = methods.table_policy_options(tmp_path / "table.json")
    method = methods.parse_method("dynspec-table", {"batch_table": options})
    assert options == table and method.dynspec_config.num_speculative_tokens == 3
    build_policy(method.dynspec_config)  # the policy accepts what the harness passes

    # a profile where drafting is cheap at batch 1 and costly beyond: the derived table drafts at batch 1 only
    target = [TargetTiming(b, t, 0.01 * b * t + 0.05) for b in (1, 4, 16) for t in (1, 2, 3, 5)]
    Profile(target_forward=target, draft_forward=[DraftTiming(b, 0.002 * b) for b in (1, 4, 16)]).save(tmp_path / "p.json")
    derived = methods.table_policy_options(tmp_path / "p.json", acceptance=0.8, num_speculative_tokens=4)
    schedule = derived["num_speculative_tokens_per_batch_size"]
    assert schedule[0][0] == 1 and schedule[0][2] > 0 and schedule[-1][1] == 256


def test_table_file_errors(tmp_path):
    with pytest.raises(MethodError, match="does not exist"):
        methods.table_policy_options(tmp_path / "none.json")
    (tmp_path / "x.json").write_text(json.dumps({"something": 1}))
    with pytest.raises(MethodError, match="neither a vLLM speculative config"):
        methods.table_policy_options(tmp_path / "x.json")


def test_paired_speedups_divide_each_repetition_by_plains_own():
    def measured(seconds: list[float], tokens: int) -> bench._Measured:
        outcomes = [runner.Outcome(tokens=[[1] * tokens], seconds=s, target_forwards=0, draft_forwards=0) for s in seconds]
        return bench._Measured(seconds=seconds, outcomes=outcomes)

    plain = measured([10.0, 20.0, 12.0], tokens=30)
    fast = measured([5.0, 8.0, 12.0], tokens=30)
    assert bench.paired_speedups(fast, plain) == pytest.approx([2.0, 2.5, 1.0])
    assert bench.paired_speedups(measured([5.0], tokens=15), measured([10.0], tokens=30)) == pytest.approx([1.0])
    assert report._spread([2.0, 2.5, 1.0]) == "1.00 – 2.50x" and report._spread([1.25]) == "1.25x"
    assert report._spread(None) == "–"


def test_rowmajor_modifier_feeds_the_baselines_output_layer_row_major(pair, monkeypatch):
    parsed = {m.name: m for m in methods.parse_methods("plain,plain+rowmajor,hf-assisted+narrow+rowmajor")}
    assert parsed["plain+rowmajor"].row_major and not parsed["plain+rowmajor"].narrow
    assert parsed["hf-assisted+narrow+rowmajor"].row_major and parsed["hf-assisted+narrow+rowmajor"].narrow
    with pytest.raises(MethodError, match="always feed output layers row-major"):
        methods.parse_method("dynspec-goodput+rowmajor")
    entered: list[int] = []
    original = runner.row_major_output
    monkeypatch.setattr(runner, "row_major_output", lambda *models: entered.append(len(models)) or original(*models))
    settings = bench.BenchSettings(tiny=True, num_prompts=2, batch_sizes=[1], max_new_tokens=6, repetitions=1,
                                   warmup_tokens=0, methods="plain,plain+rowmajor,hf-assisted+rowmajor")
    prompts = random_token_prompts(2, TINY_VOCAB, seed=3)
    results = bench.run_benchmark(settings, target=pair[0], draft=pair[1], prompts=prompts, progress=False)
    runs = {r["method"]: r for r in results["runs"]}
    assert 1 in entered and 2 in entered  # plain: the target's output layer; hf-assisted: the draft's as well
    assert runs["plain+rowmajor"]["matches_plain"] and runs["hf-assisted+rowmajor"]["matches_plain"]


def test_text_modifier_drafts_through_the_targets_tokenizer(pair):
    """`+text` passes the target's tokenizer as both tokenizers: the loop's draft then goes through text (a draft with
    another tokenizer's path) and still matches plain greedy decoding."""
    parsed = {m.name: m for m in methods.parse_methods("plain,dynspec-static:3+text,dynspec-goodput/bf16+text")}
    assert parsed["dynspec-static:3+text"].through_text and parsed["dynspec-static:3+text"].kind == "dynspec"
    assert parsed["dynspec-goodput/bf16+text"].through_text and parsed["dynspec-goodput/bf16+text"].draft_variant
    assert not parsed["plain"].through_text
    for name in ("plain+text", "hf-assisted+text", "dynspec-prompt-lookup+text"):
        with pytest.raises(MethodError, match="dynspec methods with a draft model only"):
            methods.parse_method(name)
    with pytest.raises(MethodError, match="always feed output layers row-major"):
        methods.parse_method("dynspec-goodput+text+narrow")
    prompts = random_token_prompts(3, TINY_VOCAB, seed=4)
    with pytest.raises(ValueError, match="needs the target's tokenizer"):
        runner.Runner(pair[0], pair[1], max_new_tokens=6).run(parsed["dynspec-static:3+text"], prompts, 1,
                                                              progress=False)
    words = word_tokenizer(TINY_VOCAB, {"pad": TINY_PAD, "eos": TINY_EOS})
    run = runner.Runner(pair[0], pair[1], max_new_tokens=6, tokenizer=words)
    plain = run.run(parsed["plain"], prompts, batch_size=3, progress=False)
    outcome = run.run(parsed["dynspec-static:3+text"], prompts, batch_size=3, progress=False)
    assert outcome.tokens == plain.tokens
    assert outcome.draft_forwards > 0
