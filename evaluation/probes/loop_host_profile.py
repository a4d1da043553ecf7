"""Where the loop's host time goes on the launch-bound proxy (`hf-dynspec bench --scenario overhead`).

For each method of the proxy (plain `generate`, the one-layer mirror head at static lengths and with the default
config) on one prompt: the aten operators per token, split into those inside target forwards, inside draft forwards
and outside any forward, each grouped by operator name, those outside also by the package's function that ran them;
this thread's CPU milliseconds per token; then a cProfile of one generation sorted by own time and by cumulative
time. Everything runs on one thread and is timed in that thread's CPU seconds (`time.thread_time`), which other
processes on a shared machine disturb far less than wall time. Operator counts do not depend on the machine's load,
but those inside forwards depend on the linear plans `narrow_linear="auto"` times (padded products run more
operators): `--plans` pins them across runs, so that two versions of the package compare on the same products.

    python evaluation/probes/loop_host_profile.py --methods plain,head-static:8,head-default --top 25
    python evaluation/probes/loop_host_profile.py --vocab 4096 --no-profile --plans /tmp/plans.json

`--vocab 4096` keeps the proxy launch-bound on a CPU without AMX, where the full vocabulary's output layer (151 936 x
64 in float32) would take much of a forward's time.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hf_dynspec
from hf_dynspec import kernels
from hf_dynspec.evaluation.overhead import OVERHEAD_METHODS, PROXY_VOCAB, mirror_head, proxy_target, run_method

PACKAGE = str(Path(hf_dynspec.__file__).parent)


class OperatorsByPlace(TorchDispatchMode):
    """Counts aten operators by name, per place: inside a target forward, a draft forward, or neither (`outside`);
    those outside forwards also by the innermost function of the package that ran them (`by_function`)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, Counter] = {"target": Counter(), "draft": Counter(), "outside": Counter()}
        self.by_function: Counter = Counter()
        self.places: list[str] = []  # innermost forward last

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        place = self.places[-1] if self.places else "outside"
        self.counts[place][str(func.overloadpacket)] += 1
        if place == "outside":
            self.by_function[_package_caller()] += 1
        return func(*args, **(kwargs or {}))

    def watch(self, module: torch.nn.Module, place: str) -> list:
        """Hooks that mark `module`'s forwards as `place`; returns their handles."""

        def enter(*_):
            self.places.append(place)

        def leave(*_):
            self.places.pop()

        return [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]


def pin_linear_plans(path: Path) -> None:
    """Make `narrow_linear="auto"` plans (`kernels.linear_plan`) the ones saved in `path`, measuring and saving any
    missing: runs compared through the same file meet the same linear products (a plan is timed, so it varies
    between runs on a busy machine, and with it the operators of every padded product)."""
    saved = json.loads(path.read_text()) if path.exists() else {}
    measure = kernels._measure

    def pinned(shape, dtype, copies, timer) -> kernels.LinearPlan:
        key = f"{tuple(shape)} {dtype} {copies}"
        if key not in saved:
            plan = measure(shape, dtype, copies, timer)
            saved[key] = [plan.narrow_rows, list(plan.pad_to), sorted(plan.weight_first)]
            path.write_text(json.dumps(saved))
        narrow, pad_to, first = saved[key]
        return kernels.LinearPlan(narrow, tuple(pad_to), frozenset(first))

    kernels._measure = pinned


def _package_caller() -> str:
    """`module.py:function` of the innermost frame in the package, or `elsewhere`."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(PACKAGE):
            return f"{name[len(PACKAGE) + 1:]}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "elsewhere"


def operators(method: str, target, head, draft, prompt: torch.LongTensor, new: int) -> OperatorsByPlace:
    """The operators of one generation of `method`, counted by place, with its forwards (`forwards`)."""
    mode = OperatorsByPlace()
    handles = mode.watch(target, "target") + mode.watch(head, "draft") + mode.watch(draft, "draft")
    forwards = Counter()
    handles += [target.register_forward_pre_hook(lambda *_: forwards.update(["target"]))]
    handles += [m.register_forward_pre_hook(lambda *_: forwards.update(["draft"])) for m in (head, draft)]
    try:
        with mode:
            run_method(method, target, head, draft, prompt, new)
    finally:
        for handle in handles:
            handle.remove()
    mode.forwards = forwards
    return mode


def profile(method: str, target, head, draft, prompt: torch.LongTensor, new: int, top: int) -> str:
    """cProfile of one generation of `method`, the `top` functions by own time and by cumulative time."""
    profiler = cProfile.Profile(time.thread_time)
    with torch.inference_mode():
        profiler.enable()
        run_method(method, target, head, draft, prompt, new)
        profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out).strip_dirs()
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumtime").print_stats(top)
    return out.getvalue()


def cpu_ms_per_token(method: str, target, head, draft, prompt: torch.LongTensor, new: int, repeats: int) -> float:
    """Median over `repeats` generations of `method` of this thread's CPU milliseconds per token."""
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        run_method(method, target, head, draft, prompt, new)
        times.append(1000 * (time.thread_time() - start) / new)
    return statistics.median(times)


def report(method: str, mode: OperatorsByPlace, new: int, top: int) -> None:
    counts, forwards = mode.counts, mode.forwards
    total = sum(sum(c.values()) for c in counts.values())
    print(f"\n=== {method}: {total / new:.0f} ops/token, target forwards {forwards['target']}, "
          f"draft forwards {forwards['draft']}")
    for place, counter in counts.items():
        calls = forwards.get(place, 0)
        per = f", {sum(counter.values()) / calls:.0f} per {place} forward" if calls else ""
        print(f"  {place}: {sum(counter.values()) / new:.1f} ops/token{per}")
        for name, count in counter.most_common(top):
            print(f"    {name:40s} {count / new:8.2f} / token")
    print("  outside, by the package's function that ran them:")
    for name, count in mode.by_function.most_common(top):
        print(f"    {name:60s} {count / new:8.2f} / token")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="plain,head-static:4,head-static:8,head-default")
    parser.add_argument("--new", type=int, default=48, help="tokens generated per method")
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=PROXY_VOCAB,
                        help="the proxy's vocabulary; a smaller one keeps a CPU without AMX launch-bound too")
    parser.add_argument("--top", type=int, default=25, help="rows of each operator and profile listing")
    parser.add_argument("--repeats", type=int, default=3, help="generations timed per method (0: none)")
    parser.add_argument("--plans", type=Path, help="JSON file of linear plans to reuse (written when missing)")
    parser.add_argument("--no-profile", action="store_true", help="no cProfile listings")
    args = parser.parse_args()
    if args.plans is not None:
        pin_linear_plans(args.plans)
    torch.set_num_threads(1)  # every operator on this thread: its CPU time is the generation's
    methods = args.methods.split(",")
    unknown = set(methods) - set(OVERHEAD_METHODS)
    if unknown:
        parser.error(f"unknown methods {sorted(unknown)}; pick from {OVERHEAD_METHODS}")
    target = proxy_target(vocab=args.vocab)
    head, draft = mirror_head(target), copy.deepcopy(target)
    prompt = torch.randint(3, target.config.vocab_size, (1, args.prompt_length), generator=torch.Generator().manual_seed(0))
    for method in methods:
        run_method(method, target, head, draft, prompt, 8)  # warm-up: one-off measurements
        report(method, operators(method, target, head, draft, prompt, args.new), args.new, args.top)
        if args.repeats:
            ms = cpu_ms_per_token(method, target, head, draft, prompt, args.new, args.repeats)
            print(f"  CPU time: {ms:.2f} ms/token (median of {args.repeats})")
        if not args.no_profile:
            print(profile(method, target, head, draft, prompt, args.new, args.top))


if __name__ == "__main__":
    main()
