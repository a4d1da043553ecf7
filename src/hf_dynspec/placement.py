"""Where draft and target live. Every move of ids, masks and logits between them goes through here.

The loop works on the *loop device*: the device of the `input_ids` that `generate` prepared for the target. Draft
and target may sit on different devices (or accelerate device maps, with CPU or disk offload) and use different dtypes
or quantizations; inputs go to each model's input device (where its input embeddings run), and logits come back to the
loop device as float32.
"""

from __future__ import annotations

import functools
import inspect
import time
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from .attention import folded_attention
from .cache import RaggedCache, SlidingWindows, cache_kwarg, sliding_windows
from .candidates.draft_head import DraftHead
from .candidates.tree import block_attention_mask, causal_visibility, windowed_attention_masks
from .clocks import Instant, Seconds, elapsed
from .devices import input_device, model_devices
from .kernels import LinearPlan, linear_plan, narrow_linear, row_major_output
from .packing import PackedCache, Packing, packed


@functools.cache
def _accepts_logits_to_keep(model_class: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


@functools.cache
def _cache_kwarg(model_class: type) -> str:
    return cache_kwarg(model_class.forward)


def logits_kwargs(model: PreTrainedModel, keep: int) -> dict[str, int]:
    """`{"logits_to_keep": keep}` when the model's forward accepts it (it then computes only the last logits)."""
    return {"logits_to_keep": keep} if _accepts_logits_to_keep(type(model)) else {}


@dataclass
class Placement:
    """The loop device, the input devices of target and draft, and every CUDA device either model computes on."""

    loop_device: torch.device
    target_device: torch.device
    draft_device: torch.device | None
    cuda_devices: tuple[torch.device, ...] = ()
    """Devices `clock` waits for: all CUDA devices of both models (a device map may span several)."""
    linear_plans: dict[int, LinearPlan] = field(default_factory=dict)
    """Per model (by `id`): how its forwards compute linear layers (`kernels.NarrowLinear`: weight-first over a few
    rows, padded row counts); absent: unchanged."""
    windows: dict[int, SlidingWindows | None] = field(default_factory=dict)
    """Per model (by `id`): its sliding-window attention (`cache.sliding_windows`); absent or `None`: full attention."""
    fold_attention: bool = True
    """Forwards of models with SDPA attention fold grouped-query heads into the query length (`hf_dynspec.attention`)."""

    @classmethod
    def of(
        cls,
        loop_device: torch.device,
        target: PreTrainedModel,
        draft: PreTrainedModel | None,
        narrow_linear: str = "off",
        fold_attention: bool = True,
    ) -> Placement:
        """Where `target` and `draft` live; `narrow_linear` and `fold_attention` are `DynSpecConfig`'s (see
        `narrow_rows`, `hf_dynspec.attention`)."""
        devices = model_devices(target) | (model_devices(draft) if draft is not None else set()) | {loop_device}
        cuda = tuple(sorted({d for d in devices if d.type == "cuda"}, key=str))
        plans = {id(m): linear_plan(m, narrow_linear) for m in (target, draft) if m is not None}
        roles = {"target model": target, "draft model": draft}
        windows = {id(m): sliding_windows(m, role) for role, m in roles.items() if m is not None}
        draft_device = input_device(draft) if draft is not None else None
        return cls(loop_device, input_device(target), draft_device, cuda, plans, windows, fold_attention)

    @property
    def narrow_rows(self) -> dict[int, int]:
        """Per model (by `id`): the most rows its forwards compute weight-first; absent or 0: none."""
        return {key: plan.narrow_rows for key, plan in self.linear_plans.items()}

    def forward(
        self,
        model: PreTrainedModel,
        cache: RaggedCache,
        ids: torch.LongTensor,
        query_mask: torch.LongTensor,
        positions: torch.LongTensor,
        keep: int,
        visibility: torch.BoolTensor | None = None,
        head: DraftHead | None = None,
        pack: bool = False,
        host_mask: torch.LongTensor | None = None,
    ) -> torch.Tensor:
        """One forward of `model` (target or draft) over new tokens, extending its ragged cache.

        Args:
            model: the target or the draft model.
            cache: that model's ragged cache; the new columns are registered in it.
            ids: `[batch, width]` new tokens.
            query_mask: `[batch, width]` 1 on real tokens, 0 on padding inside the block.
            positions: `[batch, width]` position ids of the new tokens.
            keep: how many trailing positions need logits.
            visibility: `[batch, width, length + width]` what each new token may see (token trees, see
                `TokenTree.visibility`), passed as a 4D mask; `None` for a causal block (2D mask).
            head: the draft's output layer over part of the vocabulary (`-inf` elsewhere); `None`: the model's own.
            pack: compute only the real tokens (`hf_dynspec.packing`) when the block has padding, `visibility` is
                given, every position's logits are kept, and the model can be packed (`can_pack`).
            host_mask: `query_mask` on the host, if the caller has it (else copied from the device).

        Returns:
            `[batch, keep, vocab]` float32 logits on the loop device.
        """
        device = input_device(model)
        host_mask = query_mask.to("cpu", copy=True) if host_mask is None else host_mask
        attention_mask = self._attention_mask(model, cache, query_mask, positions, visibility, host_mask)
        holes = pack and visibility is not None and keep == ids.shape[1] and head is None
        if holes and bool((host_mask == 0).any()):
            return self._packed_forward(model, cache, ids, host_mask, positions, attention_mask)
        inputs = dict(
            input_ids=ids.to(device, non_blocking=True),
            attention_mask=_to(attention_mask, device),
            position_ids=positions.to(device, non_blocking=True),
            use_cache=True,
        )
        plan = self.linear_plans.get(id(model), LinearPlan())
        with narrow_linear(plan, ids.numel()), row_major_output(model), folded_attention(model, self.fold_attention):
            if head is not None:
                inputs[_cache_kwarg(type(head.decoder))] = cache.cache
                hidden = head.decoder(**inputs).last_hidden_state[:, -keep:]  # [batch, keep, hidden]
                return self.logits_to_loop(head.logits(hidden))
            inputs[_cache_kwarg(type(model))] = cache.cache
            output = model(**inputs, **logits_kwargs(model, keep))
        return self.logits_to_loop(output.logits[:, -keep:])

    def _packed_forward(
        self,
        model: PreTrainedModel,
        cache: RaggedCache,
        ids: torch.LongTensor,
        host_mask: torch.LongTensor,
        positions: torch.LongTensor,
        attention_mask: torch.Tensor,
    ) -> torch.Tensor:
        """`forward` over the real tokens of the block alone (`hf_dynspec.packing`; `host_mask`: its real tokens, on
        the host): `[batch, width, vocab]` logits, zeros on padding."""
        device = input_device(model)
        packing = Packing.of(host_mask, _to(attention_mask, device), self.fold_attention, device)
        inputs = dict(input_ids=packing.pack(ids.to(device)), position_ids=packing.pack(positions.to(device)),
                      use_cache=True)  # [1, total] each
        inputs[_cache_kwarg(type(model))] = PackedCache(cache.cache, packing)
        plan = self.linear_plans.get(id(model), LinearPlan())
        with narrow_linear(plan, inputs["input_ids"].numel()), row_major_output(model), packed(model, packing):
            output = model(**inputs, **logits_kwargs(model, 0))  # [1, total, vocab]
        return self.logits_to_loop(packing.unpack(output.logits))

    def _attention_mask(
        self,
        model: PreTrainedModel,
        cache: RaggedCache,
        query_mask: torch.LongTensor,
        positions: torch.LongTensor,
        visibility: torch.BoolTensor | None,
        host_mask: torch.LongTensor | None = None,
    ) -> torch.Tensor | dict[str, torch.Tensor] | None:
        """The mask of a forward, after registering its new columns in `cache`: 2D over cache and new tokens for a
        causal block (for one token per row under SDPA, the 4D mask transformers would build, `_one_token_sdpa_mask`);
        4D for token trees and for models with sliding windows (a mask per layer type for a hybrid model, see
        `windowed_attention_masks`)."""
        cache_valid = cache.valid  # [batch, length] before this forward's columns
        mask = cache.begin(query_mask, host_mask)
        windows = self.windows.get(id(model))
        if windows is None and visibility is None:
            if query_mask.shape[1] == 1 and getattr(model.config, "_attn_implementation", None) == "sdpa":
                return _one_token_sdpa_mask(mask, cache.host_valid)
            return mask
        if visibility is None:
            visibility = causal_visibility(cache_valid.shape[1], query_mask.to(cache_valid.device))
        visibility = visibility.to(cache_valid.device)
        if windows is None:
            return block_attention_mask(cache_valid, visibility, model.dtype)
        return windowed_attention_masks(cache_valid, visibility, positions, windows, model.dtype)

    def logits_to_loop(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits from either model, as float32 on the loop device (a copy only when device or dtype differ)."""
        return logits.to(self.loop_device, dtype=torch.float32)

    def clock(self) -> float:
        """Wall time after waiting for pending CUDA work on every device of both models (a synchronisation): for
        timings taken once, outside the steps. Steps time themselves with `instant` and `since`, which never wait.

        On a CPU every forward (and every accelerate offload copy) is synchronous, so no wait is needed there.
        """
        for device in self.cuda_devices:
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def instant(self) -> Instant:
        """Now, on the host's clock and on every CUDA device of both models (an event on each device's current
        stream), recorded without waiting for the device."""
        return Instant.now(self.cuda_devices)

    def since(self, start: Instant, end: Instant | None = None) -> float | Seconds:
        """Seconds from `start` to `end` (default: now), as `elapsed`."""
        return elapsed(start, end)


def _one_token_sdpa_mask(mask: torch.LongTensor, host_mask: torch.LongTensor) -> torch.BoolTensor | None:
    """The attention mask of a forward over one new token per row for a model with SDPA attention, from its 2D mask
    (`mask` `[batch, length]`, and the same on the host): what transformers builds from it, built here because
    transformers would read the mask on the device to find out whether it may leave it out. `None` (SDPA without a
    mask) when every entry is 1; else `[batch, 1, 1, length]`, True where visible."""
    return None if bool(host_mask.all()) else mask.bool()[:, None, None, :]


def _to(
    mask: torch.Tensor | dict[str, torch.Tensor] | None, device: torch.device
) -> torch.Tensor | dict[str, torch.Tensor] | None:
    """An attention mask (or a model's masks per layer type) on `device`."""
    if mask is None:
        return None
    if isinstance(mask, dict):
        return {kind: value.to(device, non_blocking=True) for kind, value in mask.items()}
    return mask.to(device, non_blocking=True)
