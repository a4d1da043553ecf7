"""What speculation uses of transformers' continuous-batching engine: every import of its internals is here.

transformers' continuous batching (`transformers.generation.continuous_batching`) is not a public API: its modules
move between releases. The rest of `hf_dynspec.continuous` imports them from this module alone, so a release that
moves one is met here; `tests/test_transformers_compat.py` runs against the oldest and the newest supported release.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel
from transformers.generation.continuous_batching.cache import PagedAttentionCache, group_layers_by_attn_type
from transformers.generation.continuous_batching.cache_allocators import SLIDING_ATTENTION
from transformers.generation.continuous_batching.cb_logits_processors import ContinuousBatchingLogitsProcessorList
from transformers.generation.continuous_batching.continuous_api import (
    ContinuousBatchingManager,
    ContinuousBatchProcessor,
)
from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs
from transformers.generation.continuous_batching.requests import (
    FutureRequestState,
    GenerationOutput,
    RequestState,
    RequestStatus,
)
from transformers.generation.continuous_batching.scheduler import SCHEDULER_MAPPING, Scheduler

__all__ = [
    "SCHEDULER_MAPPING",
    "SLIDING_ATTENTION",
    "ContinuousBatchProcessor",
    "ContinuousBatchingIOs",
    "ContinuousBatchingLogitsProcessorList",
    "ContinuousBatchingManager",
    "FutureRequestState",
    "GenerationOutput",
    "PagedAttentionCache",
    "RequestState",
    "RequestStatus",
    "Scheduler",
    "group_layers_by_attn_type",
    "kept_logits",
    "supports_logits_to_keep",
    "workload_hints",
]


def supports_logits_to_keep(model: PreTrainedModel) -> bool:
    """Whether `model`'s forward computes the logits of the positions it is given alone (`logits_to_keep`)."""
    supports = getattr(model, "_supports_logits_to_keep", None)
    return callable(supports) and bool(supports())


def kept_logits(model: torch.nn.Module, batch: dict, indices: torch.Tensor, keep: bool) -> torch.Tensor:
    """`model`'s logits at the packed query positions `indices` (`[len(indices), vocab]`) of a forward over the
    engine's batch inputs, computed there alone when the model takes `logits_to_keep` (`keep`)."""
    batch["logits_indices"] = indices
    if keep:
        batch["logits_to_keep"] = indices
    logits = model(**batch).logits  # [1, kept positions (or every query position), vocab]
    return logits[0] if keep else logits[0, indices]


def workload_hints(max_prompt_length: int, max_generated_length: int, num_requests: int):
    """transformers' sizing hints of a batch of requests (`WorkloadHints`), as `model.generate_batch` gives them."""
    from transformers.generation.continuous_batching.utils import WorkloadHints  # imported when used

    return WorkloadHints(
        max_prompt_length=max_prompt_length, max_generated_length=max_generated_length, num_requests=num_requests
    )
