"""How far rounding alone moves a model's logits between a k-token forward and one-token forwards over a KV cache.

A speculative step scores the newest token and its draft tokens in one target forward over k tokens; plain greedy
decoding scores the same positions one token at a time. In low precision the two add numbers in different orders,
so their logits differ in the last bits. For each prompt this script decodes 8 tokens greedily with one-token
forwards, then for k = 1..8 recomputes the first k of those positions with one forward over k tokens (from the same
prompt cache), and reports the distribution (median, p99, max) of

- |logit difference| in units in the last place (ulps) of the dtype at each logit's magnitude (all vocabulary entries),
- |top-2 margin difference| in ulps at the magnitude of the top logit (the margin of the one-token run's top two
  tokens, recomputed from the k-token logits), which is what decides whether rounding can flip a greedy pick,
- how often the argmax flipped, and the largest one-token margin (in ulps) at which it flipped.

`hf_dynspec.evaluation.equivalence.TIE_ULPS` is derived from these numbers (docs/verification.md).

    python evaluation/rounding.py --tiny --dtype bfloat16 --num-prompts 64
    python evaluation/rounding.py --target qwen2.5-coder-1.5b --dtype bfloat16 --num-prompts 16
"""

from __future__ import annotations

import argparse
import copy
import json

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from hf_dynspec.cache import cache_kwarg
from hf_dynspec.evaluation.equivalence import MANTISSA_BITS, as_dtype

MAX_K = 8


def ulps(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Elementwise ulp of `dtype` at the magnitude of `values` (ulp at magnitude 1 for zeros)."""
    magnitude = values.abs().float()
    exponent = torch.where(magnitude > 0, magnitude.log2().floor(), torch.zeros_like(magnitude))
    return torch.exp2(exponent - MANTISSA_BITS[dtype])


def _forward(model, ids: list[int], cache: DynamicCache, start: int) -> torch.Tensor:
    """`[len(ids), vocab]` float32 logits of `ids` at positions `start..`, appending to `cache`."""
    input_ids = torch.tensor([ids])
    positions = torch.arange(start, start + len(ids)).unsqueeze(0)
    out = model(input_ids=input_ids, position_ids=positions, use_cache=True, **{cache_kwarg(model.forward): cache})
    return out.logits[0].float()


@torch.inference_mode()
def measure_prompt(model, prompt: list[int], dtype: torch.dtype) -> dict[int, dict[str, torch.Tensor]]:
    """Per k: logit ulp differences `[k * vocab]`, margin ulp differences `[k]`, flips `[k]`, margins in ulps `[k]`."""
    prefix, newest = prompt[:-1], prompt[-1]
    cache = DynamicCache(config=model.config)
    if prefix:
        _forward(model, prefix, cache, 0)
    stepwise = copy.deepcopy(cache)
    tokens, single = [newest], []
    for i in range(MAX_K):  # one-token forwards: greedy decoding's logits
        logits = _forward(model, [tokens[-1]], stepwise, len(prefix) + i)[0]  # [vocab]
        single.append(logits)
        tokens.append(int(logits.argmax()))
    single_logits = torch.stack(single)  # [MAX_K, vocab]
    top = single_logits.topk(2, dim=-1)
    top_values, top_ids = top.values, top.indices  # [MAX_K, 2]
    unit = ulps(top_values[:, 0], dtype)  # [MAX_K]
    margin_single = top_values[:, 0] - top_values[:, 1]  # [MAX_K]
    results = {}
    for k in range(1, MAX_K + 1):
        multi = _forward(model, tokens[:k], copy.deepcopy(cache), len(prefix))  # [k, vocab]
        reference = single_logits[:k]
        pair = multi.gather(1, top_ids[:k])  # [k, 2]
        results[k] = {
            "logit_ulps": ((multi - reference).abs() / ulps(reference, dtype)).flatten(),
            "margin_ulps": ((pair[:, 0] - pair[:, 1]) - margin_single[:k]).abs() / unit[:k],
            "flipped": multi.argmax(dim=-1) != single_logits[:k].argmax(dim=-1),
            "margin_in_ulps": margin_single[:k] / unit[:k],
        }
    return results


def summarize(parts: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    logit = np.concatenate([p["logit_ulps"].numpy() for p in parts])
    margin = np.concatenate([p["margin_ulps"].numpy() for p in parts])
    flipped = torch.cat([p["flipped"] for p in parts])
    at_flip = torch.cat([p["margin_in_ulps"] for p in parts])[flipped]
    return {
        "positions": int(margin.size),
        "logit_ulps_median": float(np.median(logit)),
        "logit_ulps_p99": float(np.percentile(logit, 99)),
        "logit_ulps_max": float(logit.max()),
        "margin_ulps_median": float(np.median(margin)),
        "margin_ulps_p99": float(np.percentile(margin, 99)),
        "margin_ulps_max": float(margin.max()),
        "argmax_flips": int(flipped.sum()),
        "largest_margin_flipped_ulps": float(at_flip.max()) if at_flip.numel() else None,
    }


def load(args: argparse.Namespace, dtype: torch.dtype) -> tuple[torch.nn.Module, list[list[int]]]:
    from hf_dynspec.evaluation.data import encode, load_prompts, random_token_prompts

    if args.tiny:
        from hf_dynspec.evaluation.tiny import TINY_VOCAB, tiny_pair

        models = tiny_pair(args.seed)
        model = models[1] if args.tiny == "draft" else models[0]
        return model.to(dtype), random_token_prompts(args.num_prompts, TINY_VOCAB, seed=args.seed)
    from hf_dynspec.evaluation.models import load_model, load_tokenizer, resolve_model

    location = resolve_model(args.target)
    prompts = encode(load_prompts(args.dataset, args.num_prompts), load_tokenizer(location), args.max_prompt_tokens)
    return load_model(location, dtype), prompts[: args.num_prompts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", help="registry name or path (ignored with --tiny)")
    parser.add_argument("--tiny", nargs="?", const="target", choices=["target", "draft"], default=None,
                        help="use the tiny random pair's target (or draft) and random prompts instead")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32", "float64"])
    parser.add_argument("--dataset", default="humaneval")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-prompt-tokens", type=int, default=768)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="optional JSON file for the results")
    args = parser.parse_args()
    dtype = as_dtype(args.dtype)
    model, prompts = load(args, dtype)
    by_k: dict[int, list[dict[str, torch.Tensor]]] = {k: [] for k in range(1, MAX_K + 1)}
    for prompt in tqdm(prompts, desc="prompts"):
        for k, part in measure_prompt(model.eval(), list(prompt), dtype).items():
            by_k[k].append(part)
    rows = {str(k): summarize(parts) for k, parts in by_k.items()}
    rows["all"] = summarize([p for parts in by_k.values() for p in parts])
    print(f"{args.target if not args.tiny else 'tiny ' + args.tiny} in {args.dtype}, {len(prompts)} prompts")
    print("| k | positions | logit ulps median / p99 / max | margin ulps median / p99 / max | argmax flips "
          "| largest flipped margin (ulps) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for k, r in rows.items():
        flipped = "–" if r["largest_margin_flipped_ulps"] is None else f"{r['largest_margin_flipped_ulps']:.1f}"
        print(f"| {k} | {r['positions']} | {r['logit_ulps_median']:.2f} / {r['logit_ulps_p99']:.2f} / "
              f"{r['logit_ulps_max']:.1f} | {r['margin_ulps_median']:.2f} / {r['margin_ulps_p99']:.2f} / "
              f"{r['margin_ulps_max']:.1f} | {r['argmax_flips']} | {flipped} |")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"model": args.target if not args.tiny else f"tiny {args.tiny}", "dtype": args.dtype,
                       "prompts": len(prompts), "by_k": rows}, handle, indent=2)


if __name__ == "__main__":
    main()
