"""Coupled sampling: every sampled token is the argmax of its processed scores plus Gumbel noise from a keyed hash.

Words (shared with the config, the stats and the docs): each row of a call samples from its own *stream*, a 63-bit
number computed from the seed, the row's prompt (its token ids without padding) and the row's *index* among the rows
of the call with the same prompt (TRL's GRPO layout: a group of `G` samples of one prompt are its indices
`0 .. G - 1`). Each sampled token has a *key* (`DynSpecConfig.coupling_keys`): by default its *context*, the hash of
the 4 tokens before it (the prompt's, before the response has 4) and how many earlier tokens of the response had a
window with that hash, so no key repeats within a row (`batch_keys`, `RowKeys`); or its *position* in the response (0 for
the first generated token). The *noise* of (stream, key) is one Gumbel variable per token id, computed by a
counter-based hash: nothing is drawn from a generator, so the noise is the same whatever ran before, on every device
and in every process. A key is a function of the row's earlier tokens that never repeats in the row, so each token's
noise is fresh given everything sampled before it, whichever the keying.

The sampled token is `argmax(scores + noise)` over the processed scores (after temperature, top-k, top-p, repetition
penalty, ...). With Gumbel noise that is exactly a sample of `softmax(scores)` (the Gumbel-max trick); what a row
samples is a deterministic function of its stream and of the model's distributions along the row. Hence:

- the output does not depend on which proposer ran, how many tokens it drafted or which rows shared the batch: a
  proposal is verified by equality with the perturbed argmax, as in greedy decoding, and a draft model proposes its
  own perturbed argmax under the same noise;
- two models sampled with the same stream agree on a token with probability at least `(1 - TV) / (1 + TV)` in the
  total variation distance of their distributions (Daliri, Musco and Suresh, 2024: "Coupling without communication
  and drafter-invariant speculative decoding"). A policy sampled again after a small update repeats most of what it
  sampled before, which the rollout cache (`candidates.rollout`) proposes back. Keyed by context, a later sample that
  inserted or dropped a token samples with the earlier sample's noise again once its last 4 tokens are the earlier
  sample's; keyed by position, only after a substitution.

The hash: `mix32` is a 32-bit integer finaliser (two multiply-xorshift rounds with odd constants below 2^31, so every
product fits in a signed 64-bit integer and the arithmetic is exact on every device). A token id times an odd
constant goes through two rounds keyed by the two 32-bit halves of the token's key, which `token_keys` derives from
(stream, key); its top 23 bits and a half give a uniform in (0, 1) (exactly representable in
float32, so never 1), and `-log(-log(u))` the Gumbel variable, which is below `GUMBEL_MAX`.
Distinct (stream, key) pairs get independent noise up to 64-bit stream collisions.
"""

from __future__ import annotations

import hashlib
import struct
import threading
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .sequences import TokenBatch

SAMPLERS = ("standard", "coupled")
"""Values of `DynSpecConfig.sampling`."""

_MASK = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9
_ROUNDS = (0x21F0AAAD, 0x735A2D97)
_UNIFORM_BITS = 23


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijection of 32-bit values held in an int64 tensor (any shape): xorshift-multiply rounds."""
    x = x ^ (x >> 16)
    x = (x * _ROUNDS[0]) & _MASK
    x = x ^ (x >> 15)
    x = (x * _ROUNDS[1]) & _MASK
    return x ^ (x >> 15)


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """`mix32` in place (for the large `[items, vocab]` tensors of the noise)."""
    x ^= x >> 16
    x.mul_(_ROUNDS[0]).bitwise_and_(_MASK)
    x ^= x >> 15
    x.mul_(_ROUNDS[1]).bitwise_and_(_MASK)
    x ^= x >> 15
    return x


def token_keys(streams: torch.LongTensor, keys: torch.LongTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two 32-bit halves of each token's noise key (`[items]` each, int64) from its stream and key (`[items]`:
    a position, or a context key `window | count << 32`, see `batch_keys`). Distinct keys of one stream give
    distinct halves (each step is a bijection of what it adds)."""
    low, high = streams & _MASK, (streams >> 32) & _MASK
    at = mix32((keys & _MASK) ^ _GOLDEN)
    first = mix32(low ^ at)
    return first, mix32(high ^ mix32(first ^ _ROUNDS[0] ^ ((keys >> 32) & _MASK)))


# ---- noise ------------------------------------------------------------------------------------------------------------
def _noise_at(first: torch.Tensor, second: torch.Tensor, ids: torch.LongTensor) -> torch.Tensor:
    """Float32 Gumbel noise of token `ids` under keys `first`, `second` (all broadcast to one shape)."""
    x = ((ids * _GOLDEN) & _MASK) ^ first
    _mix32_(x)
    x ^= second
    _mix32_(x)
    uniform = (x >> (32 - _UNIFORM_BITS)).float().add_(0.5).mul_(2.0**-_UNIFORM_BITS)  # in (0, 1)
    return uniform.log_().neg_().log_().neg_()


GUMBEL_MAX = 16.7
"""Above every value the noise takes: `-log(-log(1 - 2^-24))` = 24 ln 2 = 16.64 for the largest uniform (23 bits, and
a half, so that it is below 1 in float32)."""
ITEMS_AT_ONCE = 8
"""Items whose candidates are hashed together: their scores and noise stay in the CPU's caches."""


def gumbel_noise(
    streams: torch.LongTensor,  # [items]
    keys: torch.LongTensor,  # [items]
    vocab: int,
    device: torch.device | None = None,
) -> torch.Tensor:
    """`[items, vocab]` float32 Gumbel noise of each item's (stream, key) over token ids `0 .. vocab - 1`."""
    device = device or streams.device
    first, second = token_keys(streams.to(device).long(), keys.to(device).long())
    ids = torch.arange(vocab, device=device).unsqueeze(0)  # [1, vocab]
    return _noise_at(first.unsqueeze(1), second.unsqueeze(1), ids)


def coupled_choice(
    scores: torch.Tensor,  # [..., vocab] processed scores
    streams: torch.LongTensor,  # [...]
    positions: torch.LongTensor,  # [...]
) -> torch.LongTensor:
    """`[...]` the perturbed argmax `argmax(scores + noise)` (ties to the lowest id): exactly a sample of
    `softmax(scores)` at each item, fixed by its stream and key."""
    shape = scores.shape[:-1]
    out = torch.empty(shape.numel(), dtype=torch.long, device=scores.device)
    for part in _candidates(scores, streams, positions):
        best = part.values.new_full((part.count,), float("-inf")).scatter_reduce(0, part.items, part.values, "amax")
        winners = part.values == best[part.items]
        first_id = part.ids.new_full((part.count,), scores.shape[-1])
        out[part.start : part.start + part.count] = first_id.scatter_reduce(
            0, part.items[winners], part.ids[winners], "amin"
        )
    return out.view(shape)


def perturb(
    scores: torch.Tensor,  # [..., vocab]
    streams: torch.LongTensor,  # [...]
    positions: torch.LongTensor,  # [...]
) -> torch.Tensor:
    """`[..., vocab]` float32: each item's scores plus its Gumbel noise wherever a token can still be the perturbed
    argmax, `-inf` elsewhere (its `argmax` is `coupled_choice`; the best few of it rank a draft tree's children)."""
    flat = scores.reshape(-1, scores.shape[-1])
    out = torch.full(flat.shape, float("-inf"), device=scores.device)
    for part in _candidates(scores, streams, positions):
        out[part.start + part.items, part.ids] = part.values
    return out.view(scores.shape)


@dataclass
class _Candidates:
    """The tokens of items `start .. start + count - 1` that can be the perturbed argmax, with their perturbed
    scores (`[candidates]` each; `items` counts from `start`)."""

    start: int
    count: int
    items: torch.LongTensor
    ids: torch.LongTensor
    values: torch.Tensor


def _candidates(scores: torch.Tensor, streams: torch.LongTensor, positions: torch.LongTensor):
    """Each block of `ITEMS_AT_ONCE` items' candidates (`_Candidates`).

    Noise is hashed only for the candidates: an item's best-scoring token `t` beats any token `v` with
    `s(v) + GUMBEL_MAX < s(t) + g(t)`, so only tokens scoring at least `s(t) + g(t) - GUMBEL_MAX` can win. Under a
    language model's scores that is a few percent of the vocabulary, and the hash, the costly part, runs on it alone.
    """
    flat = scores.reshape(-1, scores.shape[-1])  # [items, vocab]
    keys = token_keys(streams.reshape(-1).to(flat.device).long(), positions.reshape(-1).to(flat.device).long())
    for start in range(0, flat.shape[0], ITEMS_AT_ONCE):
        block = flat[start : start + ITEMS_AT_ONCE].float()  # [block, vocab]
        first, second = (key[start : start + ITEMS_AT_ONCE] for key in keys)
        top_score, top = block.max(dim=1)  # [block]
        reach = top_score + _noise_at(first, second, top) - GUMBEL_MAX  # the lowest score that can still win
        items, ids = (block >= reach.unsqueeze(1)).nonzero(as_tuple=True)  # [candidates] each
        values = block[items, ids] + _noise_at(first[items], second[items], ids)
        yield _Candidates(start, block.shape[0], items, ids, values)


# ---- keys ------------------------------------------------------------------------------------------------------------
KEYINGS = ("context", "position")
"""Values of `DynSpecConfig.coupling_keys`: what a sampled token's noise is keyed by besides its row's stream."""
CONTEXT_TOKENS = 4
"""Tokens a context key's window covers."""
_OUTSIDE = _MASK
"""Stands for the tokens before a sequence's first in a window (no token id is 2^32 - 1)."""


def window_hashes(sequence: torch.LongTensor) -> torch.LongTensor:
    """`[..., length]` a 32-bit hash of the `CONTEXT_TOKENS` tokens of `sequence` (`[..., length]`) ending at each
    index (`_OUTSIDE` for those before index 0 and for entries equal to `_OUTSIDE`)."""
    tokens = sequence.long() & _MASK
    lead = tokens.new_full(tokens.shape[:-1] + (CONTEXT_TOKENS - 1,), _OUTSIDE)
    padded = torch.cat([lead, tokens], dim=-1)  # [..., length + CONTEXT_TOKENS - 1]
    length = tokens.shape[-1]
    hashed = mix32(padded[..., :length] ^ _GOLDEN)
    for offset in range(1, CONTEXT_TOKENS):
        hashed = mix32(hashed ^ padded[..., offset : offset + length])
    return hashed


def batch_keys(
    batch: TokenBatch,
    rows: torch.LongTensor,  # [rows] rows of `batch`
    path: torch.LongTensor,  # [rows, ..., depth] draft tokens after each row's committed ones
    drawn: torch.LongTensor,  # [rows, ...] how many of `path` precede the sampled token
    keying: str,
) -> torch.LongTensor:
    """`[rows, ...]` the key of the token each item samples after its row's committed tokens and `drawn` tokens of
    its `path` (`keying`: 'position' or 'context'), on the device."""
    shape = drawn.shape
    rows = rows.view((-1,) + (1,) * (drawn.dim() - 1)).expand(shape).reshape(-1)  # [items]
    drawn = drawn.reshape(-1)
    if keying == "position":
        return (batch.num_generated[rows] + drawn).view(shape)
    path = path.reshape(drawn.shape[0], -1).long()  # [items, depth]
    windows, real = _committed_windows(batch)  # [batch, width] each
    end = batch.prompt_width + batch.num_generated[rows]  # [items] the column after each row's committed tokens
    before = torch.arange(-CONTEXT_TOKENS, 0, device=end.device)  # [CONTEXT_TOKENS]
    at = end.unsqueeze(1) + before  # [items, CONTEXT_TOKENS]
    tail = torch.where(at >= 0, real[rows].gather(1, at.clamp(min=0)), _OUTSIDE)  # the last committed tokens
    local = window_hashes(torch.cat([tail, path], dim=1))[:, CONTEXT_TOKENS - 1 :]  # [items, depth + 1]
    own = local.gather(1, drawn.unsqueeze(1))  # [items, 1]: local[:, j] precedes path token j
    steps = torch.arange(path.shape[1], device=end.device).unsqueeze(0)  # [1, depth]
    in_path = ((local[:, :-1] == own) & (steps < drawn.unsqueeze(1))).sum(dim=1)
    columns = torch.arange(windows.shape[1], device=end.device).unsqueeze(0)  # [1, width]
    response = (columns >= batch.prompt_width - 1) & (columns < end.unsqueeze(1) - 1)  # windows of response tokens
    in_response = ((windows[rows] == own) & response).sum(dim=1)
    return (own.squeeze(1) | ((in_path + in_response) << 32)).view(shape)


def _committed_windows(batch: TokenBatch) -> tuple[torch.LongTensor, torch.LongTensor]:
    """`[batch, width]` each: the window hash ending at every column of `batch.tokens`, and the tokens with
    `_OUTSIDE` wherever a row holds no real token (left padding, columns after its committed tokens)."""
    columns = torch.arange(batch.tokens.shape[1], device=batch.tokens.device).unsqueeze(0)  # [1, width]
    start = (batch.prompt_width - batch.num_prompt).unsqueeze(1)  # [batch, 1]
    end = (batch.prompt_width + batch.num_generated).unsqueeze(1)
    real = torch.where((columns >= start) & (columns < end), batch.tokens, _OUTSIDE)
    return window_hashes(real), real


def _mix32_int(x: int) -> int:
    """`mix32` of one Python int (the same arithmetic, on the host)."""
    x ^= x >> 16
    x = (x * _ROUNDS[0]) & _MASK
    x ^= x >> 15
    x = (x * _ROUNDS[1]) & _MASK
    return x ^ (x >> 15)


def window_hash(window: Sequence[int]) -> int:
    """`window_hashes` of the `CONTEXT_TOKENS` tokens `window` (oldest first; `_OUTSIDE` before a sequence's start)."""
    hashed = _mix32_int((int(window[0]) & _MASK) ^ _GOLDEN)
    for token in window[1:]:
        hashed = _mix32_int(hashed ^ (int(token) & _MASK))
    return hashed


class RowKeys:
    """The keys of one row's tokens on the host, as its response grows (what `batch_keys` computes on the device for
    the loop's rows): proposers that align an earlier sample by key, and continuous batching, use it."""

    def __init__(self, prompt: Sequence[int], keying: str) -> None:
        self.keying = keying
        self.length = 0  # response tokens taken in
        self._window = ([_OUTSIDE] * CONTEXT_TOKENS + [int(t) for t in prompt])[-CONTEXT_TOKENS:]
        self._seen: Counter[int] = Counter()  # response tokens sampled after each window hash

    def extend(self, tokens: Sequence[int]) -> None:
        """Take in the next response `tokens`."""
        for token in tokens:
            self._seen[window_hash(self._window)] += 1
            self._window = self._window[1:] + [int(token)]
        self.length += len(tokens)

    def along(self, path: Sequence[int] = ()) -> list[int]:
        """The key of the next token, then of the token after each further token of `path`: `len(path) + 1` keys."""
        if self.keying == "position":
            return list(range(self.length, self.length + len(path) + 1))
        keys, window, extra = [], self._window, Counter()
        for token in [*path, None]:
            hashed = window_hash(window)
            keys.append(hashed | (self._seen[hashed] + extra[hashed]) << 32)
            extra[hashed] += 1
            window = window[1:] + [token]
        return keys


def response_keys(prompt: Sequence[int], response: Sequence[int], keying: str) -> list[int]:
    """The key of each token of `response` (after `prompt`) under `keying`: what a row that samples `response`
    hashes its noise with."""
    return RowKeys(prompt, keying).along(response)[: len(response)]


# ---- streams ---------------------------------------------------------------------------------------------------------
REUSE_SEED = 0
"""The seed of rollout reuse when the config names none: every epoch must sample with the same seed to find its
earlier samples, so it cannot be drawn anew per call."""
_SEED_BOUND = 1 << 62


def call_seed(seed: int | None, reuse_rollouts: bool) -> int:
    """The coupling seed of one call: `seed` when given; with rollout reuse and no seed, `REUSE_SEED` (with a warning,
    shown once by Python's default filter); otherwise one drawn from torch's default generator, so a seeded run
    (`torch.manual_seed`, `transformers.set_seed`) repeats its samples and two calls sample independently."""
    if seed is not None:
        return int(seed)
    if reuse_rollouts:
        warnings.warn(
            f"reuse_rollouts=True without a seed: coupled sampling uses seed {REUSE_SEED}, the same in every call, so "
            "that each epoch finds its earlier samples. Pass DynSpecConfig(seed=...) to choose another.",
            UserWarning,
            stacklevel=3,
        )
        return REUSE_SEED
    return int(torch.randint(0, _SEED_BOUND, (1,)))


def prompt_digest(prompt: Sequence[int]) -> bytes:
    """16 bytes that identify a prompt (its token ids without padding)."""
    tokens = [int(token) for token in prompt]
    return hashlib.blake2b(struct.pack(f"<{len(tokens)}q", *tokens), digest_size=16).digest()


def stream_of(seed: int, digest: bytes, index: int) -> int:
    """The stream of the `index`-th sample of the prompt with `digest` under `seed`: a 63-bit non-negative int."""
    material = digest + int(seed).to_bytes(16, "little", signed=True) + int(index).to_bytes(8, "little")
    return int.from_bytes(hashlib.blake2b(material, digest_size=8).digest(), "little") >> 1


def sample_indices(digests: Sequence[bytes], offsets: dict[bytes, int] | None = None) -> list[int]:
    """Each row's index among the rows with the same prompt, in row order, after `offsets[digest]` earlier ones."""
    seen: Counter[bytes] = Counter(offsets or {})
    indices = []
    for digest in digests:
        indices.append(seen[digest])
        seen[digest] += 1
    return indices


def stream_keys(
    prompts: Sequence[Sequence[int]], seed: int, device: torch.device | None = None, across_ranks: bool = True
) -> torch.LongTensor:
    """`[rows]` each row's stream: (seed, its prompt, its index among the rows with that prompt).

    In a run of several processes (`torch.distributed`, data parallel), indices count the same prompt's rows on lower
    ranks first, so no two rows of the run share a stream (a GRPO group split over two ranks samples no twins), and a
    prompt's sample `i` finds stream `i` again on whichever rank it lands next time. That takes one `all_gather` of
    the prompts' digests, so every rank must generate together (as TRL's trainers do). `across_ranks=False` counts
    this process's rows only (the ranks of a tensor-parallel target, which decode the same rows).
    """
    digests = [prompt_digest(prompt) for prompt in prompts]
    indices = sample_indices(digests, _lower_ranks_counts(digests) if across_ranks else None)
    streams = [stream_of(seed, digest, index) for digest, index in zip(digests, indices)]
    return torch.tensor(streams, dtype=torch.long, device=device)


def _lower_ranks_counts(digests: list[bytes]) -> dict[bytes, int]:
    """Per prompt digest, how many rows with that prompt the lower ranks of a data-parallel run hold (`{}` alone)."""
    gathered = gather_from_ranks(digests)
    if len(gathered) == 1:
        return {}
    return dict(Counter(d for rank_digests in gathered[: dist.get_rank()] for d in rank_digests))


def gather_from_ranks(items: list) -> list[list]:
    """Every rank's `items` (picklable), in rank order: `[items]` in a single process. A collective: in a run of
    several processes every rank must call it together."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return [items]
    gathered: list[list | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, items)
    return [rank_items or [] for rank_items in gathered]


class StreamBook:
    """Streams of requests that arrive one at a time (continuous batching): a request's index is the lowest one that
    no other request in flight with the same prompt holds, so concurrent samples of a prompt are indices
    `0, 1, ...` (a GRPO group added together), and a prompt requested again after its earlier requests finished
    finds the same streams again (the next epoch's group)."""

    def __init__(self, seed: int, keying: str = "context") -> None:
        self.seed, self.keying = seed, keying
        self._held: dict[bytes, set[int]] = {}  # per prompt digest: the indices of requests in flight
        self._streams: dict[str, tuple[bytes, int, int]] = {}  # request id -> (digest, index, stream)
        self._keys: dict[str, RowKeys] = {}  # request id -> its tokens' keys so far
        self._lock = threading.Lock()  # requests are added from the caller's thread, sampled in the manager's

    def assign(self, request_id: str, prompt: Sequence[int]) -> int:
        """The stream of `request_id` (given its prompt's token ids), assigned on first sight."""
        with self._lock:
            if request_id not in self._streams:
                digest = prompt_digest(prompt)
                held = self._held.setdefault(digest, set())
                index = next(i for i in range(len(held) + 1) if i not in held)
                held.add(index)
                self._streams[request_id] = (digest, index, stream_of(self.seed, digest, index))
            return self._streams[request_id][2]

    def keys(
        self, request_id: str, prompt: Sequence[int], response: Sequence[int], paths: Sequence[Sequence[int]]
    ) -> list[int]:
        """The key of the token `request_id` samples after its `response` so far and each of `paths` (draft tokens)."""
        with self._lock:
            row = self._keys.get(request_id) or RowKeys(prompt, self.keying)
            if request_id in self._streams:  # kept while the request is in flight (`release` drops it)
                self._keys[request_id] = row
            row.extend(response[row.length :])
            return [row.along(path)[-1] for path in paths]

    def release(self, request_id: str) -> None:
        """The request finished or was cancelled: its index is free for the prompt's next request."""
        with self._lock:
            self._keys.pop(request_id, None)
            entry = self._streams.pop(request_id, None)
            if entry is not None:
                held = self._held[entry[0]]
                held.discard(entry[1])
                if not held:
                    del self._held[entry[0]]

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._streams
