"""Attention of a few new tokens over a long KV cache, with grouped-query heads folded into the query length.

Models with grouped-query attention (the default pair: 12 query heads and 2 key/value heads in the target, 14 and 2 in
the draft) store one key and value per key/value head, and each serves `groups = heads / kv_heads` query heads.
transformers' SDPA attention gives those to `torch.nn.functional.scaled_dot_product_attention` in one of three ways:
one new token per row is folded (`pack_gqa`) when a mask is given; with no mask it asks the kernel to share the heads
(`enable_gqa=True`); a wider block with a mask, as every verify forward of the loop is, gets its keys and values copied
`groups` times (`repeat_kv`). On a CPU the last two are slow where caches are long: AMD EPYC with AVX512-BF16,
bfloat16, 16 rows over 700 cached tokens, one layer of the default target, a 2-token block costs 27.8 ms copied, 4.7
ms shared by the kernel and 1.6 ms folded; a whole target forward over 2 tokens per row took 1.34 s instead of 0.52 s,
2.2 times a 1-token forward instead of 1.4 times (`evaluation/probes/attention_fold.py`). The verify curve the policy
prices, and so where speculation pays, moved with it.

[`folded_sdpa_attention`] computes the same attention with no copy: the query block `[batch, heads, width, dim]` is
viewed as `[batch, kv_heads, groups * width, dim]`, each key/value head's `groups` query heads one after another,
and the mask is repeated along that axis (`[batch, 1, groups * width, length]`, a few hundred kilobytes). Each query
row meets exactly the keys, values and mask entries it met before, in the same kernel. It serves the loop's own
forwards (`Placement.forward`, packed verify forwards) on a CPU, for blocks of at most `MAX_FOLDED_QUERIES` tokens;
everything else (prefills of long prompts, dropout in training mode, soft-capping, attention sinks, per-head masks,
other devices) goes to transformers' own function unchanged. It is registered in transformers' `AttentionInterface`,
with SDPA's mask function in `AttentionMaskInterface`, and [`folded_attention`] switches a model with SDPA attention
to it for the duration of a forward, as `hf_dynspec.packing` does; `DynSpecConfig(fold_attention=False)` leaves
attention to transformers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION = "dynspec_folded_sdpa"
"""Name of the folded attention function in transformers' `AttentionInterface` (and of its mask function)."""

MAX_FOLDED_QUERIES = 128
"""Widest block folded; wider ones (prefills of long prompts) go to transformers' SDPA attention, where folding gains
little (16 rows over 700 cached tokens: 58 ms against 91 ms at 128 queries a row, 128 ms against 141 ms at 256)."""

_UNFOLDED_KWARGS = ("softcap", "position_bias", "s_aux")
"""Keyword arguments of attention functions that folding does not handle; a call with any of them set is not folded."""


def folded_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention (same arguments, same `[batch, width, heads, dim]` result), with grouped-query
    heads folded into the query length where that applies (see the module docstring).

    Args:
        query: `[batch, heads, width, dim]`.
        key: `[batch, kv_heads, length, dim]` (the cache and this block).
        value: `[batch, kv_heads, length, dim]`, as `key`.
        attention_mask: `[batch or 1, 1, width, length]` (boolean or additive) or `None`.
    """
    if not _foldable(query, key, attention_mask, dropout, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    batch, heads, width, _ = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    mask = _folded_mask(attention_mask, groups, width, length, causal, query.device)
    folded = query.reshape(batch, kv_heads, groups * width, query.shape[3])  # [batch, kv_heads, groups * width, dim]
    output = F.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scaling)
    output = output.reshape(batch, heads, width, value.shape[3])  # [batch, heads, width, value dim]
    return output.transpose(1, 2).contiguous(), None


def _foldable(
    query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float, kwargs: dict
) -> bool:
    heads, kv_heads, width = query.shape[1], key.shape[1], query.shape[2]
    return (
        query.device.type == "cpu"
        and kv_heads < heads
        and heads % kv_heads == 0
        and width <= MAX_FOLDED_QUERIES
        and not dropout
        and all(kwargs.get(name) is None for name in _UNFOLDED_KWARGS)
        and (attention_mask is None or (attention_mask.ndim == 4 and attention_mask.shape[1] == 1))
    )


def _folded_mask(
    attention_mask: torch.Tensor | None, groups: int, width: int, length: int, causal: bool, device: torch.device
) -> torch.Tensor | None:
    """The mask of a folded block: `[batch or 1, 1, groups * width, length]`, each query head's rows a copy of the
    block's; `None` where no mask is needed (one token, or no mask and no causality)."""
    if attention_mask is None:
        if width == 1 or not causal:
            return None
        # The block's last token is the cache's last column: token i sees every column up to length - width + i.
        columns = torch.arange(length, device=device)
        attention_mask = (columns[None, :] <= columns[length - width :, None])[None, None]  # [1, 1, width, length]
    if width == 1:
        return attention_mask  # broadcasts over the folded heads
    rows = attention_mask.shape[0]
    repeated = attention_mask[:, :, None].expand(rows, 1, groups, width, length)
    return repeated.reshape(rows, 1, groups * width, length)


AttentionInterface.register(ATTENTION, folded_sdpa_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def can_fold(model: PreTrainedModel) -> bool:
    """Whether `model` computes attention with transformers' SDPA function (the one folding replaces)."""
    return getattr(model.config, "_attn_implementation", None) == "sdpa"


@contextmanager
def folded_attention(model: PreTrainedModel, enabled: bool = True) -> Iterator[None]:
    """Run `model`'s forwards inside with [`folded_sdpa_attention`] when `enabled` and the model uses SDPA; otherwise
    change nothing."""
    if not (enabled and can_fold(model)):
        yield
        return
    config = model.config
    saved = config._attn_implementation
    config._attn_implementation = ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = saved
