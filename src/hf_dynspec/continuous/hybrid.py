"""A model-free source beside the draft model under continuous batching: per request and step, either."""

from __future__ import annotations

import torch

from ..coupling import StreamBook
from .engine import ContinuousBatchingManager, PagedAttentionCache
from .paged_draft import PagedDraftRequests
from .proposers import DraftRequest, ModelFreeRequests, RequestProposer


class HybridRequests(RequestProposer):
    """Per request and step, a model-free offer (suffix trees, prompt lookup, the rollout cache) or the draft model, as the policy
    decides (`DraftLengthPolicy.free_rows`; without an answer, the offer where it covers the chosen length), as
    `HybridProposer` does in `generate`. Offers hold up to `max_free_tokens` (`prompt_lookup_max_tokens`): they cost no
    draft forward. The draft model runs only for the requests it serves and catches up later on the tokens the others
    accepted."""

    def __init__(self, free: ModelFreeRequests, draft: PagedDraftRequests, max_free_tokens: int) -> None:
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
        self.free.close()
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
