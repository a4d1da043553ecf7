"""Rollout reuse: each row proposes the continuation of the earlier sample of its stream, at no draft cost.

With coupled sampling (`hf_dynspec.coupling`) a row's tokens are a deterministic function of its stream (seed, prompt,
index among the rows with that prompt) and of the model's distributions. An RL trainer samples the same prompts every
epoch with a policy that moved a little, so a row samples again, token for token, what the same stream sampled in the
previous epoch wherever the policy barely moved (SPEC-RL, RhymeRL and verl's history-based drafts reuse earlier
rollouts too, but their acceptance rules change the distribution; here the target verifies by equality with its own
perturbed argmax, so every token is exactly the current policy's sample).

The [`RolloutCache`] of a target model keeps each finished row's response per stream, across calls; the
[`RolloutProposer`] offers each row the cached response's tokens that follow the row's next key
([`EarlierResponse`]): the earlier token sampled with the noise the row samples its next token with is what the row
samples if the policy agrees there. With context keys (`DynSpecConfig.coupling_keys`) a row that diverged re-joins
its earlier sample as soon as its last tokens and their count agree with the earlier sample's again, after a
substitution, an insertion or a dropped token alike; with position keys only a substitution re-aligns. It has prompt
lookup's interface, so the hybrid proposer takes it beside a draft model, and the
goodput policy sizes its proposals as it sizes other model-free ones: a row that has repeated its earlier sample over
its last `copy_anchor` tokens or more is a *copy* (`free_anchors`), with an acceptance estimate of its own.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..coupling import RowKeys, gather_from_ranks, response_keys
from ..sequences import TokenBatch
from .base import EarlyStop, Proposal
from .prompt_lookup import PromptLookupProposer

if TYPE_CHECKING:
    from ..config import DynSpecConfig


@dataclass(frozen=True)
class RolloutSettings:
    """What bounds a `RolloutCache` (from `DynSpecConfig`'s `rollout_cache_*` fields)."""

    max_samples: int = 4096
    max_tokens: int = 4194304

    @classmethod
    def from_config(cls, config: DynSpecConfig) -> RolloutSettings:
        return cls(config.rollout_cache_samples, config.rollout_cache_tokens)


@dataclass(frozen=True)
class EarlierResponse:
    """A stream's earlier response and where each of its tokens was sampled: by the key of its noise."""

    tokens: torch.LongTensor  # [length] on the CPU
    index: dict[int, int]  # key -> the index in `tokens` of the token sampled with it

    @classmethod
    def of(cls, prompt: list[int], tokens: torch.LongTensor, keying: str) -> EarlierResponse:
        return cls(tokens, {key: n for n, key in enumerate(response_keys(prompt, tokens.tolist(), keying))})

    def offer(
        self, key: int, response: torch.LongTensor, max_tokens: int, prompt_length: int
    ) -> tuple[torch.LongTensor, int]:
        """The earlier tokens from the one sampled with `key`, the row's next key, on (`[found]`, up to
        `max_tokens`), and the anchor: how many final tokens of the row's `response` (`[generated]`) equal the
        earlier tokens before that one, plus `prompt_length` when the whole response repeats the earlier one's start."""
        start = self.index.get(key)
        if start is None:
            return self.tokens[:0], 0
        shared = min(int(response.shape[0]), start)
        differs = (response[response.shape[0] - shared :] != self.tokens[start - shared : start]).nonzero()
        anchor = shared - 1 - int(differs[-1]) if differs.numel() else shared
        if anchor == start == response.shape[0]:
            anchor += prompt_length
        return self.tokens[start : start + max_tokens], anchor


class RolloutCache:
    """Finished responses by stream, least recently stored out first once over `max_samples` or `max_tokens`.

    A stream sampled again replaces its earlier response (the newest policy's sample is the best proposal for the
    next visit). Responses are kept on the CPU as int64 token ids.
    """

    def __init__(self, settings: RolloutSettings | None = None) -> None:
        self.settings = settings or RolloutSettings()
        self._responses: OrderedDict[int, torch.LongTensor] = OrderedDict()
        self._tokens = 0

    @property
    def num_samples(self) -> int:
        return len(self._responses)

    @property
    def num_tokens(self) -> int:
        return self._tokens

    def get(self, stream: int) -> torch.LongTensor | None:
        """`[length]` the response last stored for `stream`, or `None`."""
        return self._responses.get(int(stream))

    def store(self, stream: int, response: torch.LongTensor) -> None:
        """Keep `response` (`[length]` token ids) as `stream`'s, evicting the least recently stored over the bounds."""
        stream = int(stream)
        if stream in self._responses:
            self._tokens -= int(self._responses.pop(stream).shape[0])
        self._responses[stream] = response.detach().to("cpu", torch.long).clone()
        self._tokens += int(response.shape[0])
        while len(self._responses) > 1 and (
            len(self._responses) > self.settings.max_samples or self._tokens > self.settings.max_tokens
        ):
            _, oldest = self._responses.popitem(last=False)
            self._tokens -= int(oldest.shape[0])

    def responses(self) -> dict[int, torch.LongTensor]:
        """Every response kept, by stream (a snapshot: storing more changes the cache, not this dict)."""
        return dict(self._responses)

    def clear(self) -> None:
        self._responses.clear()
        self._tokens = 0


_CACHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Per target model: its rollout caches by settings, so the next epoch's call finds the previous epoch's samples."""


def rollout_cache_for(model: object, settings: RolloutSettings | None = None) -> RolloutCache:
    """The rollout cache `generate` calls on `model` with these settings share (made on first use)."""
    settings = settings or RolloutSettings()
    caches = _CACHES.setdefault(model, {})
    if settings not in caches:
        caches[settings] = RolloutCache(settings)
    return caches[settings]


def clear_rollout_caches(model: object) -> None:
    """Forget every response the rollout caches of `model` hold."""
    for cache in _CACHES.get(model, {}).values():
        cache.clear()


class RolloutProposer(PromptLookupProposer):
    """For every row, the tokens its stream's earlier response holds from the row's position on.

    Proposed deterministically (`Proposal.probs` is `None`) and verified by equality with the target's perturbed
    argmax (or its argmax, in greedy decoding): a stale response (another model, another prompt, another seed) costs
    verify width, never a wrong token. Finished rows store their responses in the cache; in a data-parallel run of
    several processes every rank stores every rank's responses at the end of the call (a prompt's group may land on
    another rank next epoch), so every rank must generate together, as TRL's trainers do.
    """

    def __init__(
        self,
        cache: RolloutCache,
        streams: torch.LongTensor,
        num_output_tokens: int = 10,
        across_ranks: bool = True,
        keying: str = "context",
    ) -> None:
        """
        Args:
            cache: the target model's rollout cache.
            streams: `[rows]` the stream of each row of the batch `generate` received (`coupling.stream_keys`).
            across_ranks: share the call's responses with the other ranks of a data-parallel run (not with the ranks of
                a tensor-parallel target, which decode the same rows).
            keying: the keys of coupled sampling's noise (`DynSpecConfig.coupling_keys`), which align a row with its
                earlier response.
        """
        super().__init__(num_output_tokens=num_output_tokens)
        self.cache = cache
        self.across_ranks = across_ranks
        self.keying = keying
        self._stored: list[tuple[int, list[int]]] = []  # this call's (stream, response), to share across ranks
        self.streams = streams.cpu().tolist()
        self._earlier: list[EarlierResponse | None] = []  # per row id: its stream's earlier response
        self._keys: list[RowKeys] = []  # per row id: its tokens' keys so far
        self._offer: tuple[list[torch.LongTensor], torch.LongTensor] | None = None  # this step's `free_lengths`

    def start(self, batch: TokenBatch) -> None:
        super().start(batch)
        host = batch.host
        prompts = [host.tokens[row, batch.prompt_width - int(host.num_prompt[row]) : batch.prompt_width].tolist()
                   for row in range(batch.batch_size)]  # the rows of the call, in row id order
        self._keys = [RowKeys(prompt, self.keying) for prompt in prompts]
        self._earlier = [
            None if earlier is None else EarlierResponse.of(prompt, earlier, self.keying)
            for prompt, earlier in zip(prompts, (self.cache.get(stream) for stream in self.streams))
        ]
        self._stored = []

    @property
    def found_rows(self) -> int:
        """Rows of the call whose stream had an earlier response."""
        return sum(earlier is not None for earlier in self._earlier)

    def finish_rows(self, batch: TokenBatch, done: torch.LongTensor) -> None:
        for row in done.tolist():
            response = batch.tokens[row, batch.prompt_width : batch.prompt_width + int(batch.num_generated[row])]
            self.cache.store(self.streams[int(batch.row_ids[row])], response)
            self._stored.append((self.streams[int(batch.row_ids[row])], response.tolist()))

    def release(self) -> None:
        """At the end of the call: store the other ranks' responses too (data-parallel runs)."""
        if not self.across_ranks:
            return
        gathered = gather_from_ranks(self._stored)
        for rank_items in gathered if len(gathered) > 1 else []:
            for stream, response in rank_items:
                self.cache.store(stream, torch.tensor(response, dtype=torch.long))
        self._stored = []

    # ---- proposals ---------------------------------------------------------------------------------------------------
    def free_lengths(self, batch: TokenBatch, max_length: int) -> torch.LongTensor:
        full = torch.full((batch.batch_size,), max_length, dtype=torch.long, device=batch.tokens.device)
        self._offer = self.matches(batch, full)
        return torch.tensor([f.shape[0] for f in self._offer[0]], dtype=torch.long, device=batch.tokens.device)

    def free_anchors(self, batch: TokenBatch) -> torch.LongTensor:
        if self._offer is None or self._offer[1].shape[0] != batch.batch_size:
            raise RuntimeError("`free_anchors` describes the continuations of `free_lengths`: call that first.")
        return self._offer[1]

    def matches(
        self, batch: TokenBatch, lengths: torch.LongTensor, max_anchor: int = 0
    ) -> tuple[list[torch.LongTensor], torch.LongTensor]:
        """Each row's continuation of its earlier response (`[found]`, up to `lengths[b]` tokens) and its `[batch]`
        anchor: how many of the row's final tokens equal the earlier response's before the continuation (its prompt
        counts while the whole response so far repeats the earlier one), capped at `max_anchor` when it is set."""
        lengths = lengths.clamp(max=self.num_output_tokens)
        found, anchors = [], []
        host = batch.host
        for row in range(batch.batch_size):
            row_id, generated = int(host.row_ids[row]), int(host.num_generated[row])
            earlier, keys = self._earlier[row_id], self._keys[row_id]
            if earlier is None or int(lengths[row]) <= 0:
                found.append(batch.tokens.new_zeros(0))
                anchors.append(0)
                continue
            own = host.tokens[row, batch.prompt_width : batch.prompt_width + generated]  # [generated]
            keys.extend(own[keys.length :].tolist())
            continuation, anchor = earlier.offer(keys.along()[0], own, int(lengths[row]), int(host.num_prompt[row]))
            found.append(continuation.to(batch.tokens.device))
            anchors.append(min(anchor, max_anchor) if max_anchor else anchor)
        return found, torch.tensor(anchors, dtype=torch.long, device=batch.tokens.device)

    def propose(
        self,
        batch: TokenBatch,
        lengths: torch.LongTensor,
        early_stop: EarlyStop | None = None,
        free_rows: torch.BoolTensor | None = None,
        node_budgets: torch.LongTensor | None = None,
    ) -> Proposal:
        offer, self._offer = self._offer, None
        self.last_free_rows = lengths > 0
        if offer is None or len(offer[0]) != batch.batch_size:
            return self.proposal(batch, self.continuations(batch, lengths))
        return self.proposal(batch, [f[: int(n)] for f, n in zip(offer[0], lengths)])
