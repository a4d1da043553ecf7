"""Price methods as if the target were offloaded, from a faster run with the target in memory.

Greedy output does not depend on where the weights live, and a `goodput` policy given the offload profile
(`cost_model='profile'`) takes the decisions it would take offloaded. So each method runs here with the target in
memory on the offload scenario's prompts, and every target forward's in-memory time is replaced by its offloaded price:

- a forward over `n <= 33` new tokens: the offload profile's time, interpolated over the token counts it timed
  (from 2 tokens up: its first forward ran cold);
- a longer one (a prefill): its in-memory time plus `read seconds`, the median difference between the offload and the
  in-memory profiles over the token counts both timed (reading the offloaded weights).

Draft forwards and the loop's own work keep their measured times (the draft is not offloaded): that is the *priced*
time. The *counted* time leaves out every measured second: the target's offloaded prices plus the draft forwards
counted at the profile's price of one, so it does not move with the machine's speed (it misses the loop's own work
and the width of the draft's forwards). A run takes minutes instead of the scenario's half hour, so tree shapes and
stops can be compared before a real run confirms the best (see docs/benchmarks/history.md, "A replay of the offload scenario
in memory").

    python evaluation/probes/offload_replay.py --methods hf-assisted+rowmajor,dynspec-tree:32:40,dynspec-tree@b2:32:40 \
      --policy-option tree@b2.tree_branching=2 --out /tmp/replay.json

Methods start from the offload scenario's policy options (`dynspec-tree` as the scenario runs it; a tagged method such
as `dynspec-tree@b2` from none, as in the bench). Every dynspec method gets `cost_model='profile'` with the offload
profile unless its options set a cost model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from hf_dynspec.evaluation.bench import load_inputs
from hf_dynspec.evaluation.methods import parse_method, parse_policy_options
from hf_dynspec.evaluation.runner import Runner
from hf_dynspec.evaluation.settings import SCENARIOS, BenchSettings

GOODPUT_METHODS = ("goodput", "tree", "hybrid", "tree-lookup")
"""Methods run by the `goodput` policy."""
PROFILES = Path(__file__).resolve().parents[2] / "docs" / "benchmarks"


def batch1_forwards(path: Path) -> dict[int, float]:
    """A profile's batch-1 target forward seconds by new tokens per row."""
    rows = json.loads(path.read_text())["target_forward"]
    return {r["tokens_per_row"]: r["seconds"] for r in rows if r["batch_size"] == 1}


def read_seconds(offloaded: dict[int, float], in_memory: dict[int, float]) -> float:
    """Median extra seconds of an offloaded target forward over the token counts both profiles timed."""
    common = sorted(set(offloaded) & set(in_memory) - {1})  # one token: the first forward of a profile runs cold
    if not common:
        raise ValueError("The offload and in-memory profiles share no batch-1 token count above 1.")
    return statistics.median(offloaded[n] - in_memory[n] for n in common)


class OffloadPricer:
    """Times every forward of the target (hooks on its top module) and prices it as if offloaded."""

    def __init__(self, target: torch.nn.Module, offloaded: dict[int, float], read: float) -> None:
        self.tokens = np.array(sorted(n for n in offloaded if n > 1), dtype=np.float64)
        self.seconds = np.array([offloaded[int(n)] for n in self.tokens])
        self.read, self.measured, self.priced, self._start = read, 0.0, 0.0, 0.0
        self.prefills: list[float] = []  # in-memory seconds of each forward priced as a prefill
        self._handles = [
            target.register_forward_pre_hook(self._before, with_kwargs=True),
            target.register_forward_hook(self._after, with_kwargs=True),
        ]

    def _before(self, module, args, kwargs) -> None:
        self._width = int((kwargs.get("input_ids") if "input_ids" in kwargs else args[0]).shape[1])
        self._start = time.perf_counter()

    def _after(self, module, args, kwargs, output) -> None:
        seconds = time.perf_counter() - self._start
        self.measured += seconds
        if self._width <= self.tokens[-1]:
            self.priced += float(np.interp(max(self._width, self.tokens[0]), self.tokens, self.seconds))
        else:
            self.priced += seconds + self.read
            self.prefills.append(seconds)

    def take(self) -> tuple[float, float]:
        """Since the last call: the target forwards' offloaded price, and the seconds to add to a run's measured time
        (that price minus their in-memory time)."""
        priced, change = self.priced, self.priced - self.measured
        self.measured, self.priced = 0.0, 0.0
        return priced, change

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def with_profile(options: dict[str, dict], names: list[str], profile: Path) -> dict[str, dict]:
    """Policy options in which every dynspec policy prices steps with `profile`, unless it names a cost model."""
    options = {key: dict(value) for key, value in options.items()}
    for name in names:
        key = name.removeprefix("dynspec-").split(":")[0].split("/")[0]  # how `methods` finds a method's options
        if name.startswith("dynspec-") and key.split("@")[0] in GOODPUT_METHODS:
            options.setdefault(key, {}).setdefault("cost_model", "profile")
            if options[key]["cost_model"] == "profile":
                options[key].setdefault("profile", str(profile))
    return options


def main() -> None:
    args = _arguments()
    names = [n.strip() for n in args.methods.split(",") if n.strip()]
    scenario = SCENARIOS["offload"]["policy_options"]  # as `hf-dynspec bench --scenario offload` runs them
    options = with_profile(parse_policy_options(args.policy_option, scenario), names, args.offload_profile)
    methods = [parse_method(name, options) for name in names]  # no plain: methods are compared with the first
    fields = {f.name for f in dataclasses.fields(BenchSettings)}
    preset = {k: v for k, v in SCENARIOS["offload"].items() if k in fields and "offload" not in k and "memory" not in k}
    settings = BenchSettings(**{**preset, "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens})
    target, draft, prompts = load_inputs(settings)
    offloaded = batch1_forwards(args.offload_profile)
    draft_seconds = json.loads(args.offload_profile.read_text())["draft_forward"][0]["seconds"]
    read = read_seconds(offloaded, batch1_forwards(args.memory_profile))
    extra = read if args.prefill_extra is None else args.prefill_extra
    runner, pricer = Runner(target, draft, args.max_new_tokens), OffloadPricer(target, offloaded, extra)
    try:
        results = replay(runner, pricer, methods, prompts, args.repetitions, draft_seconds)
    finally:
        runner.close()
        pricer.remove()
    prefills = f"median {statistics.median(pricer.prefills):.3f} s over {len(pricer.prefills)}" if pricer.prefills else "none"
    print(f"read seconds: {read:.3f}; added to a prefill: {extra:.3f}; in-memory prefill forwards: {prefills}")
    report(results, methods[0].name)
    if args.out:
        summary = {"read_seconds": read, "prefill_extra_seconds": extra, "options": options, "methods": results}
        args.out.write_text(json.dumps(summary, indent=1))


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="hf-assisted+rowmajor,dynspec-tree:32:40")
    parser.add_argument("--policy-option", action="append", default=[], metavar="POLICY.OPTION=VALUE",
                        help="Options on top of the offload scenario's own (`dynspec-tree` and `dynspec-goodput@marginal` "
                             "run as the scenario runs them unless overridden here).")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--offload-profile", type=Path, default=PROFILES / "profile_offload_bf16.json")
    parser.add_argument("--memory-profile", type=Path, default=PROFILES / "profile_bf16.json")
    parser.add_argument("--prefill-extra", type=float, default=None,
                        help="Seconds an offloaded prefill costs beyond its in-memory time (default: the read seconds "
                             "from the profiles; a prefill also computes over the whole prompt, which offloaded layers "
                             "may do more slowly).")
    parser.add_argument("--out", type=Path)
    return parser.parse_args()


def replay(
    runner: Runner, pricer: OffloadPricer, methods: list, prompts: list[list[int]], repetitions: int,
    draft_seconds: float,
) -> dict[str, dict]:
    """Each method on every prompt at batch 1, `repetitions` times (the order rotating), after an untimed warm-up."""
    results = {m.name: {key: [] for key in ("measured_s", "priced_s", "counted_s", "target_forwards",
                                            "draft_forwards", "loop_seconds")} for m in methods}
    for method in methods:
        runner.prepare(method)
        runner.run(method, prompts[:1], 1, max_new_tokens=8, progress=False)
    pricer.take()
    for rep in range(repetitions):
        for method in methods[rep % len(methods):] + methods[: rep % len(methods)]:
            outcome = runner.run(method, prompts, 1)
            target_priced, change = pricer.take()
            entry = results[method.name]
            entry["measured_s"].append(outcome.seconds)
            entry["priced_s"].append(outcome.seconds + change)
            entry["counted_s"].append(target_priced + draft_seconds * outcome.draft_forwards)
            entry["target_forwards"].append(outcome.target_forwards)
            entry["draft_forwards"].append(outcome.draft_forwards)
            entry["loop_seconds"].append(outcome.times)
            entry.setdefault("tokens", outcome.tokens)
            print(f"rep {rep} {method.name}: {outcome.seconds:.2f} s in memory, {entry['priced_s'][-1]:.2f} s priced "
                  f"offloaded, {entry['counted_s'][-1]:.2f} s counted, {outcome.target_forwards} target forwards, "
                  f"{outcome.draft_forwards} draft forwards", flush=True)
    return results


def report(results: dict[str, dict], first: str) -> None:
    """Print each method's medians and its speedups over the `first` method; adds them to `results`."""
    reference, first_tokens = results[first], results[first]["tokens"]
    for entry in results.values():
        entry["same_tokens_as_first"] = entry.pop("tokens") == first_tokens
        for kind in ("priced", "counted"):
            entry[f"median_{kind}_s"] = statistics.median(entry[f"{kind}_s"])
    for name, entry in results.items():
        per_rep = ", ".join(f"{b / p:.3f}" for b, p in zip(reference["priced_s"], entry["priced_s"]))
        priced = reference["median_priced_s"] / entry["median_priced_s"]
        counted = reference["median_counted_s"] / entry["median_counted_s"]
        entry["speedup_vs_first"] = {"priced": priced, "counted": counted}
        print(f"{name}: priced {entry['median_priced_s']:.2f} s, {priced:.3f}x {first} (per repetition {per_rep}); "
              f"counted {entry['median_counted_s']:.2f} s, {counted:.3f}x; forwards: target "
              f"{entry['target_forwards']}, draft {entry['draft_forwards']}; same tokens as {first}: "
              f"{entry['same_tokens_as_first']}")


if __name__ == "__main__":
    main()
