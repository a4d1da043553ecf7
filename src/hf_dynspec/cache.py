"""KV caches of a ragged batch: rejected entries become masked holes, later trimmed or compacted.

Every row of a batch shares one cache length, but rows accept different numbers of draft tokens. Rather than copy
caches after every step, the loop keeps a `[batch, length]` validity mask next to the cache and hands it to the model
as the 2D attention mask (with explicit per-row position ids), so a rejected entry is a *hole*: present in memory,
invisible to attention. Two cheap operations keep memory bounded:

- *trim* after every step: columns that are holes in every row at the end of the cache are cut off (a slice);
- *compaction* when holes pile up: each row's valid columns are gathered to the right (left padding preserved), so the
  cache shrinks to the longest row. It runs only when at least `DynSpecConfig.compact_min_holes` columns and more than
  `compact_hole_fraction` of the cache would be freed, so its copy is amortised over many steps and the cache never
  holds more than about `1 / (1 - compact_hole_fraction)` times (plus `compact_min_holes` columns) what the longest row
  needs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer


def cache_kwarg(forward: Callable) -> str:
    """The keyword a model's `forward` takes its KV cache by: `cache` from transformers 5.24 on, else `past_key_values`."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def generation_cache(model_kwargs: dict) -> Cache | None:
    """The KV cache `generate` prepared for a custom loop (`cache` from transformers 5.24 on, before `past_key_values`)."""
    cache = model_kwargs.get("cache")
    return model_kwargs.get("past_key_values") if cache is None else cache


def check_cache_supported(cache: Cache | None, who: str) -> None:
    """Raise a clear error unless `cache` is a `DynamicCache` of plain full-attention layers."""
    if cache is None:
        return
    if not isinstance(cache, DynamicCache):
        raise ValueError(
            f"The {who} uses a {type(cache).__name__}; hf_dynspec needs the default dynamic KV cache because it masks "
            "and compacts rejected entries. Remove `cache_implementation` / `past_key_values` from the generate call "
            "(static, quantized and offloaded caches are not supported)."
        )
    _check_layer_kinds(cache, {DynamicLayer}, who)


def _check_layer_kinds(cache: DynamicCache, allowed: set[type], who: str) -> None:
    """Raise a clear error when `cache` has a layer of a class outside `allowed`."""
    odd = sorted({type(layer).__name__ for layer in cache.layers if type(layer) not in allowed})
    if odd:
        raise ValueError(
            f"The {who}'s KV cache has layers of type {odd}, which cannot hold masked entries or be cropped and "
            "compacted (chunked-attention, linear-attention and quantized layers). Use a model with full or "
            f"sliding-window attention in every layer as the {who}."
        )


@dataclass(frozen=True)
class SlidingWindows:
    """How a model with sliding-window attention layers attends: in a sliding layer a token sees the `window` newest
    positions up to itself (transformers' `sliding_window`); `hybrid`: some layers attend to everything, and the model
    takes a mask per layer type (`full_attention`, `sliding_attention`)."""

    window: int
    hybrid: bool


def sliding_windows(model: PreTrainedModel, who: str) -> SlidingWindows | None:
    """The sliding windows of `model`'s attention layers, read from the cache transformers builds for it; `None` when
    every layer attends to the whole sequence. The loop then keeps every layer's whole cache (it masks and compacts
    entries, which a sliding-window cache layer cannot) and applies the window in its attention masks. Layers of
    other kinds (chunked or linear attention), or windows that differ between layers, raise a clear error."""
    text = model.config.get_text_config(decoder=True)
    types = set(getattr(text, "layer_types", None) or ())
    if getattr(text, "attention_chunk_size", None) is not None:  # how transformers asks for chunked attention
        types.add("chunked_attention")
    if types - {"full_attention", "sliding_attention"}:
        raise ValueError(
            f"The {who} has attention layers of types {sorted(types)}; hf_dynspec supports full and sliding-window "
            f"attention only (chunked and linear attention cannot see masked entries as the loop needs). Use a model "
            f"with full or sliding-window attention in every layer as the {who}."
        )
    cache = DynamicCache(config=model.config)
    _check_layer_kinds(cache, {DynamicLayer, DynamicSlidingWindowLayer}, who)
    windows = {layer.sliding_window for layer in cache.layers if type(layer) is DynamicSlidingWindowLayer}
    if not windows:
        return None
    if len(windows) > 1:
        raise ValueError(
            f"The {who}'s sliding-window layers use different windows ({sorted(windows)}); hf_dynspec applies one "
            f"window per model. Use a model with one sliding window (or full attention) as the {who}."
        )
    return SlidingWindows(window=int(windows.pop()), hybrid=any(type(layer) is DynamicLayer for layer in cache.layers))


def loop_cache(model: PreTrainedModel, windows: SlidingWindows | None) -> DynamicCache:
    """An empty KV cache for `model` in the loop: full layers throughout when it has sliding windows (the loop's masks
    apply them), otherwise the cache transformers builds for it."""
    return DynamicCache() if windows is not None else DynamicCache(config=model.config)


def cached_prefix(cache: Cache | None, prompt: torch.LongTensor, windows: SlidingWindows | None) -> int:
    """How many of the prompt's first tokens `cache` already holds (a prompt prefix computed beforehand, as for
    transformers' prompt caching); 0 without one. Raises a clear error for a prefix the loop cannot continue from.

    Args:
        prompt: `[batch, width]` the whole prompt, cached prefix included.
    """
    length = 0 if cache is None else cache.get_seq_length()
    if length == 0:
        return 0
    if windows is not None:
        raise ValueError(
            f"The KV cache passed to `generate` already holds {length} tokens, and the target has sliding-window "
            "attention, whose cache layers keep only the newest entries; the loop needs every entry of the prefix. "
            "Pass the whole prompt as `input_ids` and no prefilled cache."
        )
    check_cache_supported(cache, "target model")
    rows = next(layer.keys.shape[0] for layer in cache.layers if layer.is_initialized)
    if rows != prompt.shape[0]:
        raise ValueError(
            f"The KV cache passed to `generate` holds a prefix for {rows} row(s), but the prompt has "
            f"{prompt.shape[0]}. Give the cache one row per prompt row (e.g. `cache.batch_repeat_interleave(n)`)."
        )
    if length >= prompt.shape[1]:
        raise ValueError(
            f"The KV cache passed to `generate` already holds {length} tokens, but the prompt has {prompt.shape[1]}: "
            "pass the whole prompt as `input_ids`, with at least one token after the cached prefix."
        )
    return length


class RaggedCache:
    """A `DynamicCache` plus the validity of each of its columns for every row.

    The validity is kept twice: on the cache's device for the attention masks (`valid`), and on the host
    (`host_valid`), where the decisions to trim and compact are taken without reading the device. Callers that know
    a new validity on the host pass it along (`host_mask`, `host_validity`, `host_keep`); otherwise it is copied
    from the device (a synchronisation on an accelerator).
    """

    def __init__(self, cache: DynamicCache, valid: torch.LongTensor, min_holes: int, hole_fraction: float) -> None:
        self.cache = cache
        self.valid = valid  # [batch, length] 1 where the entry is part of the row's sequence
        self.host_valid = valid.to("cpu", copy=True)  # [batch, length] the same on the host
        self.min_holes = min_holes
        self.hole_fraction = hole_fraction
        self.compactions = 0

    @property
    def length(self) -> int:
        return int(self.valid.shape[1])

    def begin(self, query_mask: torch.LongTensor, host_mask: torch.LongTensor | None = None) -> torch.LongTensor:
        """Register the columns a forward is about to append and return its 2D attention mask.

        Args:
            query_mask: `[batch, width]` 1 for real input tokens, 0 for padding inside the input block.
            host_mask: the same on the host, if the caller has it.

        Returns:
            `[batch, length + width]` attention mask covering the cache and the new tokens.
        """
        host_mask = query_mask.to("cpu", copy=True) if host_mask is None else host_mask
        self.valid = torch.cat([self.valid, query_mask.to(self.valid.device, self.valid.dtype)], dim=1)
        self.host_valid = torch.cat([self.host_valid, host_mask.to(self.host_valid.dtype)], dim=1)
        return self.valid

    def set_last(self, validity: torch.LongTensor, host_validity: torch.LongTensor | None = None) -> None:
        """Overwrite the validity of the last `validity.shape[1]` columns (`[batch, width]`; `host_validity`: the
        same on the host, if the caller has it)."""
        width = validity.shape[1]
        if width:
            host_validity = validity.to("cpu", copy=True) if host_validity is None else host_validity
            self.valid[:, -width:] = validity.to(self.valid.device, self.valid.dtype)
            self.host_valid[:, -width:] = host_validity.to(self.host_valid.dtype)

    def settle(self) -> None:
        """Trim trailing holes and compact when enough holes have accumulated."""
        self._trim()
        freeable = self.length - int(self.host_valid.sum(dim=1).max()) if self.length else 0
        if freeable >= self.min_holes and freeable > self.hole_fraction * self.length:
            self._compact()

    def select_rows(self, keep: torch.LongTensor, host_keep: torch.LongTensor | None = None) -> None:
        """Keep only the rows at indices `keep` (`[new_batch]`; `host_keep`: the same on the host, if known)."""
        host_keep = keep.to("cpu", copy=True) if host_keep is None else host_keep
        self.cache.batch_select_indices(keep.to(self.valid.device))
        self.valid = self.valid[keep]
        self.host_valid = self.host_valid[host_keep]
        self.settle()

    def _layers(self) -> list[DynamicLayer]:
        return [layer for layer in self.cache.layers if layer.is_initialized and layer.keys.numel()]

    def _trim(self) -> None:
        used = self.host_valid.any(dim=0).nonzero()
        new_length = int(used.max()) + 1 if used.numel() else 0
        if new_length == self.length:
            return
        for layer in self._layers():
            layer.keys = layer.keys[..., :new_length, :]
            layer.values = layer.values[..., :new_length, :]
        self.valid = self.valid[:, :new_length]
        self.host_valid = self.host_valid[:, :new_length]

    def _compact(self) -> None:
        new_length = int(self.host_valid.sum(dim=1).max())
        # A stable sort puts each row's holes first and its valid columns last, in their original order.
        order = torch.sort(self.valid, dim=1, stable=True).indices[:, -new_length:]  # [batch, new_length]
        for layer in self._layers():
            index = order.to(layer.keys.device)[:, None, :, None]  # [batch, 1, new_length, 1]
            layer.keys = layer.keys.gather(2, index.expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3]))
            layer.values = layer.values.gather(2, index.expand(-1, layer.values.shape[1], -1, layer.values.shape[3]))
        self.valid = self.valid.gather(1, order)
        host_order = torch.sort(self.host_valid, dim=1, stable=True).indices[:, -new_length:]
        self.host_valid = self.host_valid.gather(1, host_order)
        self.compactions += 1
