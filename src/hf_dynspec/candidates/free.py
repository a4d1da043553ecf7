"""Model-free proposals, one row at a time: what prompt lookup, suffix trees and the rollout cache are, for both engines.

A *row* is a row of `generate`'s batch (named by its index in the call) or a request under continuous batching (named
by its request id). A `ModelFreeSource` follows each row from its prompt to its end and offers, from the row's tokens
so far, a continuation that costs no model forward to propose: an earlier span of the row (prompt lookup,
`prompt_lookup.LookupSource`), what followed the row's end in any prompt or output seen (suffix trees,
`suffix.SuffixSource`), or the earlier sample of the row's stream (`rollout.RolloutSource`). Each source lives in its
own module; the engines drive them through one small adapter each: `ModelFreeProposer` here for `generate`'s loop,
`hf_dynspec.continuous.proposers.ModelFreeRequests` under continuous batching. A new model-free proposer is one
`ModelFreeSource` in its own module of `candidates/` and a line in `candidates.sources.SOURCES`.

Offers are proposed deterministically: the verifier takes every token as a fixed proposal (a one-hot `q`), so greedy
and sampled outputs stay exactly the target's whichever source proposed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from ..devices import upload
from ..sequences import TokenBatch
from .base import BatchedProposer, EarlyStop, Proposal, tree_proposal
from .tree import TokenTree

MAX_ANCHOR = 32
"""Longest anchor a source measures: enough to tell a row that copies a span from one that met a short n-gram."""


@dataclass(frozen=True)
class Offer:
    """A source's continuation of one row."""

    tokens: torch.LongTensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # [found] on the host
    anchor: int = 0  # how many of the row's final tokens equal those before the continuation's source (<= MAX_ANCHOR)
    confidence: float | None = None  # how sure the source is of the continuation (`BatchedProposer.free_confidence`)


class ModelFreeSource(ABC):
    """A model-free proposer of one row at a time (see the module's docstring). Rows are named by any hashable id."""

    says_confidence: bool = False
    """Whether its offers carry a `confidence` (suffix trees do; the others leave it `None`)."""

    def start(self, row: Hashable, prompt: torch.LongTensor) -> None:
        """Row `row` begins on `prompt` (`[prompt tokens]` on the host, without padding)."""

    @abstractmethod
    def offer(self, row: Hashable, tokens: torch.LongTensor, max_tokens: int) -> Offer:
        """Up to `max_tokens` tokens continuing the row's `tokens` (`[n]` on the host: its prompt and output so far)."""

    def tree(self, row: Hashable, tokens: torch.LongTensor, depth: int, budget: int) -> tuple[list[int], list[int]]:
        """The row's token tree of at most `budget` draft nodes and depth `depth`: their tokens and parents, the parent
        a node index where node 0 is the root (the row's newest token) and draft node `i` is node `i + 1`; parents
        before children."""
        raise NotImplementedError(f"{type(self).__name__} proposes chains, not token trees.")

    def finish(self, row: Hashable, tokens: torch.LongTensor | None) -> None:
        """The row ended with `tokens` (`[n]`, its prompt and output), or was cancelled or failed (`None`)."""

    def close(self) -> None:
        """The call (or the manager) ended: rows still open are dropped."""


class ModelFreeProposer(BatchedProposer):
    """A `ModelFreeSource` proposing for every row of `generate`'s batch: chains, or token trees under `node_budgets`
    (always trees with `trees=True`), each row up to `num_output_tokens` tokens a step.

    Its offers are model-free proposals the policy prices as such (`free_lengths`, `free_anchors`,
    `free_confidence`): they cost no draft forward, so the policy sizes them from their own acceptance. It reads the
    host copy of the rows' tokens (`TokenBatch.host`), so it never waits for the device."""

    def __init__(self, source: ModelFreeSource, num_output_tokens: int = 10, trees: bool = False) -> None:
        self.source = source
        self.num_output_tokens = num_output_tokens
        self.trees = trees
        self.forwards = 0
        self._offers: list[Offer] | None = None  # this step's `free_lengths`

    def start(self, batch: TokenBatch) -> None:
        super().start(batch)
        host, width = batch.host, batch.prompt_width
        for row in range(batch.batch_size):
            prompt = host.tokens[row, width - int(host.num_prompt[row]) : width]
            self.source.start(int(host.row_ids[row]), prompt)

    def offers(self, batch: TokenBatch, lengths: torch.LongTensor) -> list[Offer]:
        """Each row's offer of up to `lengths[b]` tokens (`[batch]` on the host; capped at `num_output_tokens`), empty
        where the length is 0."""
        lengths = lengths.clamp(max=self.num_output_tokens).tolist()
        row_ids = batch.host.row_ids.tolist()
        none = Offer(confidence=1.0 if self.source.says_confidence else None)
        return [
            self.source.offer(row_ids[row], batch.host_real_tokens(row), n) if n > 0 else none
            for row, n in enumerate(lengths)
        ]

    # ---- what the policy sees ---------------------------------------------------------------------------------------
    def free_lengths(self, batch: TokenBatch, max_length: int) -> torch.LongTensor | None:
        return self.offer_lengths(batch, max_length)

    def offer_lengths(self, batch: TokenBatch, max_length: int) -> torch.LongTensor:
        """`[batch]` tokens each row's offer holds (on the host), asked for up to `max_length` tokens and kept for
        this step's `free_anchors`, `free_confidence` and `take_offers`."""
        self._offers = self.offers(batch, torch.full((batch.batch_size,), max_length, dtype=torch.long))
        return torch.tensor([offer.tokens.shape[0] for offer in self._offers], dtype=torch.long)

    def take_offers(self, batch: TokenBatch, lengths: torch.LongTensor) -> list[Offer]:
        """This step's offers (those of `offer_lengths`, else fresh ones of up to `lengths[b]` tokens), handed over
        once: the next step asks again."""
        offers, self._offers = self._offers, None
        if offers is None or len(offers) != batch.batch_size:
            offers = self.offers(batch, lengths)
        return offers

    def free_anchors(self, batch: TokenBatch) -> torch.LongTensor:
        return torch.tensor([offer.anchor for offer in self._last_offers(batch)], dtype=torch.long)

    def free_confidence(self, batch: TokenBatch) -> torch.Tensor | None:
        if not self.source.says_confidence:
            return None
        return torch.tensor([offer.confidence for offer in self._last_offers(batch)], dtype=torch.float64)

    def _last_offers(self, batch: TokenBatch) -> list[Offer]:
        if self._offers is None or len(self._offers) != batch.batch_size:
            raise RuntimeError("`free_anchors` and `free_confidence` describe the offers of `free_lengths`: call that first.")
        return self._offers

    # ---- proposals ---------------------------------------------------------------------------------------------------
    def propose(
        self,
        batch: TokenBatch,
        lengths: torch.LongTensor,
        early_stop: EarlyStop | None = None,
        free_rows: torch.BoolTensor | None = None,
        node_budgets: torch.LongTensor | None = None,
    ) -> Proposal:
        self.last_free_rows = lengths > 0
        if node_budgets is not None or self.trees:
            self._offers = None
            depths = lengths.clamp(max=self.num_output_tokens)
            budgets = depths if node_budgets is None else node_budgets.to("cpu", copy=True)  # a chain's worth
            return self._tree_proposal(batch, depths, budgets)
        offers = self.take_offers(batch, lengths)
        return proposal_of(batch, [offer.tokens[: int(n)] for offer, n in zip(offers, lengths)])

    def _tree_proposal(self, batch: TokenBatch, depths: torch.LongTensor, budgets: torch.LongTensor) -> Proposal:
        """Each row's tree of at most `budgets[b]` draft nodes and depth `depths[b]` (`[batch]` each, on the host)."""
        row_ids, roots = batch.host.row_ids.tolist(), batch.host_last_tokens().tolist()
        tokens, parents = [], []
        for row, (depth, budget) in enumerate(zip(depths.tolist(), budgets.tolist())):
            found = ([], [])
            if depth > 0 and budget > 0:
                found = self.source.tree(row_ids[row], batch.host_real_tokens(row), depth, budget)
            tokens.append([roots[row]] + found[0])
            parents.append([-1] + found[1])
        return tree_proposal(TokenTree.from_parent_lists(tokens, parents, batch.pad_id), batch.tokens.device)

    # ---- the call's rows ---------------------------------------------------------------------------------------------
    def finish_rows(self, batch: TokenBatch, done: torch.LongTensor) -> None:
        row_ids = batch.host.row_ids
        for row in done.tolist():
            self.source.finish(int(row_ids[row]), batch.host_real_tokens(row))

    def release(self) -> None:
        self.source.close()


def proposal_of(batch: TokenBatch, found: list[torch.LongTensor]) -> Proposal:
    """A placeholder-padded chain `Proposal` of per-row continuations (`found`: `[found_b]` each, on the host), copied
    to the device without waiting for it."""
    tokens, actual = padded(found, batch.batch_size, batch.pad_id)
    device = batch.tokens.device
    return Proposal(upload(tokens, device), upload(actual, device), None, host_lengths=actual)


def padded(found: list[torch.LongTensor], rows: int, pad_id: int) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Per-row continuations (`[found_b]` each) on the host as `[rows, longest]` tokens padded with `pad_id`, and
    their `[rows]` lengths."""
    actual = torch.tensor([f.shape[0] for f in found], dtype=torch.long)
    width = int(actual.max()) if found else 0
    tokens = torch.full((rows, width), pad_id, dtype=torch.long)
    for row, continuation in enumerate(found):
        tokens[row, : continuation.shape[0]] = continuation
    return tokens, actual
