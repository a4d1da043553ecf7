"""Where draft and target live. Every move of ids, masks and logits between them goes through here.

The loop works on the *loop device*: the device of the `input_ids` that `generate` prepared for the target. Draft
and target may sit on different devices (or accelerate device maps) and use different dtypes; inputs go to each
model's input-embedding device, and logits come back to the loop device as float32.
"""

from __future__ import annotations

import functools
import inspect
import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from .cache import RaggedCache


@functools.cache
def _accepts_logits_to_keep(model_class: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def logits_kwargs(model: PreTrainedModel, keep: int) -> dict[str, int]:
    """`{"logits_to_keep": keep}` when the model's forward accepts it (it then computes only the last logits)."""
    return {"logits_to_keep": keep} if _accepts_logits_to_keep(type(model)) else {}


def input_device(model: PreTrainedModel) -> torch.device:
    """The device a model's input ids must be on (its input embeddings' device, which works for device maps)."""
    return model.get_input_embeddings().weight.device


@dataclass
class Placement:
    """The loop device and the input devices of target and draft."""

    loop_device: torch.device
    target_device: torch.device
    draft_device: torch.device | None

    @classmethod
    def of(cls, loop_device: torch.device, target: PreTrainedModel, draft: PreTrainedModel | None) -> Placement:
        return cls(loop_device, input_device(target), input_device(draft) if draft is not None else None)

    def forward(
        self,
        model: PreTrainedModel,
        cache: RaggedCache,
        ids: torch.LongTensor,
        query_mask: torch.LongTensor,
        positions: torch.LongTensor,
        keep: int,
    ) -> torch.Tensor:
        """One forward of `model` (target or draft) over new tokens, extending its ragged cache.

        Args:
            model: the target or the draft model.
            cache: that model's ragged cache; the new columns are registered in it.
            ids: `[batch, width]` new tokens.
            query_mask: `[batch, width]` 1 on real tokens, 0 on padding inside the block.
            positions: `[batch, width]` position ids of the new tokens.
            keep: how many trailing positions need logits.

        Returns:
            `[batch, keep, vocab]` float32 logits on the loop device.
        """
        device = input_device(model)
        attention_mask = cache.begin(query_mask)
        output = model(
            input_ids=ids.to(device, non_blocking=True),
            attention_mask=attention_mask.to(device, non_blocking=True),
            position_ids=positions.to(device, non_blocking=True),
            past_key_values=cache.cache,
            use_cache=True,
            **logits_kwargs(model, keep),
        )
        return self.logits_to_loop(output.logits[:, -keep:])

    def logits_to_loop(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits from either model, as float32 on the loop device (a copy only when device or dtype differ)."""
        return logits.to(self.loop_device, dtype=torch.float32)

    def clock(self) -> float:
        """Wall time after waiting for pending accelerator work, so step timings are honest."""
        for device in {self.target_device, self.draft_device} - {None}:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        return time.perf_counter()
