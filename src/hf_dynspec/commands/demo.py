"""`hf-dynspec demo`: speculative decoding on tiny random models built from configs, checked against plain decoding."""

from __future__ import annotations

import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_dynspec
from hf_dynspec import DynSpecConfig


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="Run the speculative loop on tiny random models (no downloads).")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.set_defaults(func=run)


def tiny_pair(seed: int = 0) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """A tiny target and a draft made from it by adding a little noise, so the draft agrees part of the time."""
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=None,
                         initializer_range=0.3)
    torch.manual_seed(seed)
    target = LlamaForCausalLM(config).eval()
    draft = LlamaForCausalLM(config).eval()
    draft.load_state_dict(target.state_dict())
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(0.05 * parameter.std() * torch.randn_like(parameter))
    for model in (target, draft):
        model.generation_config.pad_token_id = 0
        model.generation_config.eos_token_id = None
    return target, draft


def run(args: argparse.Namespace) -> int:
    target, draft = tiny_pair()
    lengths = [4 + 3 * row for row in range(args.batch_size)]
    ids = torch.zeros((args.batch_size, max(lengths)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, -length:] = torch.randint(1, 128, (length,))
        mask[row, -length:] = 1
    start = time.perf_counter()
    plain = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=args.max_new_tokens)
    plain_seconds = time.perf_counter() - start
    out = hf_dynspec.generate(
        target, input_ids=ids, attention_mask=mask, assistant_model=draft, do_sample=False,
        max_new_tokens=args.max_new_tokens, return_dict_in_generate=True,
        dynspec_config=DynSpecConfig(num_speculative_tokens=args.num_speculative_tokens),
    )
    stats = out.dynspec_stats
    identical = torch.equal(out.sequences, plain)
    print(f"batch {args.batch_size}, {args.max_new_tokens} new tokens, static draft length {args.num_speculative_tokens}")
    print(f"token-identical to plain greedy decoding: {identical}")
    print(f"steps {stats.num_steps}, target forwards {stats.target_forwards} (plain needs {args.max_new_tokens}), "
          f"draft forwards {stats.draft_forwards}, acceptance rate {stats.acceptance_rate:.2f}")
    print(f"wall time: plain {plain_seconds:.3f}s, speculative {stats.total_seconds:.3f}s (tiny models: not a speed test)")
    return 0 if identical else 1
