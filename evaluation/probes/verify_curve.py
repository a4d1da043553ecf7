"""How a target forward's cost grows past the widths plain steps measure, against the line to the prefill.

At batch `b` a policy that has seen only plain steps knows verify widths up to `b` tokens. Past its last knot the
`goodput` cost model follows the line from that knot to the call's target prefill (`PiecewiseLinear.far`). This
times, over a cache of `--context-length` tokens, the prefill of that cache at `--batch-size` rows and a verify
forward of each of `--tokens-per-row` new tokens per row (medians after a warm-up), and prints each width's seconds
beside what that line predicts from the narrowest one (`PiecewiseLinear`, as the policy computes it).

    python evaluation/probes/verify_curve.py --model qwen2.5-coder-1.5b@bf16 --batch-size 16 --tokens-per-row 1,2,3,4,6,8 \
        --context-length 600 --out verify_curve.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial

import torch
from tqdm.auto import tqdm

from hf_dynspec.calibration import _CachedForward
from hf_dynspec.clocks import time_call
from hf_dynspec.cost_models import PiecewiseLinear
from hf_dynspec.evaluation.models import LoadOptions, load_model, resolve_model, split_variant


def measure(model: torch.nn.Module, batch: int, widths: list[int], context: int, repeats: int) -> dict:
    """`{"prefill": (tokens, seconds), "verify": {tokens: seconds}}` at `batch` rows over a `context`-token cache: the
    forwards `hf-dynspec calibrate` times (logits of every new token, as a verify keeps), and the prefill under them."""
    start = time.perf_counter()
    forward = _CachedForward(model, batch, context, torch.Generator().manual_seed(0))  # prefills the cache
    prefill = time.perf_counter() - start
    verify = {
        batch * width: statistics.median(time_call(partial(forward, width, keep=width), warmup=1, repeats=repeats))
        for width in tqdm(widths, desc="verify widths")
    }
    return {"prefill": (batch * context, prefill), "verify": verify}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b@bf16", help="A registry name, `name@variant`.")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--tokens-per-row", default="1,2,3,4,6,8", help="Comma-separated verify widths per row.")
    parser.add_argument("--context-length", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="Write the measurements as JSON here.")
    args = parser.parse_args()
    name, variant = split_variant(args.model)
    model = load_model(resolve_model(name), LoadOptions().with_variant(variant)).eval()
    widths = sorted({int(w) for w in args.tokens_per_row.split(",")})
    result = measure(model, args.batch_size, widths, args.context_length, args.repeats)
    (wide, wide_seconds), verify = result["prefill"], result["verify"]
    narrowest = min(verify)
    line = PiecewiseLinear.fit({narrowest: (verify[narrowest], 1)}, far=(wide, wide_seconds))
    print(f"prefill: {wide} tokens in {wide_seconds:.2f} s")
    for tokens, seconds in verify.items():
        print(f"{tokens:6d} tokens: {seconds:.3f} s measured, {float(line([tokens])[0]):.3f} s on the line")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"model": args.model, "batch_size": args.batch_size, "context_length": args.context_length,
                       **result}, handle, indent=1)


if __name__ == "__main__":
    main()
