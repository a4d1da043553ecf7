"""What one forward of each model variant costs: the draft in float32, bfloat16, 8-bit and 4-bit, the target in float32
and bfloat16, over a KV cache of `--context-length` tokens (medians, after warm-up).

Models are the registry's (`hf_dynspec.evaluation.models`), loaded as `hf-dynspec bench` loads them, so
`name@variant` picks a variant without new downloads.

    python evaluation/draft_costs.py --models qwen2.5-coder-0.5b@fp32,qwen2.5-coder-0.5b@bf16,qwen2.5-coder-0.5b@8bit \
        --tokens 1 --out draft_costs.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from hf_dynspec.cache import cache_kwarg
from hf_dynspec.evaluation.models import LoadOptions, load_model, resolve_model, split_variant


def forward_seconds(model: torch.nn.Module, tokens: int, context: int, repeats: int, seed: int) -> float:
    """Median seconds of one forward over `tokens` new tokens on top of a cache of `context` tokens."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first is a warm-up
            cache = DynamicCache()
            model(input_ids=torch.randint(100, 20000, (1, context), generator=generator), **{cache_kwarg(model.forward): cache})
            new = torch.randint(100, 20000, (1, tokens), generator=generator)
            start = time.perf_counter()
            model(input_ids=new, **{cache_kwarg(model.forward): cache})
            samples.append(time.perf_counter() - start)
    return statistics.median(samples[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", required=True, help="Comma-separated registry names, each with an optional @variant.")
    parser.add_argument("--tokens", default="1", help="Comma-separated new tokens per forward, e.g. 1,2,4,8.")
    parser.add_argument("--context-length", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="Write the results as JSON here.")
    args = parser.parse_args()
    results = []
    for spec in tqdm(args.models.split(","), desc="models"):
        name, variant = split_variant(spec)
        model = load_model(resolve_model(name), LoadOptions().with_variant(variant))
        for tokens in (int(t) for t in args.tokens.split(",")):
            seconds = forward_seconds(model, tokens, args.context_length, args.repeats, args.seed)
            results.append({"model": spec, "load": model.hf_dynspec_load, "tokens": tokens, "seconds": seconds})
            print(f"{spec}: {tokens} token(s) {1000 * seconds:.1f} ms", flush=True)
        del model
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"context_length": args.context_length, "repeats": args.repeats, "results": results}, handle, indent=1)


if __name__ == "__main__":
    main()
