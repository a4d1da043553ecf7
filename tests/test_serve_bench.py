"""The serve scenario of `hf-dynspec bench`: Poisson arrivals into transformers' continuous batching, the same
trace for every method, per-request latency, TTFT and TPOT, and the latency plot."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from conftest import tiny_model
from transformers import GenerationConfig

from hf_dynspec.cli import main
from hf_dynspec.commands.bench import _rate_list
from hf_dynspec.evaluation.serve import ServeMethod, arrival_rates, arrival_times, classify_requests, serve_table


def test_arrivals_are_poisson_and_repeatable():
    times = arrival_times(4000, rate=2.0, seed=7)
    assert times == arrival_times(4000, rate=2.0, seed=7) and times != arrival_times(4000, rate=2.0, seed=8)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0.0 and all(gap >= 0 for gap in gaps)
    assert abs(sum(gaps) / len(gaps) - 0.5) < 0.03  # mean gap 1 / rate
    assert arrival_times(3, rate=float("inf"), seed=0) == [0.0, 0.0, 0.0]


def test_serve_method_names():
    assert ServeMethod.parse("cb-plain") == ServeMethod("cb-plain")
    assert ServeMethod.parse("cb-suffix") == ServeMethod("cb-suffix", "suffix", "goodput", 4)
    assert ServeMethod.parse("cb-lookup-static:3") == ServeMethod("cb-lookup-static:3", "lookup", "static", 3)
    assert ServeMethod.parse("cb-draft-static:2") == ServeMethod("cb-draft-static:2", "draft", "static", 2)
    assert ServeMethod.parse("cb-suffix:3:8") == ServeMethod("cb-suffix:3:8", "suffix", "goodput", 3, 8)
    assert ServeMethod.parse("cb-draft-static:3:6") == ServeMethod("cb-draft-static:3:6", "draft", "static", 3, 6)
    assert ServeMethod.parse("cb-suffix+draft:3:8").tree_nodes == 8
    hybrid = ServeMethod.parse("cb-suffix+draft-static:3")
    assert hybrid == ServeMethod("cb-suffix+draft-static:3", "suffix+draft", "static", 3) and hybrid.needs_draft
    assert not ServeMethod.parse("cb-suffix").needs_draft and ServeMethod.parse("cb-draft").needs_draft
    proposers = {name: ServeMethod.parse(name).dynspec_config()["proposer"]
                 for name in ("cb-default", "cb-draft", "cb-hybrid", "cb-suffix+draft", "cb-lookup")}
    assert proposers == {"cb-default": "auto", "cb-draft": "draft", "cb-hybrid": "hybrid", "cb-suffix+draft": "suffix",
                         "cb-lookup": "auto"}
    assert all(ServeMethod.parse(name).needs_draft for name in ("cb-default", "cb-hybrid"))
    bad_names = ("cb-model", "cb-suffix-fast", "cb-lookup:0", "plain", "cb-lookup:3:4:5", "cb-suffix:3:0",
                 "cb-draft:x")
    for bad in bad_names:
        with pytest.raises(ValueError, match="(?i)serve method"):
            ServeMethod.parse(bad)


@pytest.mark.slow
def test_a_tiny_serve_run_measures_every_request_and_matches_plain(tmp_path):
    out, plots = tmp_path / "serve.json", tmp_path / "plots"
    code = main(["bench", "--scenario", "serve", "--tiny", "--num-prompts", "5", "--max-new-tokens", "12",
                 "--repetitions", "1", "--rates", "20,200",
                 "--methods", "cb-lookup-static:3,cb-suffix:4:8,cb-suffix+draft-static:2",
                 "--out", str(out), "--plots", str(plots), "--quiet"])
    assert code == 0
    results = json.loads(out.read_text())
    assert results["rates"] == [20.0, 200.0] and results["capacity_requests_per_s"] > 0
    assert {(r["method"], r["rate"]) for r in results["runs"]} == {
        (m, r)
        for m in ("cb-plain", "cb-lookup-static:3", "cb-suffix:4:8", "cb-suffix+draft-static:2")
        for r in (20.0, 200.0)
    }
    for run in results["runs"]:
        assert len(run["requests"]) == 5 and run["tokens_per_s"] > 0
        for request in run["requests"]:
            assert 0 < request["ttft_s"] <= request["latency_s"] and len(request["tokens"]) >= 1
        if "static" in run["method"]:
            assert run["speculation"]["draft_tokens"] > 0
    every_request = {"identical": 10, "near_tie": 0, "mismatch": 0, "dtype": "float32", "rows": []}  # 5 x 2 rates
    assert results["equivalence"] == {"cb-plain": every_request, "cb-lookup-static:3": every_request,
                                      "cb-suffix:4:8": every_request, "cb-suffix+draft-static:2": every_request}
    assert "| 20.000 | cb-suffix:4:8 |" in serve_table(results)
    assert (plots / "serve_latency.png").stat().st_size > 0


@pytest.mark.slow
def test_a_tiny_serve_run_through_servers_says_where_the_time_goes(tmp_path):
    """`--through server`: the same requests at once through generate, continuous batching and plain
    `transformers serve`, plain and speculating, then the rate through both servers; every path answers as plain
    `generate`, and the speculating server's stats lines give its draft and accepted tokens and its seconds."""
    out = tmp_path / "served.json"
    code = main(["bench", "--scenario", "serve", "--tiny", "--through", "server", "--num-prompts", "2",
                 "--max-new-tokens", "8", "--repetitions", "1", "--rates", "20", "--methods", "cb-draft-static:2",
                 "--out", str(out), "--quiet"])
    assert code == 0
    results = json.loads(out.read_text())
    paths = [(row["path"], row["method"]) for row in results["burst"]]
    assert paths == [(path, method) for path in ("generate", "continuous batching", "server")
                     for method in ("cb-plain", "cb-draft-static:2")]
    assert all(row["same_as_generate"] == 2 and row["generated"] > 0 for row in results["burst"])
    server = results["burst"][-1]
    assert server["draft_tokens"] > 0 and server["accepted_tokens"] > 0 and server["forward_seconds"] > 0
    assert [(row["method"], row["rate"]) for row in results["summary"]] == [("cb-plain", 20.0),
                                                                           ("cb-draft-static:2", 20.0)]
    for run in results["runs"]:
        assert len(run["requests"]) == 2 and run["tokens_per_s"] > 0
        assert all(0 < r["ttft_s"] <= r["latency_s"] and r["generated"] >= 1 for r in run["requests"])
    assert results["same_text_as_plain"]["cb-draft-static:2"] == {"same": 2, "different": 0}
    assert results["runs"][1]["speculation"]["draft_tokens"] > 0


def test_requests_are_classified_against_plain_generate():
    """A request equal to plain `generate`'s is identical; one whose token is not within rounding of plain's best is a
    mismatch (float64: a near tie needs a gap of a few ulps, which random logits do not give)."""
    model = tiny_model("llama", seed=0)
    config = GenerationConfig(do_sample=False, max_new_tokens=6, eos_token_id=None, pad_token_id=0)
    prompts = [[3, 5, 7, 9], [4, 4, 8]]
    plain = [model.generate(torch.tensor([p]), generation_config=config)[0, len(p):].tolist() for p in prompts]
    wrong = [plain[0][:2] + [(plain[0][2] + 1) % model.config.vocab_size] + plain[0][3:], plain[1]]
    runs = [{"method": "cb-plain", "rate": 1.0, "repetition": 0, "requests": [{"tokens": t} for t in plain]},
            {"method": "cb-bad", "rate": 1.0, "repetition": 2, "requests": [{"tokens": t} for t in wrong]}]
    verdicts = classify_requests(model, prompts, runs, config)
    assert verdicts["cb-plain"] == {"identical": 2, "near_tie": 0, "mismatch": 0, "dtype": "float64", "rows": []}
    bad = verdicts["cb-bad"]
    assert (bad["identical"], bad["near_tie"], bad["mismatch"]) == (1, 0, 1)
    [row] = bad["rows"]  # the divergent request, where it diverged and plain's margin there
    assert (row["rate"], row["repetition"], row["prompt"], row["position"], row["verdict"]) == (1.0, 2, 0, 2, "mismatch")
    assert row["plain_token"] == plain[0][2] and row["margin"] > row["bound"] > 0


def test_rates_are_requests_per_second_or_shares_of_capacity():
    assert _rate_list("0.5x, 1x,2") == ["0.5x", "1.0x", 2.0]
    assert arrival_rates(_rate_list("0.5x,1x,3"), capacity=4.0) == [2.0, 3.0, 4.0]
    for bad in ("0,1", "fast", "-1x", ","):
        with pytest.raises(argparse.ArgumentTypeError):
            _rate_list(bad)
