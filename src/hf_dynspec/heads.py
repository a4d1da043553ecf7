"""Draft heads named by a string (`DynSpecConfig.draft_head`), loaded once per target and kept with it.

A head is bound to the target it reads, so the target keeps the heads loaded for it (an attribute of the model, not
a module-level registry): a second call reuses the head object, and with it the policy learned for the pair.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from .devices import input_device
from .eagle3 import Eagle3Head, StateHead
from .mtp import MtpHead

MTP = "mtp"
"""`draft_head` that names the target's own MTP layers."""

_KEPT = "_hf_dynspec_heads"
"""The target's attribute holding its loaded heads, by name."""


def head_for(model: PreTrainedModel, name: str) -> StateHead:
    """The draft head `name` names for `model` (`DynSpecConfig.draft_head`), loaded on first use."""
    kept: dict[str, StateHead] = model.__dict__.setdefault(_KEPT, {})
    if name not in kept:
        kept[name] = _load(model, name)
    return kept[name]


def _load(model: PreTrainedModel, name: str) -> StateHead:
    if name == MTP:
        return MtpHead.from_target(model)
    dtype = model.dtype if model.dtype.is_floating_point else torch.float32
    return Eagle3Head.from_pretrained(name, dtype=dtype, device=input_device(model))
