"""How much can prompt lookup, suffix trees, or a token tree add to a draft model's chain at best? Oracle schedules
along the target's greedy output.

Decodes each prompt greedily with the target alone, runs the draft once over the result, and finds, by dynamic
programming over the positions, the fastest schedule of verifies a method could choose with hindsight: chains of the
draft model (with draft lookahead); the same, or prompt lookup alone (no draft forward); the same, or what suffix trees
over the text and a cache of every other prompt's output could propose right (`copy_matches`, the `suffix` proposer);
each model-free proposer alone; and trees of the draft's first `b` choices per node (`--branching`). Steps are priced
with a calibration profile (`hf-dynspec calibrate`). The ratio to the chain bounds what a hybrid proposer, suffix
trees beside the draft (`proposer="suffix"` with an assistant model), or a tree can add.

    python evaluation/lookup_headroom.py --dataset codeedit --num-prompts 16 --max-new-tokens 256 \
        --traces /tmp/codeedit_traces.json --out docs/benchmarks/lookup_headroom_codeedit.json
    python evaluation/lookup_headroom.py --dataset humaneval --num-prompts 16 --max-new-tokens 128 \
        --traces /tmp/humaneval_traces.json --branching 2,3,4 --max-nodes 32

Traces are cached in `--traces` (computed when the file does not exist yet); `--max-new-tokens` cuts cached traces
shorter.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from tqdm.auto import tqdm

from hf_dynspec.calibration import parse_int_list
from hf_dynspec.candidates.suffix import SuffixSettings
from hf_dynspec.cost_models import Profile, ProfileCostModel
from hf_dynspec.evaluation.headroom import (
    GreedyTrace,
    OracleCosts,
    OracleSchedule,
    copy_matches,
    fastest_schedule,
    greedy_traces,
)


def load_traces(args: argparse.Namespace) -> list[GreedyTrace]:
    path = Path(args.traces)
    if path.exists():  # greedy decoding: the first tokens of a longer trace are the trace at fewer tokens
        cut = args.max_new_tokens
        return [
            GreedyTrace(**{k: v if k == "prompt" or v is None else v[:cut] for k, v in t.items()})
            for t in json.loads(path.read_text())["traces"]
        ]
    from hf_dynspec.evaluation.bench import load_inputs
    from hf_dynspec.evaluation.settings import BenchSettings

    settings = BenchSettings(dataset=args.dataset, num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens)
    target, draft, prompts = load_inputs(settings)
    traces = greedy_traces(target, draft, prompts, args.max_new_tokens)
    meta = {"dataset": args.dataset, "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens,
            "dtype": str(target.dtype)}
    path.write_text(json.dumps({"config": meta, "traces": [t.to_dict() for t in traces]}))
    return traces


def schedule(
    trace: GreedyTrace, copies: list[int], costs: OracleCosts, suffix: bool = False, draft: bool = True, **options
) -> OracleSchedule:
    """One variant's oracle schedule: suffix trees' right tokens (`copies`) in place of prompt lookup's with `suffix`,
    no draft model without `draft`."""
    costs = costs if draft else dataclasses.replace(costs, max_draft=0)
    return fastest_schedule(trace, costs, free=copies if suffix else None, **options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="codeedit")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--traces", required=True, help="JSON cache of the greedy traces.")
    parser.add_argument("--traces-only", action="store_true", help="Compute the traces and stop.")
    parser.add_argument("--profile", default="docs/benchmarks/profile_bf16.json")
    parser.add_argument("--draft-scale", type=float, default=1.0, help="Multiply the profile's draft forward cost.")
    parser.add_argument("--lookahead", type=int, default=8, help="Guess tokens a draft forward carries.")
    parser.add_argument("--max-draft", type=int, default=24, help="Most draft tokens in one step.")
    parser.add_argument("--max-lookup", type=int, default=24, help="Most prompt-lookup tokens in one step.")
    parser.add_argument("--branching", default="", help="Comma-separated: trees of the draft's first b choices.")
    parser.add_argument("--max-nodes", type=int, default=32, help="Most tree nodes in one step.")
    parser.add_argument("--suffix-depth", type=int, default=SuffixSettings.max_depth, help="Longest suffix match.")
    parser.add_argument("--suffix-spec-factor", type=float, default=SuffixSettings.max_spec_factor,
                        help="Most suffix tokens proposed per matched token.")
    parser.add_argument("--out")
    args = parser.parse_args()
    traces = load_traces(args)
    if args.traces_only:
        return
    model = ProfileCostModel(Profile.load(args.profile))
    costs = OracleCosts.from_cost_model(model, args.lookahead, args.max_draft, args.max_lookup, args.draft_scale)
    branchings = parse_int_list(args.branching, "--branching") if args.branching else []
    variants = [("draft", {}), ("draft+lookup", {"lookup": True})]
    variants += [(f"tree:top{b}", {"branching": b, "max_nodes": args.max_nodes}) for b in branchings]
    copies = [  # suffix trees over each text and a cache holding every other prompt's output
        copy_matches(t, args.max_lookup, [o.new for o in traces if o is not t], args.suffix_depth, args.suffix_spec_factor)
        for t in tqdm(traces, desc="suffix matches")
    ]
    variants += [("lookup", {"lookup": True, "draft": False}), ("suffix", {"suffix": True, "draft": False})]
    variants += [("draft+suffix", {"suffix": True})]
    rows = {}
    for name, options in variants:
        schedules = [schedule(t, c, costs, **options) for t, c in zip(traces, copies)]
        rows[name] = {
            "seconds": sum(s.seconds for s in schedules),
            "verifies": sum(s.verifies for s in schedules),
            "draft_forwards": sum(s.draft_forwards for s in schedules),
            "lookup_steps": sum(s.lookup_steps for s in schedules),
            "new_tokens": sum(len(t.new) for t in traces),
        }
    plain = sum(costs.verify(1) * (len(t.new) - 1) for t in traces)
    rows["plain"] = {"seconds": plain}
    for name, row in rows.items():
        print(f"{name:>14}: {row['seconds']:8.2f} s  {plain / row['seconds']:.3f}x plain  "
              + "  ".join(f"{k}={v}" for k, v in row.items() if k != "seconds"))
    for name in rows:
        if name not in ("draft", "plain"):
            print(f"{name} adds at most {rows['draft']['seconds'] / rows[name]['seconds']:.3f}x to the draft's chain")
    if args.out:
        Path(args.out).write_text(json.dumps({"config": vars(args), "oracle": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
