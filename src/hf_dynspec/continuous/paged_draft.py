"""The draft model under continuous batching: it decodes the same requests as the target, in a paged cache of its own.

This is the one proposer in which the engine shows through: the draft's forwards are packed as transformers packs the
target's (its batch inputs over its paged attention cache), so a request's draft-model state is its blocks in that
cache. Everything else a proposer does is the engine-free `proposers.RequestProposer` interface.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessorList, PreTrainedModel

from ..candidates.draft_model import MAX_INLINE_TAIL
from ..clocks import Instant, elapsed
from ..coupling import StreamBook, perturb
from ..devices import cuda_devices
from .engine import (
    ContinuousBatchingIOs,
    ContinuousBatchingLogitsProcessorList,
    ContinuousBatchingManager,
    FutureRequestState,
    PagedAttentionCache,
    RequestState,
    kept_logits,
    supports_logits_to_keep,
)
from .proposers import DraftRequest, RequestProposer


@dataclass
class _DraftSequence:
    """A request as the draft model holds it in its paged cache."""

    state: RequestState  # the draft's own state of the request: its id names the request's blocks in the draft cache
    seen: list[int] = field(default_factory=list)  # tokens whose keys and values the draft cache holds, in order


class PagedDraftRequests(RequestProposer):
    """A draft model that shares the target's vocabulary, decoding the same requests in a paged cache of its own
    (transformers' `PagedAttentionCache` and batch inputs, sized as the target's, without prefix sharing).

    Each step it drafts for the requests the policy gave a length: every request first catches up on the tokens the
    draft has not seen (its prompt the first time, then the tokens accepted since it last drafted), then the draft
    runs `max(k_i)` forwards, a request leaving them when its draft is long enough. Its proposals are the draft's
    most likely tokens: greedy verification matches them, rejection sampling takes them as a deterministic proposal.
    Positions the target rejected are rewritten when the draft next catches up; a backlog wider than
    `MAX_INLINE_TAIL` is caught up in a forward of its own, timed apart (`catchup_seconds`), as in `generate`.

    Its token trees (`trees`) cost the draft no more forwards than its chain: the chain, and at each depth up to
    `branching - 1` of the draft's next most likely tokens as leaves (`chain_and_alternatives`).
    """

    inline_tail: int = MAX_INLINE_TAIL  # backlogs up to this width ride in the first draft forward

    def __init__(self, model: PreTrainedModel, branching: int = 2, min_node_probability: float = 0.0) -> None:
        self.model = model
        self._devices = cuda_devices(model)  # what its catch-up's clock waits for
        self.branching = branching  # a tree's children of each chain node: the chain's token and its runner-ups
        self.min_node_probability = min_node_probability  # a tree's leaves need at least this path probability
        self.cache: PagedAttentionCache | None = None
        self.inputs: ContinuousBatchingIOs | None = None
        self._processors = ContinuousBatchingLogitsProcessorList(LogitsProcessorList())
        self._sequences: dict[str, _DraftSequence] = {}
        self._attention: str | None = None  # the draft's attention implementation before it was made paged
        self._coupling: tuple[StreamBook, float] | None = None  # coupled sampling's streams, and the temperature

    def couple(self, streams: StreamBook, temperature: float) -> None:
        """Coupled sampling: draft each token as the perturbed argmax of the draft's logits over `temperature`, under
        the noise the target samples that position with."""
        self._coupling = (streams, temperature)

    def open(self, manager: ContinuousBatchingManager) -> None:
        if self.cache is not None:
            return
        current, paged = self.model.config._attn_implementation, paged_implementation(self.model)
        if paged != current:
            self.model.set_attn_implementation(paged)
            self._attention = current
        settings = dataclasses.replace(manager.continuous_batching_config, allow_block_sharing=False)
        text_config = self.model.config.get_text_config()
        self._keeps_logits = supports_logits_to_keep(self.model)
        self.cache = PagedAttentionCache(  # sized as the draft runs: the logits of the kept positions alone
            text_config, settings, self.model.device, manager.distributed_helper, dtype=self.model.dtype,
            model_supports_logits_to_keep=self._keeps_logits,
        )
        self.inputs = ContinuousBatchingIOs(
            self.cache, text_config, settings, self.model.device, self.model.dtype, self._processors
        )
        self._max_tokens = self.cache.max_batch_tokens
        self._max_requests = settings.max_requests_per_batch

    def close(self) -> None:
        if self._attention is not None:
            self.model.set_attn_implementation(self._attention)
        self.cache = self.inputs = self._attention = None
        self._sequences.clear()

    def start(self, request_id: str, prompt: list[int]) -> None:
        self._sequences[request_id] = _DraftSequence(RequestState(request_id=request_id, initial_tokens=list(prompt)))

    def finish(self, request_id: str, tokens: list[int] | None) -> None:
        sequence = self._sequences.pop(request_id, None)
        if sequence is not None and self.cache is not None:
            self.cache.free_blocks(request_id, no_cache=True)

    def hints(self, requests: list[DraftRequest]) -> dict[str, torch.LongTensor]:
        return {"backlog": torch.tensor([self._backlog(r) for r in requests], dtype=torch.long)}

    def _backlog(self, request: DraftRequest) -> int:
        """Tokens of the request the draft must process before it drafts: all after their longest common prefix."""
        seen = self._sequences[request.request_id].seen
        return len(request.tokens) - _common_prefix(seen, request.tokens)

    def drafts(
        self, requests: list[DraftRequest], lengths: list[int], free_rows: list[bool] | None = None
    ) -> list[list[int]]:
        return [[tokens[0] for tokens, _ in depths] for depths in self._draft(requests, lengths, 1)]

    def trees(
        self, requests: list[DraftRequest], depths: list[int], budgets: list[int], free_rows: list[bool] | None = None
    ) -> list[tuple[list[int], list[int]]]:
        """Each request's chain of depth `depths[i]` and, up to `budgets[i]` nodes, its most valuable alternatives
        (`chain_and_alternatives`)."""
        drafted = self._draft(requests, depths, self.branching)
        return [chain_and_alternatives(d, budget, self.min_node_probability) for d, budget in zip(drafted, budgets)]

    @torch.no_grad()
    def _draft(
        self, requests: list[DraftRequest], lengths: list[int], width: int
    ) -> list[list[tuple[list[int], list[float]]]]:
        """Each request's chain of `lengths[i]` draft tokens, depth by depth: the draft's `width` most likely tokens
        there, most likely first (it continues the chain), with their log-probabilities (zeros for `width` 1)."""
        self.catchup_seconds, self.catchup_tokens = 0.0, 0
        wanted = {r.request_id: n for r, n in zip(requests, lengths) if n > 0 and self.cache is not None}
        drafting = [r for r in requests if r.request_id in wanted]
        for request in drafting:
            seen = self._sequences[request.request_id].seen
            # positions the target rejected are rewritten; so is the newest token when the draft has seen it all (a
            # request that copied what an earlier one wrote): drafting needs the logits after it
            del seen[min(_common_prefix(seen, request.tokens), len(request.tokens) - 1) :]
        self._catch_up([r for r in drafting if self._backlog(r) > self.inline_tail])
        drafted: dict[str, list[tuple[list[int], list[float]]]] = {r.request_id: [] for r in drafting}
        by_id = {r.request_id: r for r in drafting}
        feeds = [(r.request_id, self._unseen(r)) for r in drafting if self._backlog(r) <= self.inline_tail]
        while feeds:
            feeds = [(request_id, tokens) for request_id, tokens in feeds if self._fits(request_id, len(tokens))]
            if not feeds:
                break
            paths = [[top[0] for top, _ in drafted[r]] for r, _ in feeds]  # each fed request's draft so far
            logits = self._perturbed(self._forward(feeds), [by_id[r] for r, _ in feeds], paths)  # [fed, vocab]
            if width == 1:
                tokens, log_probs = logits.argmax(-1, keepdim=True), torch.zeros(len(feeds), 1)  # [fed requests, 1]
            else:
                log_probs, tokens = torch.log_softmax(logits.float(), dim=-1).topk(width, dim=-1)  # [fed, width]
            for (request_id, _), top, logs in zip(feeds, tokens.tolist(), log_probs.tolist()):
                drafted[request_id].append((top, logs))
            feeds = [(i, drafted[i][-1][0][:1]) for i, _ in feeds if len(drafted[i]) < wanted[i]]
        return [drafted.get(r.request_id, []) for r in requests]

    def _perturbed(
        self, logits: torch.Tensor, requests: list[DraftRequest], paths: list[list[int]]
    ) -> torch.Tensor:
        """Under coupled sampling, `logits` (`[fed requests, vocab]`) over the temperature plus the noise each fed
        request samples its next token with after its draft so far (`paths`); unchanged otherwise."""
        if self._coupling is None:
            return logits
        streams, temperature = self._coupling
        keys, ids = [], []
        for request, path in zip(requests, paths):
            prompt = self._sequences[request.request_id].state.initial_tokens
            ids.append(streams.assign(request.request_id, prompt))
            keys.extend(streams.keys(request.request_id, prompt, request.tokens[len(prompt) :], [path]))
        return perturb(logits.float() / temperature, torch.tensor(ids), torch.tensor(keys))

    def _unseen(self, request: DraftRequest) -> list[int]:
        return request.tokens[len(self._sequences[request.request_id].seen) :]

    def _catch_up(self, requests: list[DraftRequest]) -> None:
        """Feed every token but the newest of `requests` that the draft has not seen, timed as the catch-up. A request
        whose tokens the draft cache cannot take keeps its backlog (and does not draft)."""
        start = Instant.now(self._devices)
        pending = [(r.request_id, self._unseen(r)[:-1]) for r in requests]
        while pending:
            chunks = [(request_id, tokens[: self._max_tokens]) for request_id, tokens in pending]
            chunks = [(request_id, chunk) for request_id, chunk in chunks if self._fits(request_id, len(chunk))]
            if not chunks:
                break
            self._forward(chunks)
            self.catchup_tokens += sum(len(chunk) for _, chunk in chunks)
            fed = dict(chunks)
            pending = [(i, tokens[len(fed[i]) :]) for i, tokens in pending if i in fed and len(tokens) > len(fed[i])]
        self.catchup_seconds = elapsed(start)  # on the devices' clocks, read after the step's forward

    def _fits(self, request_id: str, tokens: int) -> bool:
        """Whether the draft cache can take `tokens` more of the request (allocating their pages if so)."""
        sequence = self._sequences[request_id]
        sequence.state.position_offset = len(sequence.seen)
        return self.cache.can_store_request_tokens(sequence.state, tokens)

    def _forward(self, feeds: list[tuple[str, list[int]]]) -> torch.Tensor:
        """The draft over each request's `feeds` tokens (at most the step budget each), packed into as few forwards
        as the budget and the request limit allow; the logits of each one's last token, `[len(feeds), vocab]`."""
        logits, group, budget = [], [], self._max_tokens
        for request_id, tokens in feeds:
            if group and (len(tokens) > budget or len(group) == self._max_requests):
                logits.append(self._packed_forward(group))
                group, budget = [], self._max_tokens
            group.append((request_id, tokens))
            budget -= len(tokens)
        if group:
            logits.append(self._packed_forward(group))
        return torch.cat(logits) if logits else torch.empty(0, 0)

    def _packed_forward(self, feeds: list[tuple[str, list[int]]]) -> torch.Tensor:
        """One packed draft forward (transformers' batch inputs over the draft's paged cache): `[len(feeds), vocab]`."""
        futures = []
        for request_id, tokens in feeds:
            sequence = self._sequences[request_id]
            sequence.state.position_offset = len(sequence.seen)
            sequence.state.tokens_to_process = list(tokens)
            futures.append(FutureRequestState(sequence.state, True, {}, len(tokens)))
        past = sum(len(self._sequences[request_id].seen) for request_id, _ in feeds)
        query = sum(len(tokens) for _, tokens in feeds)
        self.inputs.prepare_batch_tensors(futures, self._processors, False, query, past, False)
        batch = self.inputs.get_model_kwargs(use_padding=False)
        batch.pop("logits_processor_args", None)
        logits = kept_logits(self.model, batch, batch["logits_indices"], self._keeps_logits)  # [fed requests, vocab]
        for request_id, tokens in feeds:
            self._sequences[request_id].seen.extend(tokens)
        return logits


def chain_and_alternatives(
    depths: list[tuple[list[int], list[float]]], budget: int, min_probability: float
) -> tuple[list[int], list[int]]:
    """A draft model's token tree from its chain's forwards (`depths`: at each depth the draft's most likely tokens
    and their log-probabilities, the chain's first): the chain, then of the other tokens at each depth (children of
    the chain's node above, leaves) the most valuable by the draft's probability of their path, up to `budget` nodes
    in all and none below `min_probability`. Tokens and parent nodes (node 0 is the request's newest token); the chain
    comes first, so a cut by the scheduler keeps it. Growing the branches deeper would take a draft forward over them
    per depth, about as dear as the chain's own (0.2-0.6 of a target step on the CPUs benchmarked)."""
    chain = [tokens[0] for tokens, _ in depths]
    above = 0.0  # log draft probability of the chain down to the node above this depth
    alternatives = []  # (path log-probability, depth, token)
    for depth, (tokens, log_probs) in enumerate(depths, 1):
        alternatives.extend((above + lp, depth, token) for token, lp in zip(tokens[1:], log_probs[1:]))
        above += log_probs[0]
    floor = math.log(min_probability) if min_probability > 0 else -math.inf
    kept = [a for a in sorted(alternatives, key=lambda a: -a[0]) if a[0] >= floor][: max(0, budget - len(chain))]
    kept.sort(key=lambda a: a[1])
    return chain + [token for _, _, token in kept], list(range(len(chain))) + [depth - 1 for _, depth, _ in kept]


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of `a` and `b`."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def paged_implementation(model: PreTrainedModel) -> str:
    """The attention implementation `model` runs with over transformers' paged cache, as its manager chooses for the
    target (eager becomes `paged|eager`)."""
    current = model.config._attn_implementation
    if current == "eager":
        return "paged|eager"
    if current in ("paged|eager", "sdpa") or "flash" in str(current):
        return current
    raise ValueError(
        f"The draft model's attention implementation {current!r} cannot read a paged cache: load it with "
        "attn_implementation='sdpa', 'eager' or a flash attention implementation."
    )
