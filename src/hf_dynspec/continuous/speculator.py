"""Each step's drafts and what the policy learns from them: the part of continuous batching that is the loop's policy.

Before transformers' scheduler builds a step, the `Speculator` asks the proposer for hints (model-free offers, a
draft model's backlog), the policy for each decoding request's draft length (and, for trees, its node budget), and
the proposer for the drafts; the request's query becomes its newest token and its draft. After the forward it books
the step's time and each request's accepted tokens with the policy, as the loop does (`hf_dynspec.loop`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from ..clocks import Instant, Seconds, elapsed
from ..coupling import StreamBook
from ..devices import cuda_devices
from ..policies import DraftLengthPolicy, PolicyInput, PrefillFeedback, StepFeedback, parameter_ratio
from .engine import FutureRequestState, RequestState, RequestStatus
from .proposers import DraftRequest, RequestProposer


@dataclass
class SpeculationStats:
    """What a speculating manager did, over its whole life (`SpeculativeManager.speculation`)."""

    requests: int = 0  # requests that decoded
    unfinished: int = 0  # of those, requests that left before they finished (cancelled or failed)
    steps: int = 0  # forwards
    decode_steps: int = 0  # forwards with at least one decoding request
    drafting_steps: int = 0  # forwards in which a request drafted
    draft_tokens: int = 0  # draft tokens verified (every node of a token tree)
    free_tokens: int = 0  # of those, from model-free offers (all of a model-free proposer's; a hybrid's share)
    accepted_tokens: int = 0  # of those, accepted
    emitted_tokens: int = 0  # tokens decoding requests emitted (accepted ones and one per decoding request and step)
    forward_seconds: float = 0.0  # in the steps' forwards (prompt chunks, decoding tokens and drafts verified)
    draft_seconds: float = 0.0  # proposing drafts (a draft model's forwards and catch-ups included)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0


@dataclass
class _Row:
    """A decoding request's part of the step being built."""

    state: RequestState
    slot: int  # the request's row id for the policy
    requested: int  # draft tokens the policy asked for (a tree's depth)
    draft: list[int] = field(default_factory=list)  # draft tokens the request verifies (after the scheduler's cut)
    parents: list[int] | None = None  # a token tree's: each draft token's parent node (0 = the newest token)
    free: bool = False  # its draft is a model-free offer (not the draft model's)

    @property
    def depth(self) -> int:
        """Draft tokens on the longest path: the draft's length for a chain."""
        if self.parents is None:
            return len(self.draft)
        return int(ancestry([-1] + self.parents)[1].max())


class Speculator:
    """The draft tokens of every decoding request each step, and what the policy learns from their verification.

    Requests are rows for the policy: a request keeps its row id (`slot`) from its first decoding step to its end;
    a finished request's row id goes to the next request, and the policy forgets that row (`forget_rows`).
    """

    def __init__(
        self,
        target: PreTrainedModel,
        proposer: RequestProposer,
        policy: DraftLengthPolicy,
        max_draft_tokens: int,
        max_tree_nodes: int = 0,
        streams: StreamBook | None = None,
    ) -> None:
        self.target = target
        self.streams = streams  # coupled sampling's streams of the requests (`None`: the standard sampler)
        self.proposer = proposer
        self.policy = policy
        self.max_draft_tokens = max_draft_tokens
        self.max_tree_nodes = max_tree_nodes  # most draft nodes of a request's token tree; 0 = chains
        self.stats = SpeculationStats()
        self.rows: dict[str, _Row] = {}  # this step's decoding requests, by request id
        self._known: dict[str, RequestState] = {}  # every request the proposer has started
        self._slots: dict[str, int] = {}
        self._free_slots: list[int] = []
        self._prefilled = False  # the policy has seen a first forward (its prefill feedback)
        self._draft_seconds = 0.0
        self._catchup = (0.0, 0)  # this step's catch-up of a draft model: seconds, tokens
        self._offered = False  # this step's proposer made model-free offers
        self.devices = cuda_devices(target, proposer.model)  # what the step's clocks wait for
        self._drafted: Seconds | float | None = None  # this step's drafting, catch-up included, until read
        self.policy.reset(0)

    # ---- before the scheduler ----------------------------------------------------------------------------------------
    def propose(self, active: dict[str, RequestState]) -> None:
        """Give every decoding request of `active` its draft: its query becomes its newest token and the draft."""
        self._read_draft_seconds()  # a step that drafted without a forward
        start = Instant.now(self.devices)
        self._catchup, self._offered = (0.0, 0), False
        self._sync(active)
        states = [s for s in active.values() if _decoding(s)]
        self.rows = {}
        if not states or not self._prefilled or self.max_draft_tokens == 0:
            self.rows = {s.request_id: _Row(s, self._slot(s), 0) for s in states}
            return
        most = max(self.max_draft_tokens, self.proposer.max_free_tokens)
        requests = [
            DraftRequest(s.request_id, s.initial_tokens + s.generated_tokens, min(most, _remaining(s) - 1))
            for s in states
        ]
        request = PolicyInput(
            step=self.stats.steps,
            row_ids=torch.tensor([self._slot(s) for s in states], dtype=torch.long),
            remaining_tokens=torch.tensor([_remaining(s) for s in states], dtype=torch.long),
            max_draft_tokens=self.max_draft_tokens,
            max_tree_nodes=self.max_tree_nodes,
            draft_tries_free=False,  # the draft model here has no lookahead
            **self.proposer.hints(requests),
        )
        chosen = self.policy.draft_lengths(request).cpu().tolist()  # [decoding requests]
        free = self._free_rows(request, chosen)
        self._offered = request.free_lengths is not None
        caps = [r.cap if served else min(r.cap, self.max_draft_tokens) for r, served in zip(requests, free)]
        lengths = [max(0, min(int(n), cap)) for n, cap in zip(chosen, caps)]
        for state, slot, length, served, (draft, parents) in zip(
            states, request.row_ids.tolist(), lengths, free, self._drafts(request, requests, lengths, free)
        ):
            row = _Row(state, slot, length, draft, parents, served)
            state.tokens_to_process = state.tokens_to_process[:1] + row.draft
            self.rows[state.request_id] = row
        self._catchup = (self.proposer.catchup_seconds, self.proposer.catchup_tokens)
        self._drafted = elapsed(start)  # on the devices' clocks; read in `observe`, once the step read the device

    def _read_draft_seconds(self) -> None:
        """This step's drafting seconds, catch-up apart, read after the step's forward (it has read the device)."""
        if self._drafted is not None:
            catchup = float(self._catchup[0])
            self._draft_seconds = float(self._drafted) - catchup
            self.stats.draft_seconds += self._draft_seconds + catchup
            self._drafted = None

    def _free_rows(self, request: PolicyInput, chosen: list[int]) -> list[bool]:
        """Which decoding requests draft from a model-free offer: every one of a model-free proposer, none of a draft
        model alone, and a hybrid's as the policy says (without an answer: where the offer covers the chosen length)."""
        if request.free_lengths is None:
            return [False] * len(chosen)
        offered = request.free_lengths.tolist()
        if request.backlog is None:
            return [True] * len(chosen)
        answer = self.policy.free_rows(request)
        free = answer.cpu().tolist() if answer is not None else [n >= k for n, k in zip(offered, chosen)]
        return [bool(served) and n > 0 for served, n in zip(free, offered)]

    def _drafts(
        self, request: PolicyInput, requests: list[DraftRequest], lengths: list[int], free: list[bool]
    ) -> list[tuple[list[int], list[int] | None]]:
        """Each request's draft of the chosen length (depth) and, for token trees, its tokens' parent nodes."""
        if not self.max_tree_nodes:
            drafts = self.proposer.drafts(requests, lengths, free)
            return [(draft[:length], None) for draft, length in zip(drafts, lengths)]
        budgets = self.policy.node_budgets(request, torch.tensor(lengths, dtype=torch.long))  # [decoding requests]
        budgets = [min(max(int(b), 1), self.max_tree_nodes) if n > 0 else 0 for b, n in zip(budgets.tolist(), lengths)]
        return self.proposer.trees(requests, lengths, budgets, free)

    def _slot(self, state: RequestState) -> int:
        if state.request_id not in self._slots:
            slot = self._free_slots.pop() if self._free_slots else len(self._slots)
            self._slots[state.request_id] = slot
            self.policy.forget_rows(torch.tensor([slot]))
        return self._slots[state.request_id]

    def _sync(self, active: dict[str, RequestState]) -> None:
        """Start the proposer on requests that began decoding; end it, and free the row ids, of those that left."""
        for request_id in [r for r in self._known if r not in active]:
            state = self._known.pop(request_id)
            finished = state.status == RequestStatus.FINISHED
            self.proposer.finish(request_id, state.initial_tokens + state.generated_tokens if finished else None)
            self.stats.unfinished += int(not finished)
            if self.streams is not None:
                self.streams.release(request_id)
            if request_id in self._slots:
                self._free_slots.append(self._slots.pop(request_id))
        for state in active.values():
            if _decoding(state) and state.request_id not in self._known:
                self._known[state.request_id] = state
                self.proposer.start(state.request_id, list(state.initial_tokens))
                self.stats.requests += 1
            elif state.request_id in self._known:
                self._known[state.request_id] = state  # an offloaded request comes back as a new state

    def finish_all(self) -> None:
        """End every request the proposer knows (the manager stopped)."""
        self._sync({})

    # ---- after the scheduler ---------------------------------------------------------------------------------------
    def settle(self, scheduled: list[FutureRequestState]) -> None:
        """Keep the drafts of the requests the scheduler took (cut to what it took); give the others their newest
        token back as their query."""
        taken = {future.state.request_id: future for future in scheduled}
        for request_id, row in list(self.rows.items()):
            future = taken.get(request_id)
            if future is None:
                row.state.tokens_to_process = row.state.tokens_to_process[:1]
                del self.rows[request_id]
            else:
                row.draft = row.draft[: future.query_length - 1]  # a tree's nodes come parents first: a cut stays one
                row.parents = None if row.parents is None else row.parents[: len(row.draft)]

    @property
    def drafting(self) -> bool:
        return any(row.draft for row in self.rows.values())

    # ---- after the forward -----------------------------------------------------------------------------------------
    def observe(self, query_tokens: int, num_requests: int, seconds: float, accepted: dict[str, int]) -> None:
        """Learn from a forward of `query_tokens` tokens over `num_requests` requests that took `seconds`: the first
        one as the policy's prefill, the others as steps of their decoding requests (`accepted` draft tokens each)."""
        seconds = float(seconds)  # the step's update has read the device: reading its clocks waits no more
        self._read_draft_seconds()
        self.stats.steps += 1
        self.stats.forward_seconds += seconds
        if not self._prefilled:
            draft = self.proposer.model
            ratio = parameter_ratio(draft, self.target) if draft is not None else None
            self.policy.observe_prefill(PrefillFeedback(num_requests, query_tokens, seconds, ratio, packed_verify=True))
            self._prefilled = True
            return
        rows = list(self.rows.values())
        if not rows:
            return
        drafted = torch.tensor([row.depth for row in rows], dtype=torch.long)  # [requests] a tree's deepest path
        taken = torch.tensor([accepted.get(row.state.request_id, 0) for row in rows], dtype=torch.long)
        feedback = StepFeedback(
            row_ids=torch.tensor([row.slot for row in rows], dtype=torch.long),
            requested_lengths=torch.tensor([row.requested for row in rows], dtype=torch.long),
            draft_lengths=drafted,
            accepted=taken,
            draft_seconds=self._draft_seconds,
            verify_seconds=seconds,
            target_tokens=query_tokens,
            catchup_seconds=float(self._catchup[0]),
            catchup_tokens=self._catchup[1],
            free_rows=torch.tensor([row.free for row in rows]) & (drafted > 0) if self._offered else None,
            plain_tokens=query_tokens - sum(len(row.draft) for row in rows),
        )
        self.policy.observe(feedback)
        self.stats.decode_steps += 1
        self.stats.drafting_steps += int(bool((drafted > 0).any()))
        self.stats.draft_tokens += sum(len(row.draft) for row in rows)
        self.stats.free_tokens += sum(len(row.draft) for row in rows if row.free)
        self.stats.accepted_tokens += int(taken.sum())
        self.stats.emitted_tokens += int(taken.sum()) + len(rows)
        self._draft_seconds = 0.0


def ancestry(parents: list[int]) -> tuple[torch.BoolTensor, torch.LongTensor]:
    """For a tree given by its nodes' `parents` (parents first, -1 at the root): which nodes each node sees (itself
    and its ancestors, `[nodes, nodes]`) and each node's depth (`[nodes]`)."""
    nodes = len(parents)
    visible = torch.eye(nodes, dtype=torch.bool)
    depths = torch.zeros(nodes, dtype=torch.long)
    for node, parent in enumerate(parents):
        if parent >= 0:
            visible[node] |= visible[parent]
            depths[node] = depths[parent] + 1
    return visible, depths


def _decoding(state: RequestState) -> bool:
    """Whether the request decodes next step: its prompt is done and its query is its newest token."""
    return (
        state.status == RequestStatus.DECODING
        and state.generated_len() > 0
        and len(state.tokens_to_process) == 1
        and not state.is_cpu_offloaded
    )


def _remaining(state: RequestState) -> int:
    """Tokens the request may still emit."""
    return max(0, state._new_tokens_limit - state.generated_len())
