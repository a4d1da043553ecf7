"""Packed verify forwards: the linear layers compute only the tokens rows actually propose.

The loop pads every row of a verify forward to the widest row's tokens (`[batch, width]`), so at batch 16 one row's
4-token match makes all 16 rows pay 5 tokens in every linear layer, which is where a forward's time goes. A packed
forward feeds the model the real tokens alone, as one sequence `[1, total]` (`total = sum_i (1 + k_i)`), so every
projection and MLP computes `total` rows; only attention, which needs each row's own cache, runs on the padded layout.
Two seams of transformers make this possible without touching model code:

- an attention function registered in `AttentionInterface` (`ATTENTION`) unpacks the queries into the padded
  `[batch, heads, width, dim]` layout, runs the model's own SDPA attention with the loop's 4D mask, and packs the
  result back;
- a cache wrapper (`PackedCache`) unpacks each layer's new keys and values into the padded layout before the loop's
  cache stores them, so the cache, its holes and its masks are those of a padded forward.

Rotary position embeddings are applied per token from the packed position ids, before either step. The model's own
mask construction is skipped (transformers builds no mask for an attention function without a mask interface); the
attention function uses the loop's mask. Models with sliding windows, eager attention or tensor parallelism run padded.
A packed forward switches the model's attention implementation for its duration, so one model object runs one packed
forward at a time (as it runs one `generate` loop at a time).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .attention import folded_sdpa_attention
from .devices import tensor_parallel_group, upload

ATTENTION = "dynspec_packed"
"""Name of the packed attention function in transformers' `AttentionInterface`."""


@dataclass
class Packing:
    """Where each packed token sits in the padded block, and the mask its attention uses."""

    flat: torch.LongTensor  # [total] row * width + column of each real token, row-major
    batch: int
    width: int
    mask: torch.Tensor  # [batch, 1, width, length + width] the loop's attention mask
    fold: bool = True  # attention with grouped-query heads folded (`hf_dynspec.attention`)

    @classmethod
    def of(
        cls, query_mask: torch.LongTensor, mask: torch.Tensor, fold: bool = True, device: torch.device | None = None
    ) -> Packing:
        """The packing of a `[batch, width]` block whose real tokens are the 1s of `query_mask`. Given a `device`,
        `query_mask` is on the host and the positions go to `device` without a synchronisation."""
        batch, width = query_mask.shape
        flat = query_mask.reshape(-1).nonzero().squeeze(1)  # [total]
        if device is not None:
            flat = upload(flat, device)
        return cls(flat, batch, width, mask, fold)

    @property
    def total(self) -> int:
        return int(self.flat.shape[0])

    def pack(self, padded: torch.Tensor) -> torch.Tensor:
        """`[batch, width, ...]` -> `[1, total, ...]`."""
        flat = padded.reshape(self.batch * self.width, *padded.shape[2:])
        return flat.index_select(0, self.flat.to(padded.device)).unsqueeze(0)

    def unpack_heads(self, packed: torch.Tensor) -> torch.Tensor:
        """`[1, heads, total, dim]` -> `[batch, heads, width, dim]`, zeros on padding."""
        heads, dim = packed.shape[1], packed.shape[3]
        padded = packed.new_zeros((heads, self.batch * self.width, dim))
        padded.index_copy_(1, self.flat.to(packed.device), packed[0])
        return padded.view(heads, self.batch, self.width, dim).transpose(0, 1)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """`[1, total, ...]` -> `[batch, width, ...]`, zeros on padding."""
        padded = packed.new_zeros((self.batch * self.width, *packed.shape[2:]))
        padded.index_copy_(0, self.flat.to(packed.device), packed[0])
        return padded.view(self.batch, self.width, *packed.shape[2:])


_ACTIVE: list[Packing] = []
"""The packing of the forward running now (a stack of at most one)."""


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """SDPA attention of packed queries (`[1, heads, total, dim]`) over the padded keys and values the cache returned
    (`[batch, kv_heads, length + width, dim]`), folded where `packing.fold`; returns `[1, total, heads, dim]` as
    attention functions do."""
    packing = _ACTIVE[-1]
    kwargs.pop("sliding_window", None)  # models with sliding windows are never packed
    attend = folded_sdpa_attention if packing.fold else sdpa_attention_forward
    output, _ = attend(module, packing.unpack_heads(query), key, value, packing.mask.to(query.device),
                       **kwargs)  # [batch, width, heads, dim]
    return packing.pack(output), None


AttentionInterface.register(ATTENTION, packed_attention)


class PackedCache(Cache):
    """The loop's cache seen by a packed forward: new keys and values (`[1, kv_heads, total, dim]`) are unpacked into
    the padded layout before `cache` stores them; everything else is `cache`'s."""

    def __init__(self, cache: Cache, packing: Packing) -> None:
        # no `super().__init__()`: the wrapper holds no layers of its own, every attribute comes from `cache`
        self.cache = cache
        self.packing = packing

    def __getattr__(self, name: str):
        return getattr(self.__dict__["cache"], name)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = self.packing.unpack_heads(key_states), self.packing.unpack_heads(value_states)
        return self.cache.update(keys, values, layer_idx, *args, **kwargs)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.cache.get_seq_length(layer_idx)

    def __len__(self) -> int:
        return len(self.cache)


def can_pack(model: PreTrainedModel) -> bool:
    """Whether `model`'s forwards can be packed: SDPA attention, no sliding windows, no tensor parallelism."""
    from .cache import sliding_windows
    config = model.config.get_text_config()
    return (
        getattr(model.config, "_attn_implementation", None) == "sdpa"
        and sliding_windows(model, "target model") is None
        and tensor_parallel_group(model) is None
        and not getattr(config, "is_encoder_decoder", False)
    )


@contextmanager
def packed(model: PreTrainedModel, packing: Packing):
    """Run `model`'s forwards inside with packed attention over `packing`."""
    config = model.config
    saved = config._attn_implementation
    config._attn_implementation = ATTENTION
    _ACTIVE.append(packing)
    try:
        yield
    finally:
        _ACTIVE.pop()
        config._attn_implementation = saved
