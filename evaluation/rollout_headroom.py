"""How much can suffix trees add to a GRPO-shaped rollout at best? A hindsight bound on sampled rows.

Samples the rollout scenario of `hf-dynspec bench --scenario rollout` (2 ShareGPT prompts x 8 samples in adjacent
rows, temperature 1, top-p 1, top-k 0, each row ending at its EOS) with plain `generate`, twice: an epoch before
(`--seed + 1`) and the rollout itself (`--seed`). For each row of the rollout, `copy_matches` gives with hindsight the
most sampled tokens suffix trees could propose right at each position, from the row's prompt and output and every
other row's whole output (siblings seen ahead of time: looser than the trees, which see them as they are written);
the second epoch also from the epoch before's outputs. A deterministic proposal's token passes rejection sampling
exactly as often as a sample equals it, so realized agreement is acceptance in distribution, and the best
continuation with hindsight bounds it.

Each row then needs at least its oracle's verify forwards (`fastest_schedule` with every verify priced alike: wide
verifies taken as free). Pricing the loop without speculation and those schedules by active rows (that loop's own
forwards in a rollout bench's results, as the bench prices it at the same lengths, or a calibration profile's
one-token forwards) bounds the speedup of suffix speculation over the loop without speculation; the four longest
rows' tokens per forward bound it while at most four rows decode. The same pricing of arctic-inference's own chains
replayed on the rows without hindsight (`replayed_forwards`) shows how much of that bound the trees reach.

    python evaluation/rollout_headroom.py --prices docs/benchmarks/rollout_512_bf16_amx_measured.json \
        --out docs/benchmarks/rollout_headroom_512_amx.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hf_dynspec.candidates.suffix import SuffixCache, SuffixSettings
from hf_dynspec.cost_models import Profile
from hf_dynspec.evaluation.bench import load_inputs
from hf_dynspec.evaluation.headroom import GreedyTrace, OracleCosts, copy_matches, fastest_schedule
from hf_dynspec.evaluation.rollout import forward_seconds, matched_seconds
from hf_dynspec.evaluation.runner import left_pad, trim
from hf_dynspec.evaluation.settings import SCENARIOS, BenchSettings

TAIL_ROWS = 4
"""The goal's tail: while at most this many rows decode."""


def sample_rollout(target, prompts: list[list[int]], settings: BenchSettings, seed: int) -> list[list[int]]:
    """Each row's sampled new tokens (up to its EOS) from plain `generate`."""
    config = target.generation_config
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    pad = int(config.pad_token_id if config.pad_token_id is not None else eos[0])
    ids, mask = left_pad(prompts, pad)  # [rows, longest prompt]
    torch.manual_seed(seed)
    with torch.no_grad():
        out = target.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, temperature=settings.temperature, top_p=settings.top_p,
            top_k=settings.top_k, max_new_tokens=settings.max_new_tokens, pad_token_id=pad,
        )  # [rows, longest prompt + new]
    return trim(out[:, ids.shape[1] :], set(eos))


def fewest_verifies(prompt: list[int], new: list[int], earlier: list[list[int]], suffix: SuffixSettings,
                    max_tokens: int) -> int:
    """Verify forwards after the prefill that a row needs at best when suffix trees propose (with hindsight)."""
    trace = GreedyTrace(prompt, new, [False] * len(new), [False] * len(new))
    copies = copy_matches(trace, max_tokens, earlier, suffix.max_depth, suffix.max_spec_factor)
    alike = OracleCosts(lambda width: 1.0, 0.0, 0, 0, max_tokens)  # no draft model; every verify priced alike
    return fastest_schedule(trace, alike, free=copies).verifies


def bound(prompts: list[list[int]], rows: list[list[int]], earlier: list[list[int]], by_rows: dict[int, float],
          suffix: SuffixSettings, max_tokens: int) -> dict:
    """One rollout's hindsight bound and arctic-inference's chains replayed on it, each as forwards per row and the
    speedup over the loop without speculation; `earlier` are outputs cached before it (an epoch before)."""
    verifies = [
        fewest_verifies(prompt, new, [o for j, o in enumerate(rows) if j != i] + earlier, suffix, max_tokens)
        for i, (prompt, new) in enumerate(zip(prompts, rows))
    ]
    replayed = replayed_forwards(prompts, rows, earlier, suffix, max_tokens)
    lengths = [len(new) for new in rows]
    nospec = matched_seconds(lengths, 0.0, by_rows)
    tail = sorted(range(len(rows)), key=lambda i: lengths[i])[-TAIL_ROWS:]

    def summary(forwards: list[int]) -> dict:  # forwards after the prefill's, per row
        return {
            "speedup_over_nospec": nospec / matched_seconds([f + 1 for f in forwards], 0.0, by_rows),
            "tokens_per_forward": sum(n - 1 for n in lengths) / max(sum(forwards), 1),
            "tail_tokens_per_forward": sum(lengths[i] - 1 for i in tail) / max(sum(forwards[i] for i in tail), 1),
            "forwards": forwards,
        }

    return {"lengths": lengths, "hindsight": summary(verifies), "replayed": summary(replayed)}


def replayed_forwards(prompts: list[list[int]], rows: list[list[int]], earlier: list[list[int]],
                      suffix: SuffixSettings, max_tokens: int) -> list[int]:
    """Verify forwards after the prefill each row takes when arctic-inference's suffix trees propose a chain at every
    step, without hindsight: the rows written in lockstep (siblings visible as far as the row itself), `earlier` in the
    cache before, each step emitting the chain's tokens up to the first the row did not write, and one more."""
    cache = SuffixCache(suffix)
    for text in earlier:
        request = cache.start([])
        cache.extend(request, text)
        cache.stop(request)
    requests = [cache.start(prompt) for prompt in prompts]
    forwards, nexts = [0] * len(rows), [1] * len(rows)  # the prefill wrote each row's first token
    for n in range(max(map(len, rows), default=0)):
        for row, (prompt, new) in enumerate(zip(prompts, rows)):
            if n == nexts[row] and n < len(new):
                proposal = list(cache.speculate(requests[row], prompt + new[:n], max_tokens, False).token_ids)
                right = next((i for i, (a, b) in enumerate(zip(proposal, new[n:])) if a != b), len(proposal))
                forwards[row] += 1
                nexts[row] = n + min(right, len(new) - n - 1) + 1
        for row, new in enumerate(rows):
            if n < len(new):
                cache.extend(requests[row], [new[n]])
    for request in requests:
        cache.stop(request)
    return forwards


def one_token_prices(path: str) -> dict[int, float]:
    """Seconds of a one-token target forward by active rows: from the loop without speculation's forwards in a
    rollout bench's results (`dynspec-nospec`'s timelines, as the bench prices that loop), or from a calibration
    profile."""
    data = json.loads(Path(path).read_text())
    if data.get("format") == "hf_dynspec.profile":
        timings = [t for t in Profile.load(path).target_forward if t.tokens_per_row == 1]
        if not timings:
            raise ValueError(f"{path} has no one-token target forwards: calibrate with --tokens-per-row including 1.")
        return {t.batch_size: t.seconds for t in sorted(timings, key=lambda t: t.batch_size)}
    calls = [c for t in data.get("timelines", []) if t["method"] == "dynspec-nospec" for c in t["calls"]]
    if not calls:
        raise ValueError(f"{path} is neither a calibration profile nor rollout results with `dynspec-nospec` timelines.")
    return forward_seconds(calls)[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prices", default="docs/benchmarks/rollout_512_bf16_amx_measured.json",
                        help="Rollout bench results with `dynspec-nospec` (its forwards by active rows), or a profile.")
    parser.add_argument("--max-new-tokens", type=int, default=SCENARIOS["rollout"]["max_new_tokens"])
    parser.add_argument("--max-tokens", type=int, default=24, help="Most suffix tokens one step may propose.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rows", help="Reuse the prompts and sampled rows of an earlier --out instead of sampling.")
    parser.add_argument("--out")
    args = parser.parse_args()
    preset = {**SCENARIOS["rollout"], "max_new_tokens": args.max_new_tokens}
    if args.rows:
        saved = json.loads(Path(args.rows).read_text())
        prompts, before, rows, dtype = saved["prompts"], saved["epoch_before"], saved["rows"], saved["config"]["dtype"]
    else:
        settings = BenchSettings(**{k: v for k, v in preset.items() if k != "methods"}, scenario="rollout")
        target, _, prompts = load_inputs(settings, need_draft=False)
        before = sample_rollout(target, prompts, settings, args.seed + 1)
        rows, dtype = sample_rollout(target, prompts, settings, args.seed), str(target.dtype)
    by_rows, suffix = one_token_prices(args.prices), SuffixSettings()
    results = {
        "first epoch": bound(prompts, rows, [], by_rows, suffix, args.max_tokens),
        "second epoch": bound(prompts, rows, before, by_rows, suffix, args.max_tokens),
    }
    for name, result in results.items():
        for kind, what in (("hindsight", "at most"), ("replayed", "replayed, verifies free:")):
            row = result[kind]
            print(f"{name}: suffix trees {what} {row['speedup_over_nospec']:.3f}x the loop without speculation,"
                  f" {row['tokens_per_forward']:.3f} tokens per row and forward"
                  f" ({row['tail_tokens_per_forward']:.3f} for the {TAIL_ROWS} longest rows)")
    if args.out:
        config = {**vars(args), "dtype": dtype, "settings": preset}
        saved = {"config": config, "bound": results, "prompts": prompts, "epoch_before": before, "rows": rows}
        Path(args.out).write_text(json.dumps(saved) + "\n")


if __name__ == "__main__":
    main()
