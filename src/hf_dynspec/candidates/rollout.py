"""Rollout reuse: each row proposes the continuation of the earlier sample of its stream, at no draft cost.

With coupled sampling (`hf_dynspec.coupling`) a row's tokens are a deterministic function of its stream (seed, prompt,
index among the rows with that prompt) and of the model's distributions. An RL trainer samples the same prompts every
epoch with a policy that moved a little, so a row samples again, token for token, what the same stream sampled in the
previous epoch wherever the policy barely moved (SPEC-RL, RhymeRL and verl's history-based drafts reuse earlier
rollouts too, but their acceptance rules change the distribution; here the target verifies by equality with its own
perturbed argmax, so every token is exactly the current policy's sample).

The [`RolloutCache`] of a target model keeps each finished row's response per stream, across calls; the
[`RolloutSource`] offers each row the cached response's tokens that follow the row's next key
([`EarlierResponse`]): the earlier token sampled with the noise the row samples its next token with is what the row
samples if the policy agrees there. With context keys (`DynSpecConfig.coupling_keys`) a row that diverged re-joins
its earlier sample as soon as its last tokens and their count agree with the earlier sample's again, after a
substitution, an insertion or a dropped token alike; with position keys only a substitution re-aligns. It is a
model-free source (`candidates.free`), so the hybrid proposer takes it beside a draft model, and the goodput policy
sizes its proposals as it sizes other model-free ones: a row that has repeated its earlier sample over its last
`copy_anchor` tokens or more is a *copy* (`free_anchors`), with an acceptance estimate of its own.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..coupling import RowKeys, gather_from_ranks, response_keys
from .free import MAX_ANCHOR, ModelFreeSource, Offer

if TYPE_CHECKING:
    from ..config import DynSpecConfig


@dataclass(frozen=True)
class RolloutSettings:
    """What bounds a `RolloutCache` (from `DynSpecConfig`'s `rollout_cache_*` fields)."""

    max_samples: int | None = None  # None: no bound on the count, only on the tokens
    max_tokens: int = 1 << 24

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
    """Finished responses by stream, least recently stored out first once over `max_tokens` (or `max_samples`).

    A stream sampled again replaces its earlier response (the newest policy's sample is the best proposal for the
    next visit) and becomes the newest, so the responses the cache lets go first are those of the oldest epoch.
    Bounded by tokens alone (the default), an epoch of any number of prompts is kept whole while its tokens fit: a
    bound on the count would drop the epoch's first samples before the next epoch reaches them, and that epoch, in
    the same order, would then find none. Responses are kept on the CPU as int32 token ids: 4 MiB per million tokens.
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
        """`[length]` the response last stored for `stream` (int64), or `None`."""
        response = self._responses.get(int(stream))
        return None if response is None else response.long()

    def store(self, stream: int, response: torch.LongTensor) -> None:
        """Keep `response` (`[length]` token ids) as `stream`'s, evicting the least recently stored over the bounds."""
        stream = int(stream)
        if stream in self._responses:
            self._tokens -= int(self._responses.pop(stream).shape[0])
        self._responses[stream] = response.detach().to("cpu", torch.int32).clone()
        self._tokens += int(response.shape[0])
        while len(self._responses) > 1 and (self._over_count() or self._tokens > self.settings.max_tokens):
            _, oldest = self._responses.popitem(last=False)
            self._tokens -= int(oldest.shape[0])

    def _over_count(self) -> bool:
        limit = self.settings.max_samples
        return limit is not None and len(self._responses) > limit

    def responses(self) -> dict[int, torch.LongTensor]:
        """Every response kept, by stream (int64; a snapshot: storing more changes the cache, not this dict)."""
        return {stream: response.long() for stream, response in self._responses.items()}

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


class RolloutSource(ModelFreeSource):
    """For one row at a time, the tokens its stream's earlier response holds from the row's position on.

    Proposed deterministically and verified by equality with the target's perturbed argmax (or its argmax, in greedy
    decoding): a stale response (another model, another prompt, another seed) costs verify width, never a wrong token.
    Finished rows store their responses in the cache; with `across_ranks`, in a data-parallel run of several processes
    every rank stores every rank's responses when the call closes (a prompt's group may land on another rank next
    epoch), so every rank must generate together, as TRL's trainers do.
    """

    def __init__(
        self,
        cache: RolloutCache,
        stream_of: Callable[[Hashable, list[int]], int],
        keying: str = "context",
        across_ranks: bool = False,
    ) -> None:
        """
        Args:
            cache: the target model's rollout cache.
            stream_of: a row's stream (`hf_dynspec.coupling`) from the row and its prompt.
            keying: the keys of coupled sampling's noise (`DynSpecConfig.coupling_keys`), which align a row with its
                earlier response.
            across_ranks: share the call's responses with the other ranks of a data-parallel run (not with the ranks of
                a tensor-parallel target, which decode the same rows).
        """
        self.cache, self.stream_of, self.keying, self.across_ranks = cache, stream_of, keying, across_ranks
        self._rows: dict[Hashable, _Row] = {}
        self._stored: list[tuple[int, list[int]]] = []  # this call's (stream, response), to share across ranks
        self.found_rows = 0  # rows of the call (since the last `close`) whose stream had an earlier response
        self._closed = False

    def start(self, row: Hashable, prompt: torch.LongTensor) -> None:
        if self._closed:  # a new call
            self.found_rows, self._closed = 0, False
        tokens = prompt.tolist()
        stream = self.stream_of(row, tokens)
        earlier = self.cache.get(stream)
        found = None if earlier is None else EarlierResponse.of(tokens, earlier, self.keying)
        self._rows[row] = _Row(stream, len(tokens), found, RowKeys(tokens, self.keying))
        self.found_rows += found is not None

    def offer(self, row: Hashable, tokens: torch.LongTensor, max_tokens: int) -> Offer:
        state = self._rows[row]
        if state.earlier is None:
            return Offer()
        own = tokens[state.prompt_length :]  # [generated]
        state.keys.extend(own[state.keys.length :].tolist())
        found, anchor = state.earlier.offer(state.keys.along()[0], own, max_tokens, state.prompt_length)
        return Offer(found, min(anchor, MAX_ANCHOR))

    def finish(self, row: Hashable, tokens: torch.LongTensor | None) -> None:
        state = self._rows.pop(row, None)
        if state is None or tokens is None:
            return
        response = tokens[state.prompt_length :]
        self.cache.store(state.stream, response)
        if self.across_ranks:
            self._stored.append((state.stream, response.tolist()))

    def close(self) -> None:
        """Drop the rows still open; in a data-parallel run, store the other ranks' responses too."""
        self._rows.clear()
        self._closed = True
        stored, self._stored = self._stored, []
        if not self.across_ranks:
            return
        gathered = gather_from_ranks(stored)
        for rank_items in gathered if len(gathered) > 1 else []:
            for stream, response in rank_items:
                self.cache.store(stream, torch.tensor(response, dtype=torch.long))


@dataclass
class _Row:
    """A row as the rollout source follows it."""

    stream: int
    prompt_length: int
    earlier: EarlierResponse | None  # its stream's earlier response
    keys: RowKeys  # its tokens' keys so far
