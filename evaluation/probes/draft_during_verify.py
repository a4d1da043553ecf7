"""Can the offload scenario's two cores do draft and target work at once? Times one verify forward of the offloaded
target alone and one draft forward alone, then either

- `--overlap draft`: the verify with draft forwards running in a second thread, or
- `--overlap prepare`: accelerate's pre-forward work for the target's offloaded modules (reading each weight from the
  offload folder and setting it on its module, what the module's hook would do when the verify reaches it) done in a
  second thread while the draft runs, and the verify that then finds those modules ready.

    python evaluation/probes/draft_during_verify.py --verify-tokens 8 --repeats 4 --overlap draft
    python evaluation/probes/draft_during_verify.py --verify-tokens 8 --repeats 3 --overlap prepare
    python evaluation/probes/draft_during_verify.py --verify-tokens 8 --repeats 4 --overlap draft --draft-threads 1

Prints seconds (see docs/benchmarks/history.md, "Offload on transformers 5.24" and "Where an offloaded step goes").
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import threading
import time
from collections.abc import Callable

import torch
from transformers import DynamicCache

from hf_dynspec.cache import cache_kwarg
from hf_dynspec.evaluation.bench import load_inputs
from hf_dynspec.evaluation.settings import SCENARIOS, BenchSettings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verify-tokens", type=int, default=8)
    parser.add_argument("--context", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--overlap", choices=("draft", "prepare"), default="draft")
    parser.add_argument("--draft-threads", type=int, default=None,
                        help="With --overlap draft: intra-op threads of the drafting thread (default: PyTorch's).")
    args = parser.parse_args(argv)
    if args.draft_threads is not None and (args.draft_threads < 1 or args.overlap != "draft"):
        parser.error(f"--draft-threads {args.draft_threads}: give a thread count >= 1, with --overlap draft "
                     "(the prepare overlap drafts on the main thread)")
    return args


def main() -> None:
    args = parse_args()
    fields = {f.name for f in dataclasses.fields(BenchSettings)}
    preset = {k: v for k, v in SCENARIOS["offload"].items() if k in fields}
    target, draft, _ = load_inputs(BenchSettings(**{**preset, "num_prompts": 1}))
    prompt = torch.randint(100, 20000, (1, args.context))
    with torch.inference_mode():
        verify = _stepper(target, prompt, args.verify_tokens)
        draft_step = _stepper(draft, prompt, 1)
        verify(), draft_step()  # warm-up
        alone = statistics.median(_seconds(verify) for _ in range(args.repeats))
        draft_alone = statistics.median(_seconds(draft_step) for _ in range(2 * args.repeats))
        print(f"verify over {args.verify_tokens} tokens alone: {alone:.3f} s; a draft forward alone: {draft_alone:.3f} s")
        if args.overlap == "draft":
            _draft_beside_verify(verify, draft_step, args.repeats, args.draft_threads)
        else:
            _prepare_beside_draft(target, verify, draft_step, args.repeats)


def _stepper(model, prompt: torch.Tensor, width: int) -> Callable[[], None]:
    """One forward over `width` new tokens on a fixed context; the cache is cut back after each."""
    cache, key = DynamicCache(config=model.config), cache_kwarg(model.forward)
    model(input_ids=prompt, **{key: cache})

    def step() -> None:
        model(input_ids=torch.randint(100, 20000, (1, width)), **{key: cache})
        cache.crop(-width)

    return step


def _draft_beside_verify(verify, draft_step, repeats: int, threads: int | None) -> None:
    if threads is not None:
        alone = [0.0]
        worker = threading.Thread(target=_draft_alone, args=(draft_step, threads, 2 * repeats, alone))
        worker.start()
        worker.join()
        print(f"a draft forward alone on {threads} thread(s): {alone[0]:.3f} s")
    for _ in range(repeats):
        stop, count = threading.Event(), [0]
        worker = threading.Thread(target=_draft_until, args=(draft_step, stop, count, threads))
        worker.start()
        seconds = _seconds(verify)
        stop.set()
        worker.join()
        print(f"verify beside drafting: {seconds:.3f} s, {count[0]} draft forwards in that time")


def _prepare_beside_draft(target, verify, draft_step, repeats: int) -> None:
    prepare = _offloaded_preparer(target)
    print(f"preparing every offloaded module alone: {_seconds(prepare):.3f} s; the verify then: {_seconds(verify):.3f} s")

    def prepare_then_verify() -> None:
        prepare()
        verify()

    in_turn = statistics.median(_seconds(prepare_then_verify) for _ in range(repeats))
    for _ in range(repeats):
        worker = threading.Thread(target=prepare)
        start, count = time.perf_counter(), 0
        worker.start()
        while worker.is_alive():
            draft_step()
            count += 1
        seconds = time.perf_counter() - start
        print(f"preparing beside drafting: {seconds:.3f} s, {count} draft forwards in that time; "
              f"the verify then: {_seconds(verify):.3f} s")
    print(f"(preparing then verifying, one after the other: {in_turn:.3f} s)")


def _offloaded_preparer(target) -> Callable[[], None]:
    """A function that does the pre-forward work of every offloaded module of `target` ahead of its forward; the
    module's hook then skips it once (its post-forward still puts the weights back to the meta device)."""
    modules = [m for m in target.modules() if getattr(getattr(m, "_hf_hook", None), "offload", False)]
    prepared: set[int] = set()
    for module in modules:
        hook = module._hf_hook

        def pre_forward(mod, *args, _hook=hook, **kwargs):
            if id(mod) in prepared:
                prepared.discard(id(mod))
                return args, kwargs
            return type(_hook).pre_forward(_hook, mod, *args, **kwargs)

        hook.pre_forward = pre_forward

    def prepare() -> None:
        for module in modules:
            type(module._hf_hook).pre_forward(module._hf_hook, module)
            prepared.add(id(module))

    print(f"{len(modules)} offloaded modules")
    return prepare


def _draft_alone(draft_step, threads: int, repeats: int, seconds: list[float]) -> None:
    """The median seconds of a draft forward on `threads` intra-op threads, into `seconds[0]` (run in a thread of its
    own: the thread count is the calling thread's)."""
    torch.set_num_threads(threads)
    with torch.inference_mode():
        seconds[0] = statistics.median(_seconds(draft_step) for _ in range(repeats))


def _draft_until(draft_step, stop: threading.Event, count: list[int], threads: int | None = None) -> None:
    """Draft forwards, counted in `count[0]`, until `stop` is set (run in a second thread, on `threads` intra-op
    threads if given: PyTorch's thread count is per calling thread)."""
    if threads is not None:
        torch.set_num_threads(threads)
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
