"""transformers' continuous-batching manager whose steps speculate (`SpeculativeManager`)."""

from __future__ import annotations

from typing import Any

from transformers import ContinuousBatchingConfig, GenerationConfig, PreTrainedModel

from ..coupling import StreamBook
from .batch_processor import SpeculativeBatchProcessor
from .engine import (
    SLIDING_ATTENTION,
    ContinuousBatchingManager,
    ContinuousBatchProcessor,
    GenerationOutput,
    PagedAttentionCache,
    RequestStatus,
    group_layers_by_attn_type,
)
from .scheduling import draft_aware_scheduler
from .speculator import SpeculationStats, Speculator


class SpeculativeManager(ContinuousBatchingManager):
    """transformers' `ContinuousBatchingManager` (same API: `add_request`, `get_result`, `request_id_iter`, `start`,
    `stop`, ...) whose steps speculate. `speculation` holds what it drafted and accepted."""

    def __init__(
        self,
        model: PreTrainedModel,
        generation_config: GenerationConfig,
        continuous_batching_config: ContinuousBatchingConfig,
        workload_hints: Any = None,
        *,
        speculator: Speculator,
    ) -> None:
        check_attention(model)
        super().__init__(model, generation_config, continuous_batching_config, workload_hints)
        self.speculator = speculator
        config = self.continuous_batching_config
        _check_servable(config)
        config.scheduler_type = draft_aware_scheduler(config.scheduler_type)

    @property
    def speculation(self) -> SpeculationStats:
        return self.speculator.stats

    def add_request(self, input_ids: list[int], request_id: str | None = None, *args: Any, **kwargs: Any) -> str | None:
        """transformers' `add_request`; under coupled sampling the request's stream is assigned now, in the order
        requests arrive (`coupling.StreamBook`: samples of one prompt added together are its indices 0, 1, ...)."""
        streams = self.speculator.streams
        if streams is None:
            return super().add_request(input_ids, request_id, *args, **kwargs)
        if request_id is None:  # named here, as transformers would, so the stream is assigned before it can run
            with self._request_lock:
                request_id = f"req_{self._request_counter}"
                self._request_counter += 1
        streams.assign(request_id, list(input_ids))
        added = super().add_request(input_ids, request_id, *args, **kwargs)
        if added is None:
            streams.release(request_id)
        return added

    def cancel_request(self, request_id: str) -> None:
        super().cancel_request(request_id)
        if self.speculator.streams is not None and request_id not in self.speculator.rows:
            self.speculator.streams.release(request_id)  # a request cancelled before it decoded

    def held_blocks(self) -> dict[str, dict[str, int]]:
        """The blocks each request holds in the target's paged cache and, with a draft model, in the draft's: by
        cache (`"target"`, `"draft"`), by request id. Finished and cancelled requests hold none."""
        processor, proposer = self.batch_processor, self.speculator.proposer
        held = {"target": held_blocks(processor.cache if processor is not None else None)}
        if proposer.model is not None:
            held["draft"] = held_blocks(getattr(proposer, "cache", None))
        return held

    def _create_batch_processor(self) -> ContinuousBatchProcessor:
        config, draft = self.continuous_batching_config, self.speculator.proposer.model
        budget = config.max_memory_percent
        if draft is not None and config.num_blocks is None and budget is not None:
            # Sized by memory, the target's cache would take the whole budget and leave too little for the draft's,
            # opened next for as many tokens. A cache's footprint grows with its key-value bytes per token, and its
            # attention masks and activations are no smaller for the draft: the target's cache takes T / (T + max(T, D))
            # of the budget (half, for a draft no wider per token), which leaves the draft's enough of the rest.
            target, drafting = _kv_bytes_per_token(self.model), _kv_bytes_per_token(draft)
            config.max_memory_percent = budget * target / (target + max(target, drafting))
        try:
            processor = SpeculativeBatchProcessor.adopt(super()._create_batch_processor(), self.speculator)
        finally:
            config.max_memory_percent = budget
        self.speculator.proposer.open(self)
        if processor.coupled:
            self.speculator.proposer.couple(self.speculator.streams, float(self.generation_config.temperature or 1.0))
            _release_streams_when_finished(processor.output_router, self.speculator.streams)
        return processor

    def stop(self, *args, **kwargs) -> None:
        super().stop(*args, **kwargs)
        if not self.is_running():
            self.speculator.finish_all()
            self.speculator.proposer.close()


def _release_streams_when_finished(router: Any, streams: StreamBook) -> None:
    """Free a finished request's stream index before its output reaches the caller: the caller may request the same
    prompt again at once, which must find the same stream (`StreamBook`)."""
    deliver_batch = router.deliver_batch

    def deliver_releasing(outputs: list[GenerationOutput]) -> None:
        for output in outputs:
            if output.status == RequestStatus.FINISHED:
                streams.release(output.request_id)
        deliver_batch(outputs)

    router.deliver_batch = deliver_releasing


def held_blocks(cache: PagedAttentionCache | None) -> dict[str, int]:
    """The blocks of `cache` each request holds, by request id, over its attention types (blocks kept for prefix
    sharing, which no request holds, are not counted)."""
    held: dict[str, int] = {}
    for allocator in cache.cache_allocators.values() if cache is not None else ():
        for request_id, blocks in list(allocator.block_table.items()):  # a copy: the generation thread may add one
            held[request_id] = held.get(request_id, 0) + len(blocks)
    return held


def _kv_bytes_per_token(model: PreTrainedModel) -> int:
    """Bytes the keys and values of one token take in `model`'s paged cache, over all its layers."""
    config = model.config.get_text_config()
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * 2 * heads * head_dim * model.dtype.itemsize


def check_attention(model: PreTrainedModel) -> None:
    layer_types = group_layers_by_attn_type(model.config.get_text_config())
    if SLIDING_ATTENTION in layer_types:
        raise ValueError(
            "Speculation under continuous batching needs full-attention layers: this model has sliding-window layers, "
            "whose ring buffer in the paged cache cannot take back rejected draft tokens. Use `model.generate_batch` "
            "without speculation, or `hf_dynspec.generate` (batched `generate`) for this model."
        )


def _check_servable(config: ContinuousBatchingConfig) -> None:
    """A clear error for settings a speculating manager cannot serve."""
    if config.use_async_batching:
        raise ValueError(
            "Speculation under continuous batching runs synchronous steps (the drafts of a step depend on the tokens "
            "of the step before): pass `ContinuousBatchingConfig(use_async_batching=False)`."
        )
    if any(config.cuda_graph_booleans) or config.varlen_compile_config or config.decode_compile_config:
        raise ValueError(
            "Speculation under continuous batching runs its verify forwards eagerly: pass "
            "`ContinuousBatchingConfig(use_cuda_graph=False)` and no compile configs."
        )
