"""An EAGLE-3 head under continuous batching: the draft model's paged proposer, fed the target's states.

`PagedDraftRequests` drives the head as it drives a draft model (its paged cache, packed forwards, catch-ups,
coupled sampling, chains and their alternatives as trees). What a head adds is the same as in `generate`
(`candidates.eagle_head`): the target's states at the head's auxiliary layers, written after every target forward
by `TargetTap` into `HeadInputs`, where each request holds a slot; a draft token's cache entry never stays (the next
draft feeds accepted tokens again, with the target's states), and a step's whole backlog rides in its first forward.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ..candidates.eagle_head import INITIAL_POSITIONS, TargetTap
from ..eagle3 import HeadInputs, StateHead
from .engine import ContinuousBatchingManager
from .paged_draft import PagedDraftRequests
from .proposers import DraftRequest


class PagedHeadRequests(PagedDraftRequests):
    """An EAGLE-3 head drafting for the requests of a continuous batch."""

    most_inline = 64  # a step's accepted tokens and bonus token: wider backlogs are a prompt's catch-up

    def __init__(
        self, head: StateHead, target: PreTrainedModel, branching: int = 2, min_node_probability: float = 0.0
    ) -> None:
        super().__init__(head, branching, min_node_probability)
        head.bind(target)
        self.target = target
        self.slots: dict[str, int] = {}  # request id -> its slot in `states`
        self._free: list[int] = []
        self.states: HeadInputs | None = None
        self._tap: TargetTap | None = None
        self._manager: ContinuousBatchingManager | None = None

    def open(self, manager: ContinuousBatchingManager) -> None:
        super().open(manager)
        self.inline_tail = min(self.most_inline, self._max_tokens)  # a forward holds at most the step's budget
        if self.states is None:
            head = self.model
            self.states = HeadInputs(1, INITIAL_POSITIONS, head.config.hidden_size, head.dtype, head.device)
            head.inputs = self.states
            self._tap = TargetTap(self.target, head, self.states, self._columns)
        self._manager = manager

    def close(self) -> None:
        super().close()
        if self._tap is not None:
            self._tap.remove()
        self.model.inputs = None
        self.states, self._tap, self._manager = None, None, None
        self.slots.clear()
        self._free.clear()

    def start(self, request_id: str, prompt: list[int]) -> None:
        super().start(request_id, prompt)
        self.slots[request_id] = self._free.pop() if self._free else len(self.slots)

    def finish(self, request_id: str, tokens: list[int] | None) -> None:
        super().finish(request_id, tokens)
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            if self.states is not None and slot < self.states.committed.shape[0]:
                self.states.clear(slot)
            self._free.append(slot)

    @torch.no_grad()
    def _draft(
        self, requests: list[DraftRequest], lengths: list[int], width: int
    ) -> list[list[tuple[list[int], list[float]]]]:
        """`PagedDraftRequests._draft`, each request reading the target's states below its committed tokens; the
        draft tokens' cache entries are then forgotten (`seen` keeps the committed tokens alone)."""
        for request in requests:
            slot = self.slots[request.request_id]
            self.states.ensure(slot + 1, len(request.tokens) + 1)
            self.states.committed[slot] = len(request.tokens)
        drafted = super()._draft(requests, lengths, width)
        for request, length in zip(requests, lengths):
            if length > 0:
                del self._sequences[request.request_id].seen[len(request.tokens) :]
        return drafted

    def _packed_forward(self, feeds: list[tuple[str, list[int]]]) -> torch.Tensor:
        slots = [self.slots[request_id] for request_id, tokens in feeds for _ in tokens]
        self.states.columns = torch.tensor(slots, dtype=torch.long).unsqueeze(0)  # [1, packed tokens]
        try:
            return super()._packed_forward(feeds)
        finally:
            self.states.columns = None

    def _columns(self, batch: int, width: int) -> torch.LongTensor | None:
        """The slot of each column of the target's packed forward over the step's requests (-1 past them)."""
        processor = self._manager.batch_processor if self._manager is not None else None
        if processor is None or batch != 1:
            return None
        futures = processor.inputs_and_outputs.requests_in_batch
        slots = [self.slots.get(f.state.request_id, -1) for f in futures for _ in range(f.query_length)]
        if len(slots) > width:
            return None
        return torch.tensor(slots + [-1] * (width - len(slots)), dtype=torch.long).unsqueeze(0)  # [1, width]
