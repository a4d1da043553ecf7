"""Time the offload scenario's target forwards with and without row-major inputs to its output layer.

A prefill keeps the logits of its last positions only, so transformers hands the output layer a slice of the hidden
states; where the output weight does not require grad (accelerate's offloaded weights), `torch.matmul` multiplies
that slice by a copy of the whole weight. `hf_dynspec.kernels.row_major_output` gives the layer a row-major copy of
its input instead (docs/design.md, "Row-major inputs to the output layer"). This script loads the target as the
offload scenario does (35% of its weights in memory, the rest in the offload folder), in the dtype asked for, and
times three forwards without a cache, stock and inside `row_major_output`, interleaved, medians of `--repeats`:

- one token (no slice: both should take the same time);
- 8 tokens keeping the last logits (a short prefill, or a verify keeping one position);
- the first prompt of the scenario keeping the last logits (a prefill).

It checks that both give the same logits and writes the medians to `--out`:

    python evaluation/probes/row_major_probe.py --dtype float32 --out docs/benchmarks/row_major_probe_fp32.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from hf_dynspec.evaluation.bench import load_inputs
from hf_dynspec.evaluation.settings import SCENARIOS, BenchSettings
from hf_dynspec.kernels import row_major_output


def _forward(model: torch.nn.Module, ids: torch.LongTensor, row_major: bool) -> tuple[float, torch.Tensor]:
    """Seconds of one forward over `ids` (`[1, n]`, no cache, last logits kept) and its logits `[1, 1, vocab]`."""
    start = time.perf_counter()
    with torch.inference_mode():
        if row_major:
            with row_major_output(model):
                logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits
        else:
            logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits
    return time.perf_counter() - start, logits


def probe(model: torch.nn.Module, inputs: dict[str, torch.LongTensor], repeats: int) -> list[dict]:
    """Per input: the median seconds stock and row-major, and whether their logits are equal."""
    rows = []
    for name, ids in inputs.items():
        _forward(model, ids, True)  # warm-up: the first forward of a shape runs cold
        times: dict[bool, list[float]] = {False: [], True: []}
        logits: dict[bool, torch.Tensor] = {}
        for _ in range(repeats):
            for row_major in (False, True):
                seconds, logits[row_major] = _forward(model, ids, row_major)
                times[row_major].append(seconds)
        stock, fixed = statistics.median(times[False]), statistics.median(times[True])
        rows.append({
            "forward": name, "tokens": int(ids.shape[1]), "stock_seconds": stock, "row_major_seconds": fixed,
            "stock_over_row_major": stock / fixed, "max_abs_logit_diff": float((logits[False] - logits[True]).abs().max()),
            "stock_repeats": times[False], "row_major_repeats": times[True],
        })
        print(f"{name} ({ids.shape[1]} tokens): stock {stock:.3f} s, row-major {fixed:.3f} s, "
              f"{stock / fixed:.2f}x; max logit difference {rows[-1]['max_abs_logit_diff']}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="auto", help="The target's dtype (auto, float32, bfloat16).")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}.")
    scenario = {k: v for k, v in SCENARIOS["offload"].items() if k not in ("methods", "policy_options")}
    settings = BenchSettings(**{**scenario, "num_prompts": 1, "target_dtype": args.dtype})
    target, _, prompts = load_inputs(settings, need_draft=False)
    prompt = torch.tensor([prompts[0]])
    inputs = {"one token": prompt[:, -1:], "8 tokens, last logits": prompt[:, -8:], "prompt, last logits": prompt}
    rows = probe(target, inputs, args.repeats)
    if args.out:
        record = {"loaded_target": settings.loaded_models["target"], "repeats": args.repeats, "forwards": rows}
        args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
