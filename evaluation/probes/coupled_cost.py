"""What coupled sampling costs beside the standard sampler, per verify step, at the default target's vocabulary.

The standard sampler verifies a step with `softmax` over every node's scores and speculative rejection sampling
(`verify_tree_sampling`); coupled sampling hashes each node's Gumbel noise for the tokens that can still win
(`coupling.coupled_choice`) and matches the perturbed argmax (`verify_tree_tokens`). Both are timed on the scores of
the default target (`--logits`: a saved `[positions, vocab]` tensor of its logits, sampled at temperature 1; random
float32 scores otherwise) for chains of `k` draft tokens at `b` rows (medians of repetitions), and the
difference is set against a target step of that shape priced by a calibration profile (`hf-dynspec calibrate`), when
one is given:

    python evaluation/probes/coupled_cost.py --profile docs/benchmarks/profile_bf16_amx_b1_16.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from hf_dynspec.candidates.tree import TokenTree
from hf_dynspec.cost_models import Profile, ProfileCostModel
from hf_dynspec.coupling import coupled_choice
from hf_dynspec.verification import verify_tree_sampling, verify_tree_tokens

VOCAB = 151936


def _median_seconds(run, repeats: int) -> float:
    run()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def sampler_seconds(rows: int, draft: int, repeats: int = 9, logits: torch.Tensor | None = None) -> dict[str, float]:
    """Median seconds of the standard and the coupled verification of a `rows` x `draft` chain step (scores from
    `logits`, `[positions, vocab]`, taken in turn; random ones without)."""
    generator = torch.Generator().manual_seed(0)
    if logits is None:
        scores = torch.randn((rows, draft + 1, VOCAB), generator=generator) * 3  # [rows, nodes, vocab]
    else:
        index = torch.arange(rows * (draft + 1)) % logits.shape[0]
        scores = logits[index].float().view(rows, draft + 1, -1)
    tokens = torch.randint(0, VOCAB, (rows, draft), generator=generator)
    tree = TokenTree.from_chain(tokens, torch.full((rows,), draft), torch.zeros(rows, dtype=torch.long))
    streams = torch.arange(rows).unsqueeze(1).expand(-1, draft + 1) * 7919  # [rows, nodes]
    positions = torch.arange(draft + 1).expand(rows, -1) + 40

    def standard() -> None:
        verify_tree_sampling(scores.softmax(dim=-1), tree, None)

    def coupled() -> None:
        verify_tree_tokens(coupled_choice(scores, streams, positions), tree)

    return {"standard": _median_seconds(standard, repeats), "coupled": _median_seconds(coupled, repeats)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", help="Calibration profile pricing the target step of each shape.")
    parser.add_argument("--shapes", default="1x0,1x4,16x0,16x2", help="ROWSxDRAFT pairs.")
    parser.add_argument("--logits", help="A saved `[positions, vocab]` tensor (torch.save) of the target's logits.")
    parser.add_argument("--out")
    args = parser.parse_args()
    logits = torch.load(args.logits) if args.logits else None
    torch.set_num_threads(torch.get_num_threads())
    verify = ProfileCostModel(Profile.load(args.profile)).verify if args.profile else None
    results = []
    for shape in args.shapes.split(","):
        rows, draft = (int(part) for part in shape.split("x"))
        timing = sampler_seconds(rows, draft, logits=logits)
        extra = timing["coupled"] - timing["standard"]
        step = float(verify(np.array([rows * (draft + 1.0)]))[0]) if verify is not None else None
        results.append({"rows": rows, "draft": draft, **timing, "extra": extra, "step": step})
        share = f", {100 * extra / step:+.1f}% of a {step:.3f} s target step" if step else ""
        print(f"{rows} rows x {draft} draft tokens: standard {1e3 * timing['standard']:.1f} ms, coupled "
              f"{1e3 * timing['coupled']:.1f} ms ({1e3 * extra:+.1f} ms{share})")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"threads": torch.get_num_threads(), "results": results}, handle, indent=1)


if __name__ == "__main__":
    main()
