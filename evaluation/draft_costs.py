"""What one forward of each model variant costs: the draft in float32, bfloat16, 8-bit and 4-bit, the target in float32
and bfloat16, over a KV cache of `--context-length` tokens (medians, after warm-up).

Models are the registry's (`hf_dynspec.evaluation.models`), loaded as `hf-dynspec bench` loads them, so
`name@variant` picks a variant without new downloads.

    python evaluation/draft_costs.py --models qwen2.5-coder-0.5b@fp32,qwen2.5-coder-0.5b@bf16,qwen2.5-coder-0.5b@8bit \
        --tokens 1 --out draft_costs.json

Each result also gives the share of the forward spent in matrix products (`aten::mm`, `aten::addmm`, profiled) and the
rate at which the forward reads the weights of its linear layers (GB/s), which tell whether a forward is bound by
memory bandwidth or by Python and small operators. `--compile` also times the model under `torch.compile` (after its
compilation, which is reported).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile
from tqdm.auto import tqdm
from transformers import DynamicCache

from hf_dynspec.cache import cache_kwarg
from hf_dynspec.evaluation.models import LoadOptions, load_model, resolve_model, split_variant

PRODUCTS = ("aten::mm", "aten::addmm")
"""The operators of a linear layer's matrix product on the CPU."""


def random_ids(model: torch.nn.Module, length: int, generator: torch.Generator | None = None) -> torch.LongTensor:
    """`[1, length]` random token ids of `model`'s vocabulary (above the first 100, often special tokens)."""
    high = min(20000, model.config.vocab_size)
    return torch.randint(min(100, high // 2), high, (1, length), generator=generator)


def forward_seconds(
    model: torch.nn.Module, tokens: int, context: int, repeats: int, seed: int, forward: Callable | None = None
) -> float:
    """Median seconds of one forward (`forward`, by default `model`) over `tokens` new tokens on top of a cache of
    `context` tokens."""
    generator = torch.Generator().manual_seed(seed)
    forward = model if forward is None else forward
    key = cache_kwarg(model.forward)
    samples = []
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first is a warm-up
            cache = DynamicCache()
            model(input_ids=random_ids(model, context, generator), **{key: cache})
            new = random_ids(model, tokens, generator)
            start = time.perf_counter()
            forward(input_ids=new, **{key: cache})
            samples.append(time.perf_counter() - start)
    return statistics.median(samples[1:])


def product_share(model: torch.nn.Module, tokens: int, context: int, repeats: int = 5) -> float:
    """Share of the CPU time of `repeats` forwards over `tokens` new tokens spent in matrix products (`PRODUCTS`)."""
    key = cache_kwarg(model.forward)
    with torch.inference_mode():
        cache = DynamicCache()
        model(input_ids=random_ids(model, context), **{key: cache})
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            for _ in range(repeats):
                model(input_ids=random_ids(model, tokens), **{key: cache})
    events = profiler.key_averages()
    total = sum(event.self_cpu_time_total for event in events)
    return sum(event.self_cpu_time_total for event in events if event.key in PRODUCTS) / total


def linear_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights a forward reads in its linear layers (the input embedding is a lookup, not counted)."""
    return sum(
        module.weight.numel() * module.weight.element_size()
        for module in model.modules()
        if isinstance(module, torch.nn.Linear) and module.weight.device.type != "meta"
    )


def measure(model: torch.nn.Module, spec: str, tokens: int, args: argparse.Namespace) -> list[dict]:
    """The eager forward's seconds, product share and weight rate; with `args.compile` also the compiled forward's."""
    seconds = forward_seconds(model, tokens, args.context_length, args.repeats, args.seed)
    weight_bytes = linear_weight_bytes(model)
    eager = {
        "model": spec, "load": model.hf_dynspec_load, "tokens": tokens, "compiled": False, "seconds": seconds,
        "product_share": product_share(model, tokens, args.context_length),
        "linear_weight_gb_per_s": weight_bytes / seconds / 1e9,
    }
    print(f"{spec}: {tokens} token(s) {1000 * seconds:.1f} ms, {eager['product_share']:.0%} in matrix products, "
          f"linear weights read at {eager['linear_weight_gb_per_s']:.1f} GB/s", flush=True)
    if not args.compile:
        return [eager]
    compiled = torch.compile(model, dynamic=True)
    start = time.perf_counter()
    forward_seconds(model, tokens, args.context_length, 1, args.seed, compiled)  # compiles
    compile_seconds = time.perf_counter() - start
    seconds = forward_seconds(model, tokens, args.context_length, args.repeats, args.seed, compiled)
    print(f"{spec}: {tokens} token(s) compiled {1000 * seconds:.1f} ms (compiling took {compile_seconds:.0f} s)",
          flush=True)
    return [eager, {"model": spec, "load": model.hf_dynspec_load, "tokens": tokens, "compiled": True,
                    "seconds": seconds, "compile_seconds": compile_seconds}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", required=True, help="Comma-separated registry names, each with an optional @variant.")
    parser.add_argument("--tokens", default="1", help="Comma-separated new tokens per forward, e.g. 1,2,4,8.")
    parser.add_argument("--context-length", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true", help="Also time each model under torch.compile.")
    parser.add_argument("--out", help="Write the results as JSON here.")
    args = parser.parse_args()
    results = []
    for spec in tqdm(args.models.split(","), desc="models"):
        name, variant = split_variant(spec)
        model = load_model(resolve_model(name), LoadOptions().with_variant(variant))
        for tokens in (int(t) for t in args.tokens.split(",")):
            results.extend(measure(model, spec, tokens, args))
        del model
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"context_length": args.context_length, "repeats": args.repeats, "results": results}, handle, indent=1)


if __name__ == "__main__":
    main()
