"""The hindsight study of tree node floors (`evaluation/probes/tree_node_floor.py`): which nodes the target took, and what
the same trees would have accepted and cost without their unlikely nodes."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import evaluation_script, perturbed, tiny_model

from hf_dynspec.evaluation.methods import parse_method
from hf_dynspec.evaluation.runner import Runner


@pytest.fixture(scope="module")
def study():
    return evaluation_script("tree_node_floor")


def tree(generated: int, forwards: int, nodes: dict[tuple[int, ...], float]) -> dict:
    return {"generated": generated, "forwards": forwards, "paths": [list(p) for p in nodes],
            "values": [math.log(q) for q in nodes.values()]}


RUNS = [{
    "output": [5, 6, 7, 8, 9, 10],
    "trees": [
        # prefill tree: the target takes 5 then 6 (a sibling the draft gave 0.03); 3 is a wrong leaf
        tree(0, 2, {(5,): 0.9, (5, 1): 0.6, (5, 6): 0.03, (3,): 0.05}),
        # after 5 6 7 (the prefill's accepted 2 and its bonus): 8 then 9, and the bonus 10
        tree(3, 5, {(8,): 0.8, (8, 9): 0.7, (4,): 0.01}),
    ],
}]


def test_node_outcomes_mark_the_targets_path(study):
    outcomes = study.node_outcomes(RUNS[0]["trees"][0], RUNS[0]["output"])
    assert [(round(p, 3), d, taken, leaf) for p, d, taken, leaf in outcomes] == [
        (0.9, 1, True, False), (0.6, 2, False, True), (0.03, 2, True, True), (0.05, 1, False, True)]


def test_floors_trade_tokens_for_narrower_verifies(study):
    verify = lambda n: 0.4 + 0.01 * n  # noqa: E731
    none, low, high = (study.with_floor(RUNS, f, verify, draft_seconds=0.05) for f in (0.0, 0.02, 0.04))
    assert (none["tokens"], low["tokens"], high["tokens"]) == (6, 6, 5)  # 0.04 drops the taken 0.03 sibling
    assert (none["mean_nodes"], low["mean_nodes"], high["mean_nodes"]) == (3.5, 3.0, 2.5)
    prefill = study.PREFILL_SECONDS - verify(1)
    seconds = verify(1 + 4) + prefill + verify(1 + 3) + 0.05 * 5
    assert none["ms_per_token"] == pytest.approx(1e3 * seconds / 6)
    table = study.calibration(RUNS)
    assert sum(r["nodes"] for rows in table.values() for r in rows) == 7
    assert [r["taken"] for r in table["inner"]] == [1.0, 1.0]  # 5 and 8 have children, both taken


def test_recorded_trees_follow_a_real_run(study):
    target = tiny_model("qwen2", seed=0)
    draft = perturbed(target, scale=0.05)
    runner = Runner(target, draft, 16)
    options = {"static@t": {"tree_node_budget": 8, "tree_branching": 3, "tree_min_node_probability": 0.05}}
    method = parse_method("dynspec-static@t:4", options)
    prompts = [torch.randint(3, 100, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (6, 9)]
    try:
        runs = study.record_runs(runner, method, prompts)
    finally:
        runner.close()
    for run in runs:
        assert run["trees"]
        generated = [t["generated"] for t in run["trees"]]
        assert generated == sorted(set(generated)) and generated[-1] < len(run["output"])
        assert all(v >= math.log(0.05) for t in run["trees"] for v in t["values"][1:])  # the floor held
        # a step emits the path the target took and a bonus token: exactly where the next tree starts
        for this, following in zip(run["trees"], run["trees"][1:]):
            taken = [depth for _, depth, hit, _ in study.node_outcomes(this, run["output"]) if hit]
            assert following["generated"] - this["generated"] == max(taken, default=0) + 1
            assert sorted(taken) == list(range(1, len(taken) + 1))  # one node per depth: a path
    row = study.with_floor(runs, 0.0, lambda n: 1.0, draft_seconds=0.0)
    assert study.with_floor(runs, 0.5, lambda n: 1.0, 0.0)["mean_nodes"] < row["mean_nodes"]


def test_rank_calibration_conditions_on_the_taken_parent(study):
    outcomes = study.child_outcomes(RUNS[0]["trees"][0], RUNS[0]["output"])
    # 5 (first choice, taken), 3 (second, not taken); under the taken 5: 1 (first, 0.6/0.9) and 6 (second, taken)
    assert [(round(q, 3), rank, taken) for q, rank, taken in outcomes] == [
        (0.9, 0, True), (0.667, 0, False), (0.033, 1, True), (0.05, 1, False)]
    untaken_parent = {"generated": 0, "forwards": 1, "paths": [[4], [4, 5]], "values": [math.log(0.5), math.log(0.4)]}
    assert [(round(q, 3), rank, taken) for q, rank, taken in study.child_outcomes(untaken_parent, RUNS[0]["output"])] \
        == [(0.5, 0, False)]  # 4 5 is not judged: its parent 4 was not taken
    table = study.rank_calibration(RUNS)
    assert list(table) == ["choice 1", "choice 2", "choice 3+"]
    first = {(r["low"], r["high"]): (r["nodes"], r["taken"]) for r in table["choice 1"]}
    # 5 (0.9) and 8 (0.8) taken; 1 (0.667) not; 9 (0.7 / 0.8 = 0.875) taken
    assert first == {(0.6, 0.7): (1, 0.0), (0.8, 0.9): (2, 1.0), (0.9, 0.95): (1, 1.0)}
    second = table["choice 2"]  # 6 (0.033) taken and 4 (0.01) not, in the lowest bin; 3 (0.05, on an edge) not taken
    assert second[0]["high"] == 0.05 and round(second[0]["nodes"] * second[0]["taken"]) == 1
    assert sum(r["nodes"] for r in second) == 3 and round(sum(r["nodes"] * r["taken"] for r in second)) == 1
    assert table["choice 3+"] == []
