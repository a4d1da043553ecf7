"""Speculation under transformers' continuous batching: `generate_batch` and `init_continuous_batching`.

transformers' continuous batching (`model.generate_batch`, `model.init_continuous_batching()` and its
`ContinuousBatchingManager`, `transformers serve --continuous-batching`) schedules requests step by step: each step's
forward holds the decoding requests' newest tokens and chunks of other requests' prompts, packed into one sequence,
over a paged KV cache. Speculation enters at three seams of that engine, and nowhere else:

- before the scheduler builds a step, every decoding request gets `k_i` draft tokens from its proposer (a draft
  model decoding the same requests in a paged cache of its own, prompt lookup, suffix trees over every request's
  prompt and output, or per request one of these and the draft model), `k_i` chosen by the policy
  (`DynSpecConfig.policy`, goodput by default) from the decoding requests, their acceptance and the measured step
  costs. The request's query becomes its newest token and its draft: the scheduler (transformers' own, subclassed
  through its `SCHEDULER_MAPPING` registry) books them as tokens of the step and pages of the cache, and cuts a draft
  rather than splitting a request when the step's token budget or the cache runs short;
- the step's forward keeps the logits of every query position of a drafting request; verification
  (`hf_dynspec.verification`: greedy matching, or rejection sampling of a deterministic proposal) accepts `a_i`
  draft tokens and adds one more, all appended to the request at once;
- the request's position then moves back over its rejected positions, which the next step overwrites in the paged
  cache. Blocks registered for prefix sharing are counted over the accepted positions only.

Proposals may be token trees (suffix trees, prompt-lookup tries, a draft model's chain with its runner-up tokens): a
tree's nodes are the request's query (parents first), its block of the step's attention mask is rewritten so that each
node sees its ancestors alone, at its depth's position, and the accepted nodes' keys and values are copied to their
path's positions after verification.

Requests without a draft go through transformers' own update, unchanged, so a step in which no request drafts is
exactly a plain continuous-batching step. What this module relies on of transformers' internals lives here alone.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig, LogitsProcessorList, PreTrainedModel
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

from .candidates.draft_model import MAX_INLINE_TAIL
from .candidates.prompt_lookup import MAX_ANCHOR, lookup_match
from .candidates.rollout import EarlierResponse, RolloutSettings, rollout_cache_for
from .candidates.suffix import SuffixCache, SuffixSettings, chain_confidence, cut_tree, suffix_cache_for
from .candidates.tree import TokenTree
from .candidates.trie import lookup_trie
from .clocks import Instant, Seconds, elapsed
from .config import DynSpecConfig
from .coupling import StreamBook, coupled_choice, perturb
from .devices import cuda_devices
from .policies import (
    DraftLengthPolicy,
    PolicyInput,
    PrefillFeedback,
    StepFeedback,
    learned_policy,
    parameter_ratio,
)
from .validation import check_vocabularies
from .verification import verify_greedy, verify_sampling, verify_tree_greedy, verify_tree_sampling


# ---- proposers ------------------------------------------------------------------------------------------------------
@dataclass
class DraftRequest:
    """A decoding request the proposer drafts for this step."""

    request_id: str
    tokens: list[int]  # its prompt and output so far
    cap: int  # most draft tokens it may take this step


class RequestProposer(ABC):
    """Draft tokens for the decoding requests of a continuous batch. Each step the speculator asks for `hints` (what
    the policy sees before it sizes the drafts), then for the `drafts` of the lengths the policy chose."""

    model: PreTrainedModel | None = None  # the draft model, when one drafts
    max_free_tokens: int = 0  # a hybrid's: most tokens of a model-free offer (not held to the draft model's cap)
    catchup_seconds: float = 0.0  # this step's catch-up of the draft model on wide backlogs (its prompt prefill)
    catchup_tokens: int = 0  # tokens of that catch-up

    def start(self, request_id: str, prompt: list[int]) -> None:
        """A request starts decoding on `prompt` (its prompt tokens)."""

    def finish(self, request_id: str, tokens: list[int] | None) -> None:
        """The request left: finished with `tokens` (prompt and output), or cancelled or failed (`None`)."""

    def open(self, manager: ContinuousBatchingManager) -> None:
        """The manager built its batch processor (its paged cache and resolved settings)."""

    def couple(self, streams: StreamBook, temperature: float) -> None:
        """Coupled sampling: a draft model drafts its perturbed argmax (`DraftModelRequests.couple`); model-free
        proposers propose fixed tokens anyway."""

    def close(self) -> None:
        """The manager stopped: every request has finished (`finish`)."""

    @abstractmethod
    def hints(self, requests: list[DraftRequest]) -> dict[str, torch.LongTensor]:
        """`PolicyInput` fields for `requests`: a model-free proposer's offers (`free_lengths`, `free_anchors`), or
        the tokens a draft model must catch up on (`backlog`); each `[requests]`."""

    @abstractmethod
    def drafts(
        self, requests: list[DraftRequest], lengths: list[int], free_rows: list[bool] | None = None
    ) -> list[list[int]]:
        """Each request's draft tokens, at most its length (the `requests` `hints` last saw); a hybrid serves the
        `free_rows` requests from its model-free offer, the others from its draft model."""

    def trees(
        self, requests: list[DraftRequest], depths: list[int], budgets: list[int], free_rows: list[bool] | None = None
    ) -> list[tuple[list[int], list[int]]]:
        """Each request's token tree of at most `budgets[i]` nodes and depth `depths[i]`: its tokens and their parent
        nodes (node 0 is the request's newest token), parents before children; a hybrid serves the `free_rows`
        requests from its model-free proposer."""
        raise NotImplementedError(f"{type(self).__name__} drafts chains, not token trees.")


class ModelFreeRequests(RequestProposer):
    """A proposer that drafts without a model: its offers, made for the hints, are the drafts, cut to length."""

    def __init__(self) -> None:
        self._offers: list[list[int]] = []

    @abstractmethod
    def offer(self, request_id: str, tokens: list[int], max_tokens: int) -> tuple[list[int], int, float | None]:
        """Up to `max_tokens` draft tokens continuing `tokens` (the request's prompt and output so far), their anchor
        (how many of the request's last tokens the continuation's source shares; 0 without one) and how sure the
        proposer is of them (`BatchedProposer.free_confidence`; None when it does not say)."""

    def hints(self, requests: list[DraftRequest]) -> dict[str, torch.Tensor]:
        offers = [self.offer(r.request_id, r.tokens, r.cap) for r in requests]
        self._offers = [found for found, _, _ in offers]
        hints = {
            "free_lengths": torch.tensor([len(found) for found, _, _ in offers], dtype=torch.long),
            "free_anchors": torch.tensor([anchor for _, anchor, _ in offers], dtype=torch.long),
        }
        if offers and offers[0][2] is not None:
            hints["free_confidence"] = torch.tensor([sure for _, _, sure in offers], dtype=torch.float64)
        return hints

    def drafts(
        self, requests: list[DraftRequest], lengths: list[int], free_rows: list[bool] | None = None
    ) -> list[list[int]]:
        return [found[:length] for found, length in zip(self._offers, lengths)]


class LookupRequests(ModelFreeRequests):
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the request's last n-gram."""

    def __init__(self, max_ngram: int, min_ngram: int) -> None:
        super().__init__()
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def offer(self, request_id: str, tokens: list[int], max_tokens: int) -> tuple[list[int], int, None]:
        found, anchor = lookup_match(torch.tensor(tokens), self.max_ngram, self.min_ngram, max_tokens, MAX_ANCHOR)
        return found.tolist(), anchor, None

    def trees(
        self, requests: list[DraftRequest], depths: list[int], budgets: list[int], free_rows: list[bool] | None = None
    ) -> list[tuple[list[int], list[int]]]:
        """Each request's prompt-lookup trie (`candidates.trie.lookup_trie`: every continuation of every earlier
        occurrence of its final n-gram) of at most `budgets[i]` nodes and depth `depths[i]`."""
        trees = []
        for request, depth, budget in zip(requests, depths, budgets):
            tokens, parents = [0], [-1]  # the trie's node 0 is its root, the request's newest token, as here
            if depth > 0 and budget > 0:
                tokens, parents = lookup_trie(
                    torch.tensor(request.tokens), self.max_ngram, self.min_ngram, budget, depth
                )
            trees.append((tokens[1:], parents[1:]))
        return trees


class SuffixRequests(ModelFreeRequests):
    """Suffix trees (`hf_dynspec.candidates.suffix`): each request's prompt, and every request's output as it is
    written, so concurrent requests see each other's outputs and later ones find earlier ones."""

    def __init__(self, cache: SuffixCache) -> None:
        super().__init__()
        self.cache = cache
        self._requests: dict[str, int] = {}  # request id -> the cache's id of it
        self._written: dict[str, int] = {}  # request id -> its tokens the cache has

    def start(self, request_id: str, prompt: list[int]) -> None:
        self._requests[request_id] = self.cache.start(prompt)
        self._written[request_id] = len(prompt)

    def offer(self, request_id: str, tokens: list[int], max_tokens: int) -> tuple[list[int], int, float]:
        self._write(request_id, tokens)
        draft = self.cache.speculate(self._requests[request_id], tokens, max_tokens, tree=False)
        if draft is None:
            return [], 0, 1.0
        return list(draft.token_ids), int(draft.match_len), chain_confidence(draft.probs)

    def trees(
        self, requests: list[DraftRequest], depths: list[int], budgets: list[int], free_rows: list[bool] | None = None
    ) -> list[tuple[list[int], list[int]]]:
        """Each request's suffix tree of at most `budgets[i]` nodes cut at depth `depths[i]`: its tokens and their
        parents (node 0 is the request's newest token, the tree's root), parents before children."""
        trees = []
        for request, depth, budget in zip(requests, depths, budgets):
            draft = None
            if depth > 0 and budget > 0:
                draft = self.cache.speculate(self._requests[request.request_id], request.tokens, budget, tree=True)
            tokens, parents = cut_tree(draft.token_ids, draft.parents, depth) if draft is not None else ([], [])
            trees.append((tokens, [parent + 1 for parent in parents]))
        return trees

    def finish(self, request_id: str, tokens: list[int] | None) -> None:
        if tokens is not None:
            self._write(request_id, tokens)
        self.cache.stop(self._requests.pop(request_id))
        self._written.pop(request_id)

    def _write(self, request_id: str, tokens: list[int]) -> None:
        written = self._written[request_id]
        if len(tokens) > written:
            self.cache.extend(self._requests[request_id], tokens[written:])
            self._written[request_id] = len(tokens)


class RolloutRequests(ModelFreeRequests):
    """The rollout cache (`hf_dynspec.candidates.rollout`): each request offers the tokens its stream's earlier
    response holds from the request's own position on; a finished request stores its response."""

    def __init__(self, cache, streams: StreamBook, max_free_tokens: int) -> None:
        super().__init__()
        self.cache, self.streams = cache, streams
        self.max_free_tokens = max_free_tokens  # offers cost no draft forward: not held to the draft model's cap
        self._requests: dict[str, tuple[int, list[int], EarlierResponse | None]] = {}  # id -> stream, prompt, earlier

    def start(self, request_id: str, prompt: list[int]) -> None:
        stream = self.streams.assign(request_id, prompt)
        earlier = self.cache.get(stream)
        found = None if earlier is None else EarlierResponse.of(prompt, earlier, self.streams.keying)
        self._requests[request_id] = (stream, prompt, found)

    def offer(self, request_id: str, tokens: list[int], max_tokens: int) -> tuple[list[int], int, None]:
        _, prompt, earlier = self._requests[request_id]
        if earlier is None:
            return [], 0, None
        response = tokens[len(prompt) :]
        key = self.streams.keys(request_id, prompt, response, [[]])[0]
        found, anchor = earlier.offer(key, torch.tensor(response, dtype=torch.long), max_tokens, len(prompt))
        return found.tolist(), min(anchor, MAX_ANCHOR), None

    def finish(self, request_id: str, tokens: list[int] | None) -> None:
        stream, prompt, _ = self._requests.pop(request_id, (None, [], None))
        if tokens is not None and stream is not None:
            self.cache.store(stream, torch.tensor(tokens[len(prompt) :], dtype=torch.long))


@dataclass
class _DraftSequence:
    """A request as the draft model holds it in its paged cache."""

    state: RequestState  # the draft's own state of the request: its id names the request's blocks in the draft cache
    seen: list[int] = field(default_factory=list)  # tokens whose keys and values the draft cache holds, in order


class DraftModelRequests(RequestProposer):
    """A draft model that shares the target's vocabulary, decoding the same requests in a paged cache of its own
    (transformers' `PagedAttentionCache` and batch inputs, sized as the target's, without prefix sharing).

    Each step it drafts for the requests the policy gave a length: every request first catches up on the tokens the
    draft has not seen (its prompt the first time, then the tokens accepted since it last drafted), then the draft
    runs `max(k_i)` forwards, a request leaving them when its draft is long enough. Its proposals are the draft's
    most likely tokens: greedy verification matches them, rejection sampling takes them as a deterministic proposal.
    Positions the target rejected are rewritten when the draft next catches up; a backlog wider than
    `MAX_INLINE_TAIL` is caught up in a forward of its own, timed apart (`catchup_seconds`), as in `generate`.

    Its token trees (`trees`) cost the draft no more forwards than its chain: the chain, and at each depth up to
    `branching - 1` of the draft's next most likely tokens as leaves (`_chain_and_alternatives`).
    """

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
        current, paged = self.model.config._attn_implementation, _paged_implementation(self.model)
        if paged != current:
            self.model.set_attn_implementation(paged)
            self._attention = current
        settings = dataclasses.replace(manager.continuous_batching_config, allow_block_sharing=False)
        text_config = self.model.config.get_text_config()
        self._keeps_logits = _supports_logits_to_keep(self.model)
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
        (`_chain_and_alternatives`)."""
        drafted = self._draft(requests, depths, self.branching)
        return [_chain_and_alternatives(d, budget, self.min_node_probability) for d, budget in zip(drafted, budgets)]

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
            del seen[_common_prefix(seen, request.tokens) :]  # positions the target rejected are rewritten
        self._catch_up([r for r in drafting if self._backlog(r) > MAX_INLINE_TAIL])
        drafted: dict[str, list[tuple[list[int], list[float]]]] = {r.request_id: [] for r in drafting}
        by_id = {r.request_id: r for r in drafting}
        feeds = [(r.request_id, self._unseen(r)) for r in drafting if self._backlog(r) <= MAX_INLINE_TAIL]
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
        logits = _kept_logits(self.model, batch, batch["logits_indices"], self._keeps_logits)  # [fed requests, vocab]
        for request_id, tokens in feeds:
            self._sequences[request_id].seen.extend(tokens)
        return logits


class HybridRequests(RequestProposer):
    """Per request and step, a model-free offer (suffix trees or prompt lookup) or the draft model, as the policy
    decides (`DraftLengthPolicy.free_rows`; without an answer, the offer where it covers the chosen length), as
    `HybridProposer` does in `generate`. Offers hold up to `max_free_tokens` (`prompt_lookup_max_tokens`): they cost no
    draft forward. The draft model runs only for the requests it serves and catches up later on the tokens the others
    accepted."""

    def __init__(self, free: ModelFreeRequests, draft: DraftModelRequests, max_free_tokens: int) -> None:
        self.free, self.draft = free, draft
        self.model = draft.model
        self.max_free_tokens = max_free_tokens

    @property
    def cache(self) -> PagedAttentionCache | None:
        """The draft model's paged cache."""
        return self.draft.cache

    def start(self, request_id: str, prompt: list[int]) -> None:
        self.free.start(request_id, prompt)
        self.draft.start(request_id, prompt)

    def finish(self, request_id: str, tokens: list[int] | None) -> None:
        self.free.finish(request_id, tokens)
        self.draft.finish(request_id, tokens)

    def open(self, manager: ContinuousBatchingManager) -> None:
        self.draft.open(manager)

    def couple(self, streams: StreamBook, temperature: float) -> None:
        self.draft.couple(streams, temperature)

    def close(self) -> None:
        self.draft.close()

    def hints(self, requests: list[DraftRequest]) -> dict[str, torch.Tensor]:
        return self.free.hints(requests) | self.draft.hints(requests)

    def drafts(
        self, requests: list[DraftRequest], lengths: list[int], free_rows: list[bool] | None = None
    ) -> list[list[int]]:
        free_rows = free_rows if free_rows is not None else [False] * len(requests)
        offers = self.free.drafts(requests, lengths)
        by_draft = self.draft.drafts(requests, [0 if free else n for free, n in zip(free_rows, lengths)])
        self.catchup_seconds, self.catchup_tokens = self.draft.catchup_seconds, self.draft.catchup_tokens
        return [offer if free else drafted for free, offer, drafted in zip(free_rows, offers, by_draft)]

    def trees(
        self, requests: list[DraftRequest], depths: list[int], budgets: list[int], free_rows: list[bool] | None = None
    ) -> list[tuple[list[int], list[int]]]:
        free_rows = free_rows if free_rows is not None else [False] * len(requests)
        offers = self.free.trees(requests, [n if free else 0 for free, n in zip(free_rows, depths)], budgets)
        by_draft = self.draft.trees(requests, [0 if free else n for free, n in zip(free_rows, depths)], budgets)
        self.catchup_seconds, self.catchup_tokens = self.draft.catchup_seconds, self.draft.catchup_tokens
        return [offer if free else drafted for free, offer, drafted in zip(free_rows, offers, by_draft)]


def _chain_and_alternatives(
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


def _supports_logits_to_keep(model: PreTrainedModel) -> bool:
    supports = getattr(model, "_supports_logits_to_keep", None)
    return callable(supports) and bool(supports())


def _kept_logits(model: torch.nn.Module, batch: dict, indices: torch.Tensor, keep: bool) -> torch.Tensor:
    """`model`'s logits at the packed query positions `indices` (`[len(indices), vocab]`), computed there alone when
    the model takes `logits_to_keep` (`keep`)."""
    batch["logits_indices"] = indices
    if keep:
        batch["logits_to_keep"] = indices
    logits = model(**batch).logits  # [1, kept positions (or every query position), vocab]
    return logits[0] if keep else logits[0, indices]


def _paged_implementation(model: PreTrainedModel) -> str:
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


# ---- per-step decisions ---------------------------------------------------------------------------------------------
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
        return int(_ancestry([-1] + self.parents)[1].max())


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


def _ancestry(parents: list[int]) -> tuple[torch.BoolTensor, torch.LongTensor]:
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


# ---- transformers' scheduler, batch processor and manager -----------------------------------------------------------
class DraftAwareScheduling:
    """Mixed into a transformers scheduler: a decoding request's query is its newest token and its draft tokens.
    When the cache cannot store them all, the draft is dropped; when the step's token budget cannot take them all,
    the draft is cut. A decoding request is never split as a prompt would be."""

    def _infer_request_tokens(self, state: RequestState, request_ids_to_remove_from_waiting: set[str]) -> list[int]:
        tokens = super()._infer_request_tokens(state, request_ids_to_remove_from_waiting)
        drafted = state.status == RequestStatus.DECODING and len(tokens) > 1
        if drafted and not self.cache.can_store_request_tokens(state, len(tokens), dry_run=True):
            state.tokens_to_process = tokens = tokens[:1]
        return tokens

    def _schedule_request(
        self, state: RequestState, request_tokens: list[int], token_budget: int, request_ids_to_remove: set[str]
    ) -> None:
        if state.status == RequestStatus.DECODING and len(request_tokens) > token_budget:
            state.tokens_to_process = request_tokens[:token_budget]
            return
        super()._schedule_request(state, request_tokens, token_budget, request_ids_to_remove)


def draft_aware_scheduler(name: str) -> str:
    """Register the draft-aware version of transformers' scheduler `name` in its `SCHEDULER_MAPPING`; its name."""
    if name.startswith("dynspec_"):
        return name
    if name not in SCHEDULER_MAPPING:
        raise ValueError(f"Unknown scheduler {name!r}; transformers has {sorted(SCHEDULER_MAPPING)}.")
    base: type[Scheduler] = SCHEDULER_MAPPING[name]
    speculative = f"dynspec_{name}"
    if speculative not in SCHEDULER_MAPPING:
        SCHEDULER_MAPPING[speculative] = type(f"DraftAware{base.__name__}", (DraftAwareScheduling, base), {})
    return speculative


@dataclass
class _Verified:
    """Tokens a drafting request emits this step, with their log-probabilities."""

    tokens: list[int]
    logprobs: list[float] | None
    accepted: int
    path: list[int]  # the accepted draft nodes, by depth (a chain's: 1 to `accepted`)


class SpeculativeBatchProcessor(ContinuousBatchProcessor):
    """transformers' batch processor with the decoding requests' drafts verified in the step's forward."""

    speculator: Speculator

    @classmethod
    def adopt(cls, processor: ContinuousBatchProcessor, speculator: Speculator) -> SpeculativeBatchProcessor:
        """`processor`, built by transformers' manager, made speculative (its state is kept as built)."""
        processor.__class__ = cls
        processor.speculator = speculator
        processor._scores = None
        processor.coupled = speculator.streams is not None and bool(processor.do_sample)
        return processor

    def prepare_next_batch(self) -> bool:
        self.speculator.propose(self.scheduler.active_requests)
        ready = super().prepare_next_batch()
        self.speculator.settle(self.inputs_and_outputs.requests_in_batch if ready else [])
        return ready

    @torch.no_grad()
    def _generation_step(self, model: torch.nn.Module) -> None:
        start = Instant.now(self.speculator.devices)
        if self.speculator.drafting or self.coupled:  # coupled sampling samples every request itself
            self._verify_forward(model)
        else:
            super()._generation_step(model)
        self._forward_seconds = elapsed(start)  # on the devices' clocks, read in `update_batch` (`Speculator.observe`)

    def _verify_forward(self, model: torch.nn.Module) -> None:
        """The step's forward, keeping the scores of every query position of a drafting request."""
        ios = self.inputs_and_outputs
        batch = ios.get_model_kwargs(use_padding=False)
        self._shape_trees(batch)
        indices, columns = self._score_positions(batch["cu_seq_lens_q"].tolist())
        keep = self.model_runner.supports_logits_to_keep(model)
        scores = _kept_logits(model, batch, indices, keep).float()  # [scored positions, vocab]
        if self.logit_processor.do_processing:
            arguments = batch["logits_processor_args"][:, columns]  # [arguments, scored positions]
            scores = self.logit_processor(batch["input_ids"][0, indices], scores, arguments)
        self._scores = scores

    def _shape_trees(self, batch: dict) -> None:
        """Give the token trees of the step their shape in the packed forward (built causal, as chains): each node
        sits at its depth's position and attends to the request's cache and its own ancestors among the new keys."""
        masks = batch["attention_mask"]
        masks = masks if isinstance(masks, dict) else dict.fromkeys(batch["cu_seq_lens_k"], masks)
        cumulative_q = batch["cu_seq_lens_q"].tolist()
        cumulative_k = {layer_type: batch["cu_seq_lens_k"][layer_type].tolist() for layer_type in masks}
        for i, future in enumerate(self.inputs_and_outputs.requests_in_batch):
            row = self.speculator.rows.get(future.state.request_id)
            if row is None or row.parents is None or not row.draft:
                continue
            start, nodes = cumulative_q[i], 1 + len(row.draft)
            past = future.state.position_offset - future.query_length
            visible, depths = _ancestry([-1] + row.parents)  # [nodes, nodes], [nodes]
            batch["position_ids"][0, start : start + nodes] = past + depths
            for layer_type, mask in masks.items():
                end = cumulative_k[layer_type][i + 1]  # the request's new keys are the last of its key span
                block = mask[..., start : start + nodes, end - nodes : end]  # [..., nodes, nodes]
                block.fill_(torch.finfo(mask.dtype).min).masked_fill_(visible.to(block.device), 0.0)

    def _score_positions(self, cumulative: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Query positions whose scores the step needs (a request's last one; every one of a drafting request), and
        for each the index of its request among those that get a new token (the logits processors' argument column).
        """
        indices, columns = [], []
        ends = zip(self.inputs_and_outputs.requests_in_batch, cumulative[1:])
        for column, (future, end) in enumerate((f, end) for f, end in ends if f.has_new_token):
            width = 1 + len(self._draft(future))
            indices.extend(range(end - width, end))
            columns.extend([column] * width)
        return torch.tensor(indices, dtype=torch.int32), torch.tensor(columns, dtype=torch.long)

    def _draft(self, future: FutureRequestState) -> list[int]:
        row = self.speculator.rows.get(future.state.request_id)
        return row.draft if row is not None else []

    def update_batch(self) -> None:
        ios = self.inputs_and_outputs
        futures = list(ios.requests_in_batch)
        query_tokens = sum(future.query_length for future in futures)
        accepted: dict[str, int] = {}
        if self._scores is not None:
            accepted = self._update_verified(futures)
            self._scores = None
        else:
            super().update_batch()
        self.speculator.observe(query_tokens, len(futures), self._forward_seconds, accepted)

    def _update_verified(self, futures: list[FutureRequestState]) -> dict[str, int]:
        """Emit the verified tokens of drafting requests; the other requests' tokens go through transformers' update."""
        scores = self._scores
        drafting, others, plain_rows = [], [], []
        offset = 0
        for future in futures:
            draft = self._draft(future)
            if draft:
                drafting.append((future, draft, scores[offset : offset + 1 + len(draft)]))  # [1 + k, vocab]
            else:
                others.append(future)
                if future.has_new_token:
                    plain_rows.append(offset)
            offset += 1 + len(draft) if future.has_new_token else 0
        verified = self._verify(drafting)
        self._move_accepted([(future, result.path) for (future, _, _), result in zip(drafting, verified)])
        outputs = [self._emit(future, result) for (future, _, _), result in zip(drafting, verified)]
        if plain_rows and self.coupled:
            self._sample_coupled(scores[plain_rows], [future for future in others if future.has_new_token])
        elif plain_rows:  # transformers' sampler writes their tokens (and log-probabilities) where its update reads them
            self.model_runner._sample(scores[plain_rows].unsqueeze(0), self.inputs_and_outputs.output_ids)
        self._hand_over(others)
        delivered = [output for output in outputs if output is not None]
        if delivered:
            self.output_router.deliver_batch(delivered)
        return {future.state.request_id: result.accepted for (future, _, _), result in zip(drafting, verified)}

    def _sample_coupled(self, scores: torch.Tensor, futures: list[FutureRequestState]) -> None:
        """Coupled sampling of the requests without a draft (`scores`: `[requests, vocab]` processed, in the order
        of `futures`): their perturbed argmax, written where transformers' update reads sampled tokens (and their
        log-probabilities, as its sampler writes them)."""
        keys = torch.tensor([self._keys_of(future, [[]])[0] for future in futures])  # [requests]
        tokens = coupled_choice(scores, self._streams_of(futures), keys)  # [requests]
        output_ids = self.inputs_and_outputs.output_ids
        output_ids[0, : tokens.shape[0]].copy_(tokens)
        if self.return_logprobs:
            logprobs = scores.float().log_softmax(dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
            output_ids[1, : tokens.shape[0]].copy_(logprobs.view(dtype=torch.int32))

    def _streams_of(self, futures: list[FutureRequestState]) -> torch.LongTensor:
        """`[requests]` each request's stream of coupled sampling."""
        book = self.speculator.streams
        return torch.tensor([book.assign(f.state.request_id, f.state.initial_tokens) for f in futures])

    def _keys_of(self, future: FutureRequestState, paths: list[list[int]]) -> list[int]:
        """The noise key of the token `future`'s request samples after its tokens so far and each of `paths`."""
        state = future.state
        return self.speculator.streams.keys(state.request_id, state.initial_tokens, state.generated_tokens, paths)

    def _perturbed(
        self, scores: torch.Tensor, futures: list[FutureRequestState], paths: list[list[list[int]]]
    ) -> torch.Tensor:
        """`scores` (`[requests, nodes, vocab]`) plus the noise of the token each node samples: after the request's
        tokens and the node's path of draft tokens (`paths[i][j]`; nodes past a request's own sample anything)."""
        keys = torch.zeros(scores.shape[:2], dtype=torch.long)  # [requests, nodes]
        for i, (future, request_paths) in enumerate(zip(futures, paths)):
            keys[i, : len(request_paths)] = torch.tensor(self._keys_of(future, request_paths))
        return perturb(scores, self._streams_of(futures).unsqueeze(1).expand_as(keys), keys)

    def _verify(self, drafting: list[tuple[FutureRequestState, list[int], torch.Tensor]]) -> list[_Verified]:
        """Greedy matching or rejection sampling of every drafting request's draft, in one batch (coupled sampling:
        greedy matching of the perturbed scores)."""
        if not drafting:
            return []
        if any(self.speculator.rows[future.state.request_id].parents is not None for future, _, _ in drafting):
            return self._verify_trees(drafting)
        width = max(len(draft) for _, draft, _ in drafting)
        vocab = drafting[0][2].shape[-1]
        scores = torch.full((len(drafting), width + 1, vocab), float("-inf"))  # [requests, k + 1, vocab]
        drafts = torch.zeros(len(drafting), width, dtype=torch.long)  # [requests, k]
        for i, (_, draft, rows) in enumerate(drafting):
            scores[i, : rows.shape[0]] = rows
            drafts[i, : len(draft)] = torch.tensor(draft)
        lengths = torch.tensor([len(draft) for _, draft, _ in drafting], dtype=torch.long)
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # [requests, k + 1, vocab]
        if self.coupled:
            paths = [[draft[:depth] for depth in range(len(draft) + 1)] for _, draft, _ in drafting]
            perturbed = self._perturbed(scores, [future for future, _, _ in drafting], paths)
            accepted, next_tokens = verify_greedy(perturbed, drafts, lengths)
        elif self.do_sample:
            accepted, next_tokens = verify_sampling(probs, drafts, lengths, None)
        else:
            accepted, next_tokens = verify_greedy(scores, drafts, lengths)
        results = []
        for i, (_, draft, _) in enumerate(drafting):
            a = int(accepted[i])
            tokens = draft[:a] + [int(next_tokens[i])]
            logprobs = None
            if self.return_logprobs:
                logprobs = [float(probs[i, j, token].log()) for j, token in enumerate(tokens)]
            results.append(_Verified(tokens, logprobs, a, list(range(1, a + 1))))
        return results

    def _verify_trees(self, drafting: list[tuple[FutureRequestState, list[int], torch.Tensor]]) -> list[_Verified]:
        """Greedy walks or multi-draft rejection sampling (each node a fixed proposal) of every drafting request's
        token tree (chains as trees), in one batch."""
        rows = [self.speculator.rows[future.state.request_id] for future, _, _ in drafting]
        roots = [future.state.generated_tokens[-1] for future, _, _ in drafting]
        tree = TokenTree.from_parent_lists(
            [[root] + row.draft for root, row in zip(roots, rows)],
            [[-1] + (row.parents if row.parents is not None else list(range(len(row.draft)))) for row in rows],
        )
        vocab = drafting[0][2].shape[-1]
        scores = torch.full((len(drafting), tree.num_nodes, vocab), float("-inf"))  # [requests, nodes, vocab]
        for i, (_, _, request_scores) in enumerate(drafting):
            scores[i, : request_scores.shape[0]] = request_scores
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # [requests, nodes, vocab]
        if self.coupled:
            nodes = tree.paths()[:, :, 1:]  # [requests, nodes, depth] each node's path after the root
            tokens = tree.tokens.gather(1, nodes.clamp(min=0).flatten(1)).view(nodes.shape).tolist()
            depths = tree.depths.tolist()
            paths = [[row_tokens[node][: row_depths[node]] for node in range(len(row_depths))]
                     for row_tokens, row_depths in zip(tokens, depths)]
            perturbed = self._perturbed(scores, [future for future, _, _ in drafting], paths)
            outcome = verify_tree_greedy(perturbed, tree)
        else:
            outcome = verify_tree_sampling(probs, tree, None) if self.do_sample else verify_tree_greedy(scores, tree)
        results = []
        for i in range(len(drafting)):
            a = int(outcome.accepted[i])
            path = outcome.path[i, :a].tolist()  # accepted nodes, depth 1 to a
            tokens = outcome.emitted[i, : a + 1].tolist()
            logprobs = None
            if self.return_logprobs:
                logprobs = [float(probs[i, node, token].log()) for node, token in zip([0] + path, tokens)]
            results.append(_Verified(tokens, logprobs, a, path))
        return results

    def _move_accepted(self, verified: list[tuple[FutureRequestState, list[int]]]) -> None:
        """Copy the keys and values of accepted tree nodes to their path's positions (node at depth `d` to the
        position after the request's newest token plus `d - 1`), in every layer; chains are already in place."""
        moves = []  # (request id, from position, to position)
        for future, path in verified:
            past = future.state.position_offset - future.query_length  # the position of the request's newest token
            moves.extend((future.state.request_id, past + node, past + depth) for depth, node in enumerate(path, 1))
        moves = [move for move in moves if move[1] != move[2]]
        if moves:
            _copy_positions(self.cache, moves)

    def _emit(self, future: FutureRequestState, result: _Verified) -> GenerationOutput | None:
        """Append a drafting request's verified tokens, move its position back over the rejected ones and register
        the blocks its accepted tokens completed; its output when it streams or finished."""
        state = future.state
        past = state.position_offset - future.query_length  # the request's cached positions before this step
        finished = False
        for j, token in enumerate(result.tokens):
            finished = state.update_and_check_completion(token, result.logprobs[j] if result.logprobs else None)
            if finished:
                break
        written = 1 + result.accepted  # the newest token and the accepted drafts are now in the cache
        state.position_offset = past
        complete = self.cache.count_new_complete_blocks(state, written)
        state.position_offset = past + written
        if finished:
            self.scheduler.finish_request(state.request_id)
            self.scheduler.block_new_requests = False
        else:
            self.cache.mark_complete_blocks(state, complete)
        return state.to_generation_output() if state.streaming or finished else None

    def _hand_over(self, futures: list[FutureRequestState]) -> None:
        """Run transformers' own update on the requests without a draft (prefill chunks, plain decoding, forks)."""
        ios = self.inputs_and_outputs
        ios.requests_in_batch = futures
        ios.num_request_in_batch = len(futures)
        if futures:
            super().update_batch()


def _copy_positions(cache: PagedAttentionCache, moves: list[tuple[str, int, int]]) -> None:
    """For each `(request id, source, destination)`, copy the keys and values the request's paged cache holds at
    position `source` to position `destination`, in every layer (all sources are read before any is written)."""
    for allocator in cache.cache_allocators.values():
        source, destination = (
            torch.tensor([allocator.get_write_indices(r, position, 1)[0] for r, position in ends], dtype=torch.long)
            for ends in ([(r, s) for r, s, _ in moves], [(r, d) for r, _, d in moves])
        )
        for keys, values in allocator._kv_token_views.values():  # each [cache positions, kv heads, head dim]
            keys.index_copy_(0, destination.to(keys.device), keys.index_select(0, source.to(keys.device)))
            values.index_copy_(0, destination.to(values.device), values.index_select(0, source.to(values.device)))


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
        _check_attention(model)
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


def _check_attention(model: PreTrainedModel) -> None:
    layer_types = group_layers_by_attn_type(model.config.get_text_config())
    if SLIDING_ATTENTION in layer_types:
        raise ValueError(
            "Speculation under continuous batching needs full-attention layers: this model has sliding-window layers, "
            "whose ring buffer in the paged cache cannot take back rejected draft tokens. Use `model.generate_batch` "
            "without speculation, or `hf_dynspec.generate` (batched `generate`) for this model."
        )


def _check_tree_attention(model: PreTrainedModel) -> None:
    """Token trees need an attention that takes a mask (eager or SDPA over the paged cache)."""
    implementation = str(model.config._attn_implementation)
    if "flash" in implementation or "flex" in implementation:
        raise ValueError(
            f"Token trees under continuous batching need an attention implementation that takes a mask, and "
            f"{implementation!r} runs causal sequences only: load the model with attn_implementation='sdpa' or "
            "'eager', or set `tree_node_budget=0` for chains."
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


# ---- entry points ---------------------------------------------------------------------------------------------------
def init_continuous_batching(
    model: PreTrainedModel,
    assistant_model: PreTrainedModel | None = None,
    *,
    prompt_lookup_num_tokens: int | None = None,
    dynspec_config: DynSpecConfig | dict | str | None = None,
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    workload_hints: Any = None,
) -> SpeculativeManager:
    """A continuous-batching manager for `model` whose steps speculate: `model.init_continuous_batching`'s manager
    (start it, add requests, read results, stop it), with every decoding request's draft length chosen each step.

    Drafts come from `assistant_model` (a draft model sharing the target's vocabulary, in a paged cache of its own:
    `DraftModelRequests`), from prompt lookup (`prompt_lookup_num_tokens`, the most draft tokens a request proposes in
    a step) or, with `DynSpecConfig(proposer="suffix")`, from suffix trees over every request's prompt and output
    (the `suffix` extra). With `assistant_model` and `proposer="suffix"` or `"hybrid"`, each request drafts each step
    from suffix trees or prompt lookup, or from the draft model, as the policy decides. Greedy outputs equal those of
    `model.generate_batch`; sampled ones follow the same distribution.

    Example:

    ```python
    >>> import hf_dynspec
    >>> manager = hf_dynspec.init_continuous_batching(model, draft)
    >>> manager.start()
    >>> request_id = manager.add_request(input_ids, max_new_tokens=64)
    >>> output = next(manager.request_id_iter(request_id))
    >>> manager.stop()
    ```
    """
    config = DynSpecConfig.coerce(dynspec_config)
    generation_config = generation_config if generation_config is not None else model.generation_config
    if getattr(generation_config, "num_beams", 1) not in (None, 1):
        raise ValueError("Continuous batching does not run beam search: set `num_beams=1`.")
    if config.reuse_rollouts and prompt_lookup_num_tokens is not None:
        raise ValueError(
            "DynSpecConfig(reuse_rollouts=True) proposes from the rollout cache (beside the assistant model, if one is "
            "given); drop `prompt_lookup_num_tokens`."
        )
    proposer, max_draft = _request_proposer(model, config, prompt_lookup_num_tokens, assistant_model)
    policy = learned_policy(model, proposer.model, config, None, engine="continuous_batching")
    if config.tree_node_budget:
        _check_tree_attention(model)
    streams = StreamBook(config.seed, config.coupling_keys) if config.sampling == "coupled" else None
    speculator = Speculator(model, proposer, policy, max_draft, config.tree_node_budget, streams)
    if config.reuse_rollouts:
        _reuse_rollouts(speculator, model, config)
    return SpeculativeManager(
        model,
        generation_config,
        continuous_batching_config if continuous_batching_config is not None else ContinuousBatchingConfig(),
        workload_hints,
        speculator=speculator,
    )


def _reuse_rollouts(speculator: Speculator, model: PreTrainedModel, config: DynSpecConfig) -> None:
    """Give the speculator's proposer the rollout cache: alone, or beside a draft model (`HybridRequests`)."""
    if config.tree_node_budget or config.proposer != "auto":
        raise ValueError(
            "DynSpecConfig(reuse_rollouts=True) proposes chains from the rollout cache, beside the assistant model "
            "when one is given: set `tree_node_budget=0` and proposer='auto'."
        )
    proposer = speculator.proposer
    cache = rollout_cache_for(model, RolloutSettings.from_config(config))
    rollouts = RolloutRequests(cache, speculator.streams, config.prompt_lookup_max_tokens)
    if isinstance(proposer, DraftModelRequests):
        speculator.proposer = HybridRequests(rollouts, proposer, config.prompt_lookup_max_tokens)
    else:
        speculator.proposer = rollouts
        speculator.max_draft_tokens = config.num_speculative_tokens


def _request_proposer(
    model: PreTrainedModel,
    config: DynSpecConfig,
    prompt_lookup_num_tokens: int | None,
    assistant_model: PreTrainedModel | None,
) -> tuple[RequestProposer, int]:
    """The proposer the arguments ask for, and the most draft tokens a request proposes in a step."""
    if assistant_model is not None:
        return _draft_proposer(model, config, prompt_lookup_num_tokens, assistant_model), config.num_speculative_tokens
    if config.proposer == "suffix":
        if prompt_lookup_num_tokens is not None:
            raise ValueError(
                "DynSpecConfig(proposer='suffix') drafts from suffix trees: drop `prompt_lookup_num_tokens`."
            )
        cache = suffix_cache_for(model, SuffixSettings.from_config(config))
        return SuffixRequests(cache), config.num_speculative_tokens
    if config.proposer != "auto":
        raise ValueError(
            f"DynSpecConfig(proposer={config.proposer!r}) needs a draft model: pass `assistant_model`, or use "
            "proposer='auto' with `prompt_lookup_num_tokens`, or proposer='suffix'."
        )
    if prompt_lookup_num_tokens is None and (config.reuse_rollouts or config.sampling == "coupled"):
        prompt_lookup_num_tokens = config.prompt_lookup_max_tokens  # a proposer of the config's own
    if prompt_lookup_num_tokens is None:
        raise ValueError(
            "Say where draft tokens come from: `assistant_model` (a draft model), `prompt_lookup_num_tokens=N` "
            "(prompt lookup, up to N tokens a step), or `dynspec_config=DynSpecConfig(proposer='suffix')`."
        )
    if not isinstance(prompt_lookup_num_tokens, int) or prompt_lookup_num_tokens < 1:
        raise ValueError(f"`prompt_lookup_num_tokens` must be a positive integer, got {prompt_lookup_num_tokens!r}.")
    lookup = LookupRequests(config.prompt_lookup_max_ngram, config.prompt_lookup_min_ngram)
    return lookup, min(config.num_speculative_tokens, prompt_lookup_num_tokens)


def _draft_proposer(
    model: PreTrainedModel,
    config: DynSpecConfig,
    prompt_lookup_num_tokens: int | None,
    assistant_model: PreTrainedModel,
) -> DraftModelRequests:
    """A draft model's proposer: alone with proposer='auto'; with proposer='hybrid' or 'suffix', beside prompt lookup
    or suffix trees (`HybridRequests`)."""
    if prompt_lookup_num_tokens is not None:
        raise ValueError(
            "Under continuous batching a draft model takes no `prompt_lookup_num_tokens`: drop it, and use "
            "DynSpecConfig(proposer='hybrid') for prompt lookup beside the draft model (up to "
            "`prompt_lookup_max_tokens` tokens a step)."
        )
    check_vocabularies(model, assistant_model)
    _check_attention(assistant_model)
    _paged_implementation(assistant_model)
    draft = DraftModelRequests(assistant_model, config.tree_branching, config.tree_min_node_probability)
    if config.proposer == "auto" or config.num_speculative_tokens == 0:
        return draft
    if config.proposer == "suffix":
        free: ModelFreeRequests = SuffixRequests(suffix_cache_for(model, SuffixSettings.from_config(config)))
    else:
        free = LookupRequests(config.prompt_lookup_max_ngram, config.prompt_lookup_min_ngram)
    return HybridRequests(free, draft, config.prompt_lookup_max_tokens)


def generate_batch(
    model: PreTrainedModel,
    inputs: list[list[int]],
    *,
    assistant_model: PreTrainedModel | None = None,
    prompt_lookup_num_tokens: int | None = None,
    dynspec_config: DynSpecConfig | dict | str | None = None,
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    **kwargs: Any,
) -> dict[str, GenerationOutput]:
    """`model.generate_batch(inputs, ...)` with speculation: request id -> `GenerationOutput`, in input order.

    Takes `model.generate_batch`'s other arguments (`max_new_tokens`, `record_timestamps`, `progress_bar`,
    `persistent_manager`, ...) and the proposer arguments of `init_continuous_batching`.
    """
    if not inputs:
        return {}
    generation_config = generation_config if generation_config is not None else model.generation_config
    manager = init_continuous_batching(
        model,
        assistant_model,
        prompt_lookup_num_tokens=prompt_lookup_num_tokens,
        dynspec_config=dynspec_config,
        generation_config=generation_config,
        continuous_batching_config=continuous_batching_config,
        workload_hints=_workload_hints(inputs, generation_config, kwargs.get("max_new_tokens")),
    )
    # `model.generate_batch` runs the manager cached on the model: lend it ours for the call.
    cached = getattr(model, "_cached_continuous_batching_manager", None)
    model._cached_continuous_batching_manager = manager
    try:
        return model.generate_batch(inputs, generation_config=generation_config, **kwargs)
    finally:
        kept = kwargs.get("persistent_manager", False)
        if not kept:
            if cached is None:
                model.__dict__.pop("_cached_continuous_batching_manager", None)
            else:
                model._cached_continuous_batching_manager = cached


def _workload_hints(inputs: list[list[int]], generation_config: GenerationConfig, max_new_tokens: int | None) -> Any:
    """transformers' sizing hints for `inputs`, as `model.generate_batch` gives them."""
    from transformers.generation.continuous_batching.utils import WorkloadHints

    new_tokens = max_new_tokens if max_new_tokens is not None else generation_config.max_new_tokens
    returns = generation_config.num_return_sequences or 1
    return WorkloadHints(
        max_prompt_length=max(len(ids) for ids in inputs),
        max_generated_length=new_tokens if new_tokens is not None else 0,
        num_requests=len(inputs) * returns,
    )
