"""How fast could a draft head of the acceptance it has go on this machine? Hindsight bounds beside the draft model's.

Decodes each prompt greedily with the target alone, then finds where a chain started at each position is right: for
the draft model by one forward over the result (its guesses depend only on the tokens), for an EAGLE-3 head by one
target forward and `--depth` teacher-forced steps of the training-time test (`head_chains`: a head's later tokens read
its own states). Forwards are timed here, in this run, with a cache of the prompt's length (median of `--repeats`):
the target over 1 to `--depth` + 1 tokens, one draft-model token, one head token (its layer, output layer and the
scatter into the target's vocabulary). From those it reports, per proposer:

- acceptance: the mean tokens a chain of K right-drafted tokens from each position gets right, and the share of
  chains still right at each depth;
- `static:K`: the seconds a fixed K takes along the traces at those prices (what `policy="static"` would do);
- `bound`: the fastest schedule with hindsight (`fastest_schedule`: each step drafts exactly the tokens that hold),
  which no chain policy of that proposer beats at these prices.

    python evaluation/head_headroom.py --head /path/to/head --dataset humaneval --num-prompts 16 \\
        --max-new-tokens 48 --out docs/benchmarks/head_headroom_humaneval_amx.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import DynamicCache

from hf_dynspec.evaluation.device_check import timed
from hf_dynspec.evaluation.headroom import (
    GreedyTrace,
    OracleCosts,
    draft_chains,
    fastest_schedule,
    greedy_traces,
    head_chains,
    headroom_table,
    static_schedule,
)
from hf_dynspec.heads import head_for


@torch.no_grad()
def model_seconds(model, prompt: list[int], width: int, repeats: int) -> float:
    """One forward of `model` over `width` new tokens after `prompt` (its cache cut back after each)."""
    ids = torch.tensor([prompt + prompt[:width]], device=model.device)  # [1, prompt + width]
    cache = DynamicCache(config=model.config)
    model(ids[:, : len(prompt)], past_key_values=cache, use_cache=True)

    def run() -> torch.Tensor:
        logits = model(ids[:, len(prompt) :], past_key_values=cache, use_cache=True).logits
        cache.crop(-width)  # back to the prompt's entries
        return logits

    return timed(run, repeats)["seconds"]


@torch.no_grad()
def head_seconds(head, prompt: list[int], repeats: int) -> float:
    """One head forward over one token after `prompt`'s states (random states of the right width: the time does not
    depend on their values), logits scattered into the target's vocabulary as the proposer reads them."""
    width, device = head.config.hidden_size, head.fc.weight.device
    length = len(prompt)
    embeds = head.get_input_embeddings()(torch.tensor([prompt], device=device)).to(head.fc.weight.dtype)
    states = torch.randn(1, length, width, dtype=head.fc.weight.dtype, device=device)
    positions = torch.arange(length + 1, device=device)[None]  # [1, length + 1]
    cache = DynamicCache()
    head.step(embeds, states, positions[:, :length], None, cache)

    def run() -> torch.Tensor:
        hidden = head.step(embeds[:, -1:], states[:, -1:], positions[:, length:], None, cache)
        scores = head.draft_logits(hidden).float()  # [1, 1, draft_vocab]
        logits = scores.new_full((1, 1, head.config.vocab_size), float("-inf"))
        logits[..., head.target_ids] = scores
        cache.crop(-1)  # back to the prompt's entries
        return logits

    return timed(run, repeats)["seconds"]


def summary(traces: list[GreedyTrace], chains: list[list[int]], costs: OracleCosts, depth: int) -> dict:
    """Acceptance, static-K and hindsight-bound figures of one proposer along `traces`."""
    starts = [c for trace, chain in zip(traces, chains) for c in chain[1 : len(trace.new) - 1]]
    plain = sum((len(t.new) - 1) * costs.verify(1) for t in traces)
    depths = [sum(c >= d for c in starts) / max(1, sum(c >= d - 1 for c in starts)) for d in range(1, depth + 1)]
    static = {}
    for k in range(1, depth + 1):
        runs = [static_schedule(t, costs, k, c) for t, c in zip(traces, chains)]
        seconds, verifies = sum(r.seconds for r in runs), sum(r.verifies for r in runs)
        static[str(k)] = {"speedup": plain / seconds, "tokens_per_verify": sum(len(t.new) - 1 for t in traces) / verifies}
    bound = [fastest_schedule(t, costs, chains=c) for t, c in zip(traces, chains)]
    return {
        "forward_seconds": costs.draft_forward,
        "mean_chain": {str(k): sum(min(c, k) for c in starts) / len(starts) for k in (1, 2, 4, depth)},
        "right_at_depth": depths,  # of chains right up to depth d - 1, the share right at depth d
        "static": static,
        "best_static": max(static, key=lambda k: static[k]["speedup"]),
        "bound": {
            "speedup": plain / sum(s.seconds for s in bound),
            "verifies": sum(s.verifies for s in bound),
            "draft_forwards": sum(s.draft_forwards for s in bound),
            "tokens_per_verify": sum(len(t.new) - 1 for t in traces) / sum(s.verifies for s in bound),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head", required=True, help="An EAGLE-3 head folder or Hub id (`DynSpecConfig.draft_head`).")
    parser.add_argument("--dataset", default="humaneval")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--depth", type=int, default=8, help="Most tokens a chain drafts.")
    parser.add_argument("--repeats", type=int, default=15, help="Timed calls per forward (median).")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from hf_dynspec.evaluation.bench import load_inputs, machine_description
    from hf_dynspec.evaluation.settings import BenchSettings

    settings = BenchSettings(dataset=args.dataset, num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens)
    target, draft, prompts = load_inputs(settings)
    head = head_for(target, args.head)
    traces = greedy_traces(target, draft, prompts, args.max_new_tokens)
    chains = {"draft": [draft_chains(t, args.depth) for t in traces],
              "head": head_chains(target, head, traces, args.depth)}
    prompt = max(prompts, key=len)
    widths = {w: model_seconds(target, prompt, w, args.repeats) for w in range(1, args.depth + 2)}
    forward = {"draft": model_seconds(draft, prompt, 1, args.repeats), "head": head_seconds(head, prompt, args.repeats)}
    results = {}
    for name in ("draft", "head"):
        costs = OracleCosts(lambda width: widths[min(width, args.depth + 1)], forward[name], 0, args.depth, 0)
        results[name] = summary(traces, chains[name], costs, args.depth)
    out = {
        "scenario": "head_headroom",
        "machine": machine_description(),
        "config": {**vars(args), "target_dtype": str(target.dtype), "prompt_tokens_timed": len(prompt)},
        "verify_seconds": {str(w): s for w, s in widths.items()},
        "proposers": results,
        "chains": chains,
    }
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(headroom_table(out))
    print(f"Results: {args.out}")


if __name__ == "__main__":
    main()
