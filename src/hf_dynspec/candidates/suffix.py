"""Suffix speculation: continue each row from everything already written, its own context and every other output.

SuffixDecoding (arXiv 2411.04975) matches the end of a row against suffix trees: one per request over its prompt and
output, and one global tree over outputs. The matched path's continuations, weighted by how often each followed it,
form the proposal: a chain, or a token tree of the most frequent branches. Workloads that repeat themselves gain most:
a GRPO group samples one prompt G times (the siblings' outputs so far predict each other), RL revisits its prompts
every epoch, agents repeat tool calls, code edits copy their input.

The suffix trees are arctic-inference's (`arctic_inference.suffix_decoding.SuffixDecodingCache`, the implementation
vLLM's `method: "suffix"` uses), installed with the `suffix` extra. Each row of a `generate` call is one request:
its prompt goes into the request's own tree, its output into the global tree as it is generated, so rows generated
together (sibling samples of one prompt) see each other's outputs while they are written, and later calls see them
all. `SuffixCache` adds what that cache does not bound: the global tree's total tokens. A cache persists across
calls per target model (`suffix_cache_for`), as the goodput policy does.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .free import MAX_ANCHOR, ModelFreeSource, Offer

if TYPE_CHECKING:
    from ..config import DynSpecConfig

INSTALL_HINT = (
    "The suffix proposer needs arctic-inference's suffix trees: `pip install 'hf_dynspec[suffix]'` (it builds from "
    "source in a few minutes; without build isolation, first `pip install cmake ninja nanobind==2.9.2 grpcio-tools "
    "protobuf` and pass `--no-build-isolation`)."
)


@dataclass(frozen=True)
class SuffixSettings:
    """What bounds a `SuffixCache` and shapes its proposals (from `DynSpecConfig`'s `suffix_*` fields)."""

    max_depth: int = 24  # longest match (and suffix-tree depth)
    max_outputs: int = 256  # outputs the global tree keeps, oldest out first
    max_tokens: int = 262144  # tokens of those outputs, oldest out first
    min_token_probability: float = 0.1  # a proposed token's estimated probability given its path, at least
    max_spec_factor: float = 1.0  # a proposal has at most this many tokens per matched token

    @classmethod
    def from_config(cls, config: DynSpecConfig) -> SuffixSettings:
        """The settings a `DynSpecConfig`'s `suffix_*` fields give."""
        return cls(
            config.suffix_max_depth, config.suffix_cache_outputs, config.suffix_cache_tokens,
            config.suffix_min_token_probability, config.suffix_spec_factor,
        )


def _arctic():
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError as error:
        raise ImportError(INSTALL_HINT) from error
    return SuffixDecodingCache


class SuffixCache:
    """Suffix trees over prompts (per active request) and outputs (global, bounded), kept across `generate` calls.

    Bounded by outputs (arctic-inference evicts the oldest when a request starts past `max_outputs`) and by tokens
    (this class evicts the oldest outputs while the global tree holds more than `max_tokens`).
    """

    def __init__(self, settings: SuffixSettings | None = None) -> None:
        self.settings = settings or SuffixSettings()
        self.trees = _arctic()(max_tree_depth=self.settings.max_depth, max_cached_requests=self.settings.max_outputs)
        self._ids = itertools.count()
        self._sizes: dict[int, int] = {}  # request id -> its output's tokens in the global tree, oldest first
        self._tokens = 0  # sum of `_sizes`

    @property
    def num_outputs(self) -> int:
        """Outputs the global tree holds (those of running requests included)."""
        return len(self.trees.cached_requests)

    @property
    def num_tokens(self) -> int:
        """Tokens of those outputs."""
        return self._tokens

    def start(self, prompt: Sequence[int]) -> int:
        """Begin a request on `prompt`; returns its id."""
        request = next(self._ids)
        self.trees.start_request(request, list(prompt))
        self._sizes[request] = 0
        self._forget_evicted()
        return request

    def extend(self, request: int, tokens: Sequence[int]) -> None:
        """Append `tokens` to the request's output (visible to every request's proposals from now on)."""
        self.trees.add_active_response(request, list(tokens))
        if request in self._sizes:
            self._sizes[request] += len(tokens)
            self._tokens += len(tokens)
        while self._tokens > self.settings.max_tokens and len(self._sizes) > 1:
            oldest = next(iter(self._sizes))
            self.trees.evict_cached_response(oldest)
            self._tokens -= self._sizes.pop(oldest)

    def stop(self, request: int) -> None:
        """End a request: its prompt is dropped, its output stays in the global tree until evicted."""
        if request in self.trees.active_requests:
            self.trees.stop_request(request)

    def speculate(self, request: int, context: Sequence[int], max_tokens: int, tree: bool):
        """arctic-inference's proposal (`SuffixDecodingDraft`: `token_ids`, `parents`, `probs`, `match_len`) for a row
        whose last tokens are `context`: at most `max_tokens` tokens, a tree when `tree`."""
        s = self.settings
        return self.trees.speculate(
            request, list(context)[-s.max_depth :], max_tokens, s.max_spec_factor, 0.0, s.min_token_probability, tree
        )

    def clear(self) -> None:
        """Forget every finished output (running requests keep theirs)."""
        for request in [r for r in self._sizes if r not in self.trees.active_requests]:
            self.trees.evict_cached_response(request)
            self._tokens -= self._sizes.pop(request)

    def _forget_evicted(self) -> None:
        cached = self.trees.cached_requests
        for request in [r for r in self._sizes if r not in cached]:
            self._tokens -= self._sizes.pop(request)


_CACHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Per target model: its suffix caches by settings, so later calls (the next RL epoch, a service's next request) find
the continuations of earlier ones."""


def suffix_cache_for(model: object, settings: SuffixSettings | None = None) -> SuffixCache:
    """The suffix cache `generate` calls on `model` with these settings share (made on first use)."""
    settings = settings or SuffixSettings()
    caches = _CACHES.setdefault(model, {})
    if settings not in caches:
        caches[settings] = SuffixCache(settings)
    return caches[settings]


def clear_suffix_caches(model: object) -> None:
    """Forget the finished outputs of every suffix cache of `model`."""
    for cache in _CACHES.get(model, {}).values():
        cache.clear()


class SuffixSource(ModelFreeSource):
    """Suffix trees for one row at a time: each row's prompt, and every row's output as it is written, so concurrent
    rows see each other's outputs and later ones find earlier ones. A row's anchor is its match length."""

    says_confidence = True

    def __init__(self, cache: SuffixCache) -> None:
        self.cache = cache
        self._requests: dict[Hashable, int] = {}  # row -> the cache's id of it
        self._written: dict[Hashable, int] = {}  # row -> its tokens the cache has

    def start(self, row: Hashable, prompt: torch.LongTensor) -> None:
        if row in self._requests:  # a row of a call that did not close (it raised): its request ends here
            self.cache.stop(self._requests[row])
        self._requests[row] = self.cache.start(prompt.tolist())
        self._written[row] = int(prompt.shape[0])

    def offer(self, row: Hashable, tokens: torch.LongTensor, max_tokens: int) -> Offer:
        draft = self._speculate(row, tokens, max_tokens, tree=False)
        if draft is None:
            return Offer(confidence=1.0)
        found = torch.tensor(draft.token_ids, dtype=torch.long)
        return Offer(found, min(int(draft.match_len), MAX_ANCHOR), chain_confidence(draft.probs))

    def tree(self, row: Hashable, tokens: torch.LongTensor, depth: int, budget: int) -> tuple[list[int], list[int]]:
        draft = self._speculate(row, tokens, budget, tree=True)
        if draft is None:
            return [], []
        nodes, parents = cut_tree(draft.token_ids, draft.parents, depth)
        return nodes, [parent + 1 for parent in parents]  # node 0 is the root, the row's newest token

    def finish(self, row: Hashable, tokens: torch.LongTensor | None) -> None:
        if row not in self._requests:
            return
        if tokens is not None:
            self._write(row, tokens)
        self.cache.stop(self._requests.pop(row))
        self._written.pop(row)

    def close(self) -> None:
        for request in self._requests.values():
            self.cache.stop(request)
        self._requests.clear()
        self._written.clear()

    def _speculate(self, row: Hashable, tokens: torch.LongTensor, max_tokens: int, tree: bool):
        self._write(row, tokens)  # every row's tokens reach the trees, drafting or not
        if max_tokens <= 0:
            return None
        context = tokens[-self.cache.settings.max_depth :].tolist()
        return self.cache.speculate(self._requests[row], context, max_tokens, tree)

    def _write(self, row: Hashable, tokens: torch.LongTensor) -> None:
        """Hand the cache the row's tokens it has not seen yet."""
        written = self._written[row]
        if tokens.shape[0] > written:
            self.cache.extend(self._requests[row], tokens[written:].tolist())
            self._written[row] = int(tokens.shape[0])


def chain_confidence(probs: Sequence[float]) -> float:
    """How sure a suffix chain is, from arctic-inference's `probs` (each token's estimated probability given the
    match, a product along the chain of the shares of earlier occurrences that continued that way): the geometric
    mean of those shares, 1 for an empty chain."""
    return float(probs[-1]) ** (1.0 / len(probs)) if len(probs) else 1.0


def cut_tree(tokens: list[int], parents: list[int], max_depth: int) -> tuple[list[int], list[int]]:
    """The nodes of a draft tree (`parents[i]` the index of node `i`'s parent, -1 under the root) at depth at most
    `max_depth`, parents before children, with parents renumbered."""
    depths = [_depth(parents, i) for i in range(len(tokens))]
    kept: dict[int, int] = {}
    cut_tokens, cut_parents = [], []
    for i in sorted(range(len(tokens)), key=depths.__getitem__):
        if depths[i] > max_depth or (parents[i] >= 0 and parents[i] not in kept):
            continue
        kept[i] = len(cut_tokens)
        cut_tokens.append(tokens[i])
        cut_parents.append(kept[parents[i]] if parents[i] >= 0 else -1)
    return cut_tokens, cut_parents


def _depth(parents: list[int], node: int) -> int:
    depth = 1
    while parents[node] >= 0:
        node, depth = parents[node], depth + 1
    return depth
