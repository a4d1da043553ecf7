"""How often the target takes a draft tree's nodes, by the draft's path probability, and what a node floor saves.

Runs a tree method with the target in memory on the offload scenario's prompts (greedy output does not depend on
where the weights live), records every tree it proposes and marks the nodes the target's output then took. It prints
the share of nodes taken per probability bin, leaves and inner nodes apart; the same per bin of a node's probability
given its parent, for the draft's first, second and later choices apart (how calibrated the draft is); and for each
floor the tokens the same trees would have accepted without their nodes below it
(`DynSpecConfig.tree_min_node_probability`) and the seconds per token, each verify priced from the offload profile by
its width and each draft forward at `--draft-seconds`.
It is hindsight: later steps stay as they were, so a floor that loses tokens looks a little better than it would run.

    python evaluation/probes/tree_node_floor.py --dataset sharegpt --floors 0,0.01,0.02,0.05 --out /tmp/floor.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from hf_dynspec.candidates import DraftTreeProposer
from hf_dynspec.evaluation.bench import load_inputs
from hf_dynspec.evaluation.methods import parse_method, parse_policy_options
from hf_dynspec.evaluation.runner import Runner
from hf_dynspec.evaluation.settings import SCENARIOS, BenchSettings

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the replay script beside this one
from offload_replay import PROFILES, batch1_forwards, with_profile  # noqa: E402

BINS = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.4, 0.7, 0.9, 1.0)
"""Edges of the path-probability bins of the calibration table."""
CHILD_BINS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
"""Edges of the bins of a node's draft probability given its parent, in the table by sibling rank."""
RANKS = 3
"""Sibling ranks told apart in that table; the last one gathers every rank from it on."""
PREFILL_SECONDS = 0.85
"""An offloaded prefill of a scenario prompt without drafts (`docs/benchmarks/history.md`, row-major probe)."""


@contextmanager
def recorded_trees(store: list[dict]):
    """While active, every greedy tree a `DraftTreeProposer` proposes at batch 1 is appended to `store`: the tokens
    generated before it (`generated`), the draft forwards so far (`forwards`) and its nodes' `paths` and log `values`."""
    select = DraftTreeProposer._select

    def recording(self, candidates, budgets, fed_columns, q_store, batch):
        proposal = select(self, candidates, budgets, fed_columns, q_store, batch)
        keys = candidates.values[0]  # [created] log path probabilities, -inf where not proposable
        order = keys.sort(descending=True, stable=True).indices[: int(proposal.lengths[0])]  # the proposed nodes
        depths = candidates.depths[0, order].tolist()
        store.append({
            "generated": int(batch.num_generated[0]), "forwards": self.forwards, "values": keys[order].tolist(),
            "paths": [candidates.paths[0, i, :d].tolist() for i, d in zip(order.tolist(), depths)],
        })
        return proposal

    DraftTreeProposer._select = recording
    try:
        yield store
    finally:
        DraftTreeProposer._select = select


def node_outcomes(tree: dict, output: list[int]) -> list[tuple[float, int, bool, bool]]:
    """Per node of a recorded `tree`: (path probability, depth, taken by the target's `output`, is a leaf)."""
    start, paths = tree["generated"], [tuple(p) for p in tree["paths"]]
    parents = {p[:-1] for p in paths}
    return [
        (math.exp(v), len(p), list(p) == output[start : start + len(p)], p not in parents)
        for p, v in zip(paths, tree["values"])
    ]


def taken_shares(outcomes: Iterable[tuple[str, float, bool]], groups: list[str], edges: tuple[float, ...]) -> dict:
    """Per group, per probability bin of `edges` (the top edge included in the last bin): the nodes and the share the
    target took, from `(group, probability, taken)` outcomes. Empty bins are left out."""
    counts = {group: np.zeros((len(edges) - 1, 2)) for group in groups}
    for group, probability, taken in outcomes:
        column = min(int(np.searchsorted(edges, probability, side="right")) - 1, len(edges) - 2)
        counts[group][column] += (1, taken)
    return {
        group: [{"low": edges[i], "high": edges[i + 1], "nodes": int(n), "taken": t / n}
                for i, (n, t) in enumerate(table) if n]
        for group, table in counts.items()
    }


def calibration(runs: list[dict]) -> dict[str, list[dict]]:
    """Nodes and the share the target took, per path-probability bin, for leaves and inner nodes."""
    outcomes = (("leaf" if leaf else "inner", probability, taken)
                for run in runs for tree in run["trees"]
                for probability, _, taken, leaf in node_outcomes(tree, run["output"]))
    return taken_shares(outcomes, ["leaf", "inner"], BINS)


def child_outcomes(tree: dict, output: list[int]) -> list[tuple[float, int, bool]]:
    """Per node of a recorded `tree` whose parent the target's `output` took (the root counts as taken): (the draft's
    probability of the node given its parent, its rank among its proposed siblings from 0 = the draft's first choice,
    taken). A tree keeps its most valuable candidates, so a kept node's better siblings are kept too and the rank among
    proposed siblings is the draft's rank."""
    start, paths = tree["generated"], [tuple(p) for p in tree["paths"]]
    values = dict(zip(paths, tree["values"]))
    outcomes = []
    for path, value in values.items():
        parent = path[:-1]
        if list(parent) != output[start : start + len(parent)]:
            continue
        rank = sum(other > value for sibling, other in values.items() if sibling[:-1] == parent)
        taken = list(path) == output[start : start + len(path)]
        outcomes.append((math.exp(value - values.get(parent, 0.0)), rank, taken))
    return outcomes


def rank_calibration(runs: list[dict]) -> dict[str, list[dict]]:
    """Nodes whose parent the target took, and the share of them it took, per bin of the draft's probability given
    the parent, for the draft's first, second and later choices apart. A calibrated draft takes about the middle of
    each bin."""
    names = [f"choice {r + 1}" for r in range(RANKS - 1)] + [f"choice {RANKS}+"]
    outcomes = ((names[min(rank, RANKS - 1)], probability, taken)
                for run in runs for tree in run["trees"]
                for probability, rank, taken in child_outcomes(tree, run["output"]))
    return taken_shares(outcomes, names, CHILD_BINS)


def with_floor(runs: list[dict], floor: float, verify, draft_seconds: float) -> dict[str, float]:
    """Tokens, mean proposed nodes and priced seconds per token if every tree had dropped its nodes below `floor`
    (keeping its best one). `verify(n)`: seconds of a target forward over `n` new tokens; a prefill that verifies the
    first tree costs `PREFILL_SECONDS` plus that tree's width."""
    tokens, nodes, seconds, steps = 0, 0, 0.0, 0
    for run in runs:
        forwards = 0
        for tree in run["trees"]:
            outcomes = node_outcomes(tree, run["output"])
            kept = [o for i, o in enumerate(outcomes) if i == 0 or o[0] >= floor]
            accepted = max((depth for _, depth, taken, _ in kept if taken), default=0)
            target = verify(1 + len(kept))
            if tree["generated"] == 0:  # verified by the prefill: the prompt's forward and the tree's width
                target += PREFILL_SECONDS - verify(1)
            seconds += target + draft_seconds * (tree["forwards"] - forwards)
            forwards, tokens, nodes, steps = tree["forwards"], tokens + accepted + 1, nodes + len(kept), steps + 1
    return {"floor": floor, "tokens": tokens, "mean_nodes": nodes / max(steps, 1), "ms_per_token": 1e3 * seconds / tokens}


def record_runs(runner: Runner, method, prompts: list[list[int]]) -> list[dict]:
    """Each prompt's output and the trees proposed along it, one prompt at a time, after an untimed warm-up."""
    runner.prepare(method)
    runner.run(method, prompts[:1], 1, max_new_tokens=8, progress=False)
    runs = []
    for prompt in prompts:
        with recorded_trees([]) as trees:
            outcome = runner.run(method, [prompt], 1, progress=False)
        runs.append({"output": outcome.tokens[0], "trees": trees})
    return runs


def main() -> None:
    args = _arguments()
    options = with_profile(parse_policy_options(args.policy_option, SCENARIOS["offload"]["policy_options"]),
                           [args.method], args.offload_profile)
    method = parse_method(args.method, options)
    settings = BenchSettings(dataset=args.dataset, num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens)
    target, draft, prompts = load_inputs(settings)
    runner = Runner(target, draft, args.max_new_tokens)
    try:
        runs = record_runs(runner, method, prompts)
    finally:
        runner.close()
    offloaded = batch1_forwards(args.offload_profile)
    tokens, seconds = zip(*sorted((n, s) for n, s in offloaded.items() if n > 1))  # the first forward ran cold

    def verify(n: int) -> float:
        return float(np.interp(max(n, 2), tokens, seconds))

    table, by_rank = calibration(runs), rank_calibration(runs)
    floors = [with_floor(runs, float(f), verify, args.draft_seconds) for f in args.floors.split(",")]
    for name, rows in [*table.items(), *((f"{k}, given the parent", v) for k, v in by_rank.items())]:
        print(name + ":", ", ".join(f"[{r['low']}, {r['high']}) {r['nodes']} nodes {r['taken']:.3f} taken" for r in rows))
    for row in floors:
        print(f"floor {row['floor']}: {row['tokens']} tokens, {row['mean_nodes']:.1f} nodes per tree, "
              f"{row['ms_per_token']:.1f} ms per token")
    if args.out:
        args.out.write_text(json.dumps({"method": args.method, "dataset": args.dataset, "calibration": table,
                                        "by_rank": by_rank, "floors": floors}, indent=1))


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="dynspec-tree:32:40")
    parser.add_argument("--policy-option", action="append", default=[], metavar="POLICY.OPTION=VALUE")
    parser.add_argument("--dataset", default="humaneval")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--floors", default="0,0.005,0.01,0.02,0.03,0.05,0.08,0.1")
    parser.add_argument("--draft-seconds", type=float, default=0.048, help="Seconds of a draft forward.")
    parser.add_argument("--offload-profile", type=Path, default=PROFILES / "profile_offload_bf16.json")
    parser.add_argument("--out", type=Path)
    return parser.parse_args()


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
