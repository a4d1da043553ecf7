"""The bench's equivalence check: rows identical to plain, differing at a near tie rounding can flip, or mismatching."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList

import hf_dynspec.loop
from hf_dynspec.evaluation import bench, report
from hf_dynspec.evaluation.data import random_token_prompts
from hf_dynspec.evaluation.equivalence import (
    CONTENDERS,
    TIE_ULPS,
    MarginRecorder,
    RowMargins,
    classify,
    rounding_bound,
    summarize,
    ulp,
)
from hf_dynspec.evaluation.runner import TIME_FIELDS
from hf_dynspec.evaluation.tiny import TINY_EOS, TINY_VOCAB, tiny_pair
from hf_dynspec.verification import tree_outcome, verify_tree_greedy


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run several times faster on one thread than on a shared, oversubscribed CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pair():
    return tiny_pair(seed=0)


# ---- the bound -------------------------------------------------------------------------------------------------------
def test_ulp_and_rounding_bound():
    assert ulp(torch.bfloat16, 1.0) == 2**-7
    assert ulp("bfloat16", 3.0) == 2**-6
    assert ulp(torch.bfloat16, -20.0) == 2**-3
    assert ulp(torch.bfloat16, 0.75) == 2**-8
    assert ulp(torch.float16, 1.0) == 2**-10
    assert ulp(torch.float32, 1.0) == 2**-23
    assert ulp("torch.float32", 40.0) == 2**-18
    assert ulp(torch.float64, 1.0) == 2**-52
    assert rounding_bound(torch.bfloat16, 1.0) == TIE_ULPS * 2**-7
    assert rounding_bound(torch.bfloat16, 17.5) == TIE_ULPS * 2**-3
    assert rounding_bound(torch.float32, 17.5) == TIE_ULPS * 2**-19
    with pytest.raises(ValueError, match="dtype must be one of"):
        rounding_bound("int8", 1.0)


# ---- classify on hand-built rows -------------------------------------------------------------------------------------
def _margins(margin: float, top1_value: float = 3.0, third: float = 1.5) -> RowMargins:
    """Plain's tokens 5 6 7 with runner-ups 8 9 10; the given margin at position 1, large margins elsewhere.

    Token 11 is third best at position 1, `third` below plain's token.
    """
    gaps = [{8: 2.0, 13: 2.5}, {9: margin, 11: max(third, margin)}, {10: 2.0}]
    return RowMargins(top1=[5, 6, 7], runner_up=[8, 9, 10], margin=[2.0, margin, 2.0], top1_value=[3.0, top1_value, 3.0],
                      gaps=gaps)


def test_classify_hand_built_rows():
    reference = [5, 6, 7]
    small, large = 2**-6, 1.0  # one bfloat16 ulp at 3.0, and a margin far beyond rounding
    rows = [
        [5, 6, 7],  # identical
        [5, 9, 4],  # plain's runner-up at a one-ulp margin: near tie (the tail may differ)
        [5, 9, 7],  # the runner-up at a large margin: mismatch
        [5, 11, 7],  # a third token far below plain's token (one ulp between the top two): mismatch
        [5, 6],  # stopped early, no differing token: mismatch
        [5, 6, 7, 12],  # went on past plain's end: mismatch
        [5, 11, 4],  # a third token tied with plain's two best: near tie
        [5, 12, 7],  # a token not among plain's recorded best: mismatch
    ]
    margins = [_margins(small), _margins(small), _margins(large), _margins(small), _margins(small), _margins(small),
               _margins(0.0, third=0.0), _margins(small)]
    verdicts = classify(rows, [reference] * len(rows), margins, torch.bfloat16)
    bound = TIE_ULPS * 2**-6
    assert [v.verdict for v in verdicts] == ["identical", "near_tie", "mismatch", "mismatch", "mismatch", "mismatch",
                                             "near_tie", "mismatch"]
    assert verdicts[0].position is None
    assert (verdicts[1].position, verdicts[1].margin, verdicts[1].bound, verdicts[1].gap) == (1, small, bound, small)
    assert (verdicts[1].plain_token, verdicts[1].runner_up, verdicts[1].token) == (6, 9, 9)
    assert (verdicts[2].position, verdicts[2].margin, verdicts[2].token) == (1, large, 9)
    assert (verdicts[3].runner_up, verdicts[3].token, verdicts[3].gap) == (9, 11, 1.5)
    assert (verdicts[4].position, verdicts[4].plain_token, verdicts[4].token, verdicts[4].gap) == (2, 7, None, None)
    assert (verdicts[5].position, verdicts[5].plain_token, verdicts[5].token) == (3, None, 12)
    assert (verdicts[6].runner_up, verdicts[6].token, verdicts[6].margin, verdicts[6].gap) == (9, 11, 0.0, 0.0)
    assert (verdicts[7].token, verdicts[7].gap) == (12, None)
    # the same one-ulp-of-bfloat16 margin is far beyond rounding in float32
    assert classify([rows[1]], [reference], [_margins(small)], torch.float32)[0].verdict == "mismatch"
    summary = summarize(verdicts, torch.bfloat16, prompts=[10, 11, 12, 13, 14, 15, 16, 17])
    assert (summary["identical"], summary["near_tie"], summary["mismatch"], summary["dtype"]) == (1, 2, 5, "bfloat16")
    assert [r["prompt"] for r in summary["rows"]] == [11, 12, 13, 14, 15, 16, 17]
    assert summary["rows"][0] == {"prompt": 11, "verdict": "near_tie", "position": 1, "margin": small, "bound": bound,
                                  "plain_token": 6, "runner_up": 9, "token": 9, "gap": small}
    with pytest.raises(ValueError, match="one reference row"):
        classify(rows, [reference], margins, torch.bfloat16)


# ---- recording plain greedy decoding ---------------------------------------------------------------------------------
def test_margin_recorder_sees_the_scores_greedy_picks_from(pair):
    target, _ = pair
    prompts = torch.randint(3, TINY_VOCAB, (3, 10), generator=torch.Generator().manual_seed(7))  # no padding
    recorder = MarginRecorder()
    # repetition penalty and min_new_tokens are default processors: the recorder must see their output
    out = target.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=12,
                          do_sample=False, repetition_penalty=3.0, min_new_tokens=12,
                          logits_processor=LogitsProcessorList([recorder]))
    plain = target.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=12,
                            do_sample=False, repetition_penalty=3.0, min_new_tokens=12)
    assert torch.equal(out, plain)  # the recorder changes nothing
    rows = recorder.rows()
    generated = out[:, prompts.shape[1]:].tolist()
    assert len(rows) == 3
    for row, tokens in zip(rows, generated):
        assert row.top1 == tokens and len(row.margin) == 12
        assert all(m >= 0 for m in row.margin) and all(a != b for a, b in zip(row.top1, row.runner_up))
        assert TINY_EOS not in row.runner_up or TINY_EOS not in row.top1  # min_new_tokens masked EOS to -inf
    with pytest.raises(ValueError, match="use a new recorder"):
        recorder(prompts, torch.zeros(3, TINY_VOCAB))


def test_margin_recorder_names_plain_token_at_exact_ties():
    recorder = MarginRecorder()
    scores = torch.tensor([[0.0, 2.0, 2.0, 1.0], [3.0, 1.0, 2.5, 0.0]])  # row 0: tokens 1 and 2 tie
    recorder(torch.zeros(2, 1, dtype=torch.long), scores)
    rows = recorder.rows()
    assert (rows[0].top1, rows[0].runner_up, rows[0].margin) == ([1], [2], [0.0])  # argmax takes the first
    assert rows[0].gaps == [{2: 0.0, 3: 1.0, 0: 2.0}]
    assert (rows[1].top1, rows[1].runner_up, rows[1].margin, rows[1].top1_value) == ([0], [2], [0.5], [3.0])
    assert rows[1].gaps == [{2: 0.5, 1: 2.0, 3: 3.0}]


def test_margin_recorder_keeps_every_token_of_a_tie_of_three():
    recorder = MarginRecorder()
    scores = torch.full((1, 64), -1.0)
    scores[0, [40, 7, 23]] = 2.0  # plain takes 7, the lowest id; 23 and 40 tie with it
    scores[0, 50] = 1.0
    recorder(torch.zeros(1, 1, dtype=torch.long), scores)
    (row,) = recorder.rows()
    assert row.top1 == [7] and row.runner_up[0] in (23, 40) and row.margin == [0.0]
    assert {23: 0.0, 40: 0.0, 50: 1.0}.items() <= row.gaps[0].items() and 7 not in row.gaps[0]
    assert len(row.gaps[0]) == CONTENDERS - 1
    # a speculative run that took either tied token diverged at a near tie
    verdicts = classify([[23], [40], [50]], [[7]] * 3, [row] * 3, torch.bfloat16)
    assert [v.verdict for v in verdicts] == ["near_tie", "near_tie", "mismatch"]


# ---- the bench reports bugs as mismatches -----------------------------------------------------------------------------
def _accepts_one_too_many(scores, tree):
    outcome = verify_tree_greedy(scores, tree)
    rows, children = torch.arange(tree.batch_size), tree.children()
    if children.shape[2] == 0:  # no draft tokens: nothing to accept wrongly
        return outcome
    child = children[rows, outcome.last_node, 0]  # one node past the accepted path, where there is one
    last = torch.where(child >= 0, child, outcome.last_node)
    return tree_outcome(tree, last, scores.argmax(dim=-1)[rows, last])


def _emits_from_the_previous_position(scores, tree):
    outcome = verify_tree_greedy(scores, tree)
    rows = torch.arange(tree.batch_size)
    before = tree.parents[rows, outcome.last_node].clamp(min=0)
    return tree_outcome(tree, outcome.last_node, scores.argmax(dim=-1)[rows, before])


@pytest.mark.parametrize("bug", [_accepts_one_too_many, _emits_from_the_previous_position])
def test_injected_verification_bug_is_a_mismatch(pair, monkeypatch, bug):
    monkeypatch.setattr(hf_dynspec.loop, "verify_tree_greedy", bug)
    settings = bench.BenchSettings(tiny=True, num_prompts=4, batch_sizes=[4], max_new_tokens=12,
                                   methods="plain,dynspec-static:3", repetitions=1, warmup_tokens=0)
    prompts = random_token_prompts(4, TINY_VOCAB, seed=8)
    results = bench.run_benchmark(settings, target=pair[0], draft=pair[1], prompts=prompts, progress=False)
    run = next(r for r in results["runs"] if r["method"] == "dynspec-static:3")
    assert run["matches_plain"] is False and run["mismatches"] > 0
    assert run["equivalence"]["mismatch"] == run["mismatches"] and run["equivalence"]["dtype"] == "float32"
    assert all(row["verdict"] == "mismatch" for row in run["equivalence"]["rows"])
    assert f"/ {run['near_ties']} / {run['mismatches']} |" in report.markdown_table(results)


# ---- bfloat16: near ties, never mismatches ----------------------------------------------------------------------------
def test_bfloat16_runs_differ_only_at_near_ties():
    vocab = 2048  # a wide vocabulary makes near ties among the top logits common enough to occur here
    target, draft = (model.to(torch.bfloat16) for model in tiny_pair(seed=0, vocab_size=vocab))
    settings = bench.BenchSettings(tiny=True, num_prompts=32, batch_sizes=[1, 8, 16], batch_size_prompts={1: 4},
                                   max_new_tokens=24, methods="plain,dynspec-static:2,dynspec-static:4,dynspec-goodput",
                                   repetitions=1, warmup_tokens=0)
    prompts = random_token_prompts(32, vocab, seed=1)
    results = bench.run_benchmark(settings, target=target, draft=draft, prompts=prompts, progress=False)
    speculative = [r for r in results["runs"] if r["method"] != "plain"]
    assert len(speculative) == 9
    for run in speculative:
        equivalence = run["equivalence"]
        assert equivalence["dtype"] == "bfloat16" and run["mismatches"] == 0, equivalence["rows"]
        assert equivalence["identical"] + equivalence["near_tie"] == run["num_prompts"]
        for row in equivalence["rows"]:
            assert row["margin"] <= row["gap"] <= row["bound"] and row["token"] != row["plain_token"]
    # rows did diverge, so the check had to tell near ties apart (and `matches_plain` alone would have failed)
    assert sum(r["near_ties"] for r in speculative) > 0
    assert any(r["matches_plain"] is False for r in speculative)


# ---- time accounting ----------------------------------------------------------------------------------------------------
def test_time_accounting_in_records_and_table(pair):
    settings = bench.BenchSettings(tiny=True, num_prompts=4, batch_sizes=[2], max_new_tokens=10,
                                   methods="plain,hf-assisted,dynspec-static:3", repetitions=2, warmup_tokens=0)
    prompts = random_token_prompts(4, TINY_VOCAB, seed=9)
    results = bench.run_benchmark(settings, target=pair[0], draft=pair[1], prompts=prompts, progress=False)
    runs = {r["method"]: r for r in results["runs"]}
    for name in ("plain", "hf-assisted"):
        assert all(runs[name][field] is None for field in TIME_FIELDS)
    assert runs["hf-assisted"]["equivalence"]["identical"] == 4 and runs["plain"]["equivalence"] is None
    spec = runs["dynspec-static:3"]
    parts = [spec[field] for field in TIME_FIELDS]
    assert all(isinstance(p, float) for p in parts) and all(p > 0 for p in parts[:2] + parts[3:4])
    assert sum(parts[:4]) < sum(parts) <= spec["wall_s_repetitions"][-1]  # the loop's total within the wall time
    steps = next(t for t in results["traces"] if t["method"] == "dynspec-static:3")["steps"]
    assert all("catchup_seconds" in s and "overhead_seconds" in s for s in steps)
    assert sum(s["catchup_seconds"] for s in steps) == pytest.approx(spec["catchup_seconds"])
    table = report.markdown_table(results)
    assert "Where the time goes" in table and "| 2 | dynspec-static:3 |" in table.split("Where the time goes")[1]
    assert "| 2 | hf-assisted |" not in table.split("Where the time goes")[1]


def test_sampled_runs_are_not_checked(pair):
    settings = bench.BenchSettings(tiny=True, num_prompts=2, batch_sizes=[2], max_new_tokens=6, do_sample=True,
                                   methods="plain,dynspec-static:2", repetitions=1, warmup_tokens=0)
    prompts = random_token_prompts(2, TINY_VOCAB, seed=10)
    results = bench.run_benchmark(settings, target=pair[0], draft=pair[1], prompts=prompts, progress=False)
    spec = next(r for r in results["runs"] if r["method"] == "dynspec-static:2")
    assert spec["equivalence"] is None and spec["near_ties"] is None and spec["mismatches"] is None
    table = report.markdown_table(results)
    assert "| n/a (sampling) |" in table and "not compared token by token" in table
