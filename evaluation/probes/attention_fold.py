"""What grouped-query attention costs over a long cache, three ways, and what a whole target forward costs with and
without folding (`hf_dynspec.attention`).

One layer's attention (the default target's shapes: 12 query heads, 2 key/value heads, 128 dims) over `--length`
cached tokens, per block width: keys and values copied per query head (transformers' `repeat_kv`, for blocks of
several tokens with a mask), shared by the kernel (`enable_gqa=True`, for blocks without a mask) and folded. Then the
target forward over `--widths` tokens per row on a cache of `--length` tokens, left-padded rows, with transformers'
SDPA attention and folded, medians of `--repeats`.

    python evaluation/probes/attention_fold.py --batch-size 16 --length 700 --widths 1,2,3,5
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from hf_dynspec.attention import folded_attention
from hf_dynspec.evaluation.models import LoadOptions, load_model, resolve_model


def median_ms(run: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def layer_attention(batch: int, length: int, width: int, repeats: int, dtype: torch.dtype) -> dict[str, float]:
    """Milliseconds of one layer's attention, each way."""
    heads, kv_heads, dim = 12, 2, 128
    groups = heads // kv_heads
    query = torch.randn(batch, heads, width, dim, dtype=dtype)
    key, value = (torch.randn(batch, kv_heads, length, dim, dtype=dtype) for _ in range(2))
    mask = torch.ones(batch, 1, width, length, dtype=torch.bool).tril(length - width)

    def copied():
        keys, values = (t[:, :, None].expand(-1, -1, groups, -1, -1).reshape(batch, heads, length, dim)
                        for t in (key, value))
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask)

    def folded():
        rows = mask[:, :, None].expand(-1, -1, groups, -1, -1).reshape(batch, 1, groups * width, length)
        return F.scaled_dot_product_attention(query.reshape(batch, kv_heads, groups * width, dim), key, value,
                                              attn_mask=rows)

    shared = lambda: F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True)  # noqa: E731
    return {name: median_ms(run, repeats) for name, run in
            (("copied", copied), ("shared", shared), ("folded", folded))}


def target_forward(model, batch: int, length: int, width: int, repeats: int, fold: bool) -> float:
    """Milliseconds of a target forward over `width` new tokens per row after `length` cached ones."""
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.get_text_config().vocab_size
    prompt = torch.randint(3, vocab, (batch, length), generator=generator)
    padding = torch.ones(batch, length, dtype=torch.long)
    padding[: batch // 2, : length // 16] = 0  # half the rows left-padded, as in a batch of prompts
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=prompt, attention_mask=padding, past_key_values=cache, logits_to_keep=1)
        block = torch.randint(3, vocab, (batch, width), generator=generator)
        mask = torch.cat([padding, torch.ones(batch, width, dtype=torch.long)], dim=1)

        def forward():
            with folded_attention(model, fold):
                model(input_ids=block, attention_mask=mask, past_key_values=cache)
            cache.crop(-width)  # back to the `length` cached tokens

        return median_ms(forward, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--length", type=int, default=700)
    parser.add_argument("--widths", default="1,2,3,5")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    widths = [int(w) for w in args.widths.split(",")]
    print(f"one layer's attention, batch {args.batch_size}, {args.length} cached tokens, {args.dtype} (ms):")
    for width in widths:
        costs = layer_attention(args.batch_size, args.length, width, args.repeats, dtype)
        print(f"  width {width}: " + ", ".join(f"{name} {ms:.2f}" for name, ms in costs.items()))
    model = load_model(resolve_model(args.target), LoadOptions(dtype=args.dtype))
    print(f"{args.target} forward, batch {args.batch_size}, {args.length} cached tokens (ms):")
    for width in widths:
        plain, folded = (target_forward(model, args.batch_size, args.length, width, args.repeats, fold)
                         for fold in (False, True))
        print(f"  width {width}: transformers {plain:.1f}, folded {folded:.1f} ({plain / folded:.2f}x)")


if __name__ == "__main__":
    main()
