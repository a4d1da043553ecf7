"""The proposers of continuous batching: the interface the speculator drives, and its two kinds of proposer.

A request is a row: `RequestProposer` is `candidates.base.BatchedProposer` for requests that come and go between
steps, with the engine's rows as lists of tokens. Model-free proposers are `candidates/`'s own sources
(`candidates.free.ModelFreeSource`, built by name in `candidates.sources`), driven here by `ModelFreeRequests`; the
draft model is the one place where the engine shows through: it decodes the requests in a paged cache of its own
(`paged_draft.PagedDraftRequests`). `hybrid.HybridRequests` serves each request from either, as the policy decides.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..candidates.free import ModelFreeSource, Offer
from ..coupling import StreamBook
from .engine import ContinuousBatchingManager

if TYPE_CHECKING:
    from transformers import PreTrainedModel


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
        """Coupled sampling: a draft model drafts its perturbed argmax (`PagedDraftRequests.couple`); model-free
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
    """A model-free source (`candidates.free.ModelFreeSource`: prompt lookup, suffix trees, the rollout cache)
    drafting for the requests, a request being the source's row: its offers, made for the hints, are the drafts, cut
    to length; its trees are the source's. Offers of up to `max_free_tokens` tokens (when above the draft cap) cost no
    draft forward."""

    def __init__(self, source: ModelFreeSource, max_free_tokens: int = 0) -> None:
        self.source = source
        self.max_free_tokens = max_free_tokens
        self._offers: list[Offer] = []

    def start(self, request_id: str, prompt: list[int]) -> None:
        self.source.start(request_id, torch.tensor(prompt, dtype=torch.long))

    def finish(self, request_id: str, tokens: list[int] | None) -> None:
        self.source.finish(request_id, None if tokens is None else torch.tensor(tokens, dtype=torch.long))

    def close(self) -> None:
        self.source.close()

    def hints(self, requests: list[DraftRequest]) -> dict[str, torch.Tensor]:
        self._offers = [self.source.offer(r.request_id, torch.tensor(r.tokens, dtype=torch.long), r.cap) for r in requests]
        hints = {
            "free_lengths": torch.tensor([offer.tokens.shape[0] for offer in self._offers], dtype=torch.long),
            "free_anchors": torch.tensor([offer.anchor for offer in self._offers], dtype=torch.long),
        }
        if self.source.says_confidence:
            hints["free_confidence"] = torch.tensor([offer.confidence for offer in self._offers], dtype=torch.float64)
        return hints

    def drafts(
        self, requests: list[DraftRequest], lengths: list[int], free_rows: list[bool] | None = None
    ) -> list[list[int]]:
        return [offer.tokens[:length].tolist() for offer, length in zip(self._offers, lengths)]

    def trees(
        self, requests: list[DraftRequest], depths: list[int], budgets: list[int], free_rows: list[bool] | None = None
    ) -> list[tuple[list[int], list[int]]]:
        """Each request's tree from the source (`ModelFreeSource.tree`) of at most `budgets[i]` nodes and depth
        `depths[i]`: its tokens and their parent nodes (node 0 is the request's newest token), parents first."""
        return [
            self.source.tree(r.request_id, torch.tensor(r.tokens, dtype=torch.long), depth, budget)
            if depth > 0 and budget > 0
            else ([], [])
            for r, depth, budget in zip(requests, depths, budgets)
        ]
