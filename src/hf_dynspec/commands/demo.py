"""`hf-dynspec demo`: speculative decoding on tiny random models built from configs, checked against plain decoding."""

from __future__ import annotations

import argparse
import time

import torch

import hf_dynspec
from hf_dynspec import DynSpecConfig
from hf_dynspec.evaluation.tiny import TINY_PAD, TINY_VOCAB, tiny_pair


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="Run the speculative loop on tiny random models (no downloads).")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument(
        "--policy", default="static",
        help="Draft-length policy (default static: on tiny random models the draft costs about as much as the "
             "target, so the package's default, goodput, would rightly hardly draft at all).",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    target, draft = tiny_pair()
    lengths = [4 + 3 * row for row in range(args.batch_size)]
    ids = torch.full((args.batch_size, max(lengths)), TINY_PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, -length:] = torch.randint(2, TINY_VOCAB, (length,))
        mask[row, -length:] = 1
    start = time.perf_counter()
    plain = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=args.max_new_tokens)
    plain_seconds = time.perf_counter() - start
    out = hf_dynspec.generate(
        target, input_ids=ids, attention_mask=mask, assistant_model=draft, do_sample=False,
        max_new_tokens=args.max_new_tokens, return_dict_in_generate=True,
        dynspec_config=DynSpecConfig(num_speculative_tokens=args.num_speculative_tokens, policy=args.policy),
    )
    stats = out.dynspec_stats
    identical = torch.equal(out.sequences, plain)
    print(f"batch {args.batch_size}, {args.max_new_tokens} new tokens, policy {args.policy}, "
          f"at most {args.num_speculative_tokens} draft tokens")
    print(f"token-identical to plain greedy decoding: {identical}")
    plain_steps = plain.shape[1] - ids.shape[1]
    print(f"steps {stats.num_steps}, target forwards {stats.target_forwards} (plain needs {plain_steps}), "
          f"draft forwards {stats.draft_forwards}, acceptance rate {stats.acceptance_rate:.2f}")
    print(f"wall time: plain {plain_seconds:.3f}s, speculative {stats.total_seconds:.3f}s (tiny models: not a speed test)")
    return 0 if identical else 1
