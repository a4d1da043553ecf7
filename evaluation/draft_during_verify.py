"""Does drafting while the target verifies pay on this machine? Times one verify forward of the offload scenario's
target alone, one draft forward alone, and the verify with draft forwards running in a second thread.

    python evaluation/draft_during_verify.py --verify-tokens 8 --repeats 4

Prints medians in seconds (see docs/benchmarks.md, "Offload on transformers 5.24").
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import threading
import time

import torch
from transformers import DynamicCache

from hf_dynspec.cache import cache_kwarg
from hf_dynspec.evaluation.bench import SCENARIOS, BenchSettings, load_inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verify-tokens", type=int, default=8)
    parser.add_argument("--context", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    fields = {f.name for f in dataclasses.fields(BenchSettings)}
    preset = {k: v for k, v in SCENARIOS["offload"].items() if k in fields}
    target, draft, _ = load_inputs(BenchSettings(**{**preset, "num_prompts": 1}))
    prompt = torch.randint(100, 20000, (1, args.context))

    def stepper(model, width: int):
        """One forward over `width` new tokens on a fixed context; the cache is cut back after each."""
        cache, key = DynamicCache(config=model.config), cache_kwarg(model.forward)
        model(input_ids=prompt, **{key: cache})

        def step() -> None:
            model(input_ids=torch.randint(100, 20000, (1, width)), **{key: cache})
            cache.crop(-width)

        return step

    with torch.inference_mode():
        verify, draft_step = stepper(target, args.verify_tokens), stepper(draft, 1)
        verify(), draft_step()  # warm-up
        alone = statistics.median(_seconds(verify) for _ in range(args.repeats))
        draft_alone = statistics.median(_seconds(draft_step) for _ in range(2 * args.repeats))
        print(f"verify over {args.verify_tokens} tokens alone: {alone:.3f} s; a draft forward alone: {draft_alone:.3f} s")
        for _ in range(args.repeats):
            stop, count = threading.Event(), [0]
            worker = threading.Thread(target=_draft_until, args=(draft_step, stop, count))
            worker.start()
            seconds = _seconds(verify)
            stop.set()
            worker.join()
            print(f"verify beside drafting: {seconds:.3f} s, {count[0]} draft forwards in that time")


def _draft_until(draft_step, stop: threading.Event, count: list[int]) -> None:
    """Draft forwards, counted in `count[0]`, until `stop` is set (run in a second thread)."""
    with torch.inference_mode():
        while not stop.is_set():
            draft_step()
            count[0] += 1


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
