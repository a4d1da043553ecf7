"""How much of a speculative step is the loop's own work, outside model forward passes.

Builds a random-weight Llama target of about 134M parameters and a small draft from configs (no downloads), runs
`hf_dynspec` at several batch sizes, and splits wall time into target forwards, draft forwards and everything else
(proposing, processing logits, verification, cache bookkeeping, stats). Forward time is measured with forward hooks.

    python evaluation/loop_overhead.py --batch-sizes 1,8 --max-new-tokens 64 --repetitions 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from tqdm.auto import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

import hf_dynspec
from hf_dynspec import DynSpecConfig
from hf_dynspec.evaluation.bench import machine_description


def build(hidden: int, layers: int, heads: int, vocab: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=2048, pad_token_id=0,
        eos_token_id=None, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


class ForwardTimer:
    """Accumulates the wall time spent inside a module's forward."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.seconds = 0.0
        self._start = 0.0
        module.register_forward_pre_hook(self._before)
        module.register_forward_hook(self._after)

    def _before(self, *args) -> None:
        self._start = time.perf_counter()

    def _after(self, *args) -> None:
        self.seconds += time.perf_counter() - self._start


def measure(target, draft, timers, batch_size: int, args) -> dict:
    generator = torch.Generator().manual_seed(batch_size)
    ids = torch.randint(3, target.config.vocab_size, (batch_size, args.prompt_length), generator=generator)
    shares = []
    for _ in range(args.repetitions + 1):  # the first run warms up
        for timer in timers:
            timer.seconds = 0.0
        start = time.perf_counter()
        out = hf_dynspec.generate(
            target, input_ids=ids, attention_mask=torch.ones_like(ids), assistant_model=draft, do_sample=False,
            max_new_tokens=args.max_new_tokens, return_dict_in_generate=True,
            dynspec_config=DynSpecConfig(num_speculative_tokens=args.k),
        )
        total = time.perf_counter() - start
        forwards = sum(timer.seconds for timer in timers)
        shares.append({"total_s": total, "forward_s": forwards, "loop_s": total - forwards,
                       "steps": out.dynspec_stats.num_steps})
    runs = shares[1:]
    loop_share = statistics.median(r["loop_s"] / r["total_s"] for r in runs)
    step_ms = statistics.median(1000 * r["total_s"] / r["steps"] for r in runs)
    loop_ms = statistics.median(1000 * r["loop_s"] / r["steps"] for r in runs)
    return {"batch_size": batch_size, "loop_share": loop_share, "step_ms": step_ms, "loop_ms_per_step": loop_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--k", type=int, default=4, help="static draft length")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--out", default=None, help="optional JSON file for the results")
    args = parser.parse_args()
    target = build(hidden=768, layers=12, heads=12, vocab=32000, seed=0)
    draft = build(hidden=256, layers=2, heads=4, vocab=32000, seed=1)
    print(f"target parameters: {sum(p.numel() for p in target.parameters()) / 1e6:.1f}M, "
          f"draft: {sum(p.numel() for p in draft.parameters()) / 1e6:.1f}M, threads: {torch.get_num_threads()}")
    timers = [ForwardTimer(target), ForwardTimer(draft)]
    results = [measure(target, draft, timers, int(b), args) for b in tqdm(args.batch_sizes.split(","), desc="batch")]
    print("| batch size | step (ms) | loop work per step (ms) | loop share of step time |")
    print("|---|---|---|---|")
    for r in results:
        print(f"| {r['batch_size']} | {r['step_ms']:.1f} | {r['loop_ms_per_step']:.2f} | {100 * r['loop_share']:.2f}% |")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"machine": machine_description(), "settings": vars(args), "results": results}, handle, indent=2)


if __name__ == "__main__":
    main()
