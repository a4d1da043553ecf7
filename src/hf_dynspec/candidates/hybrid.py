"""A hybrid proposer: per row and step, draft tokens from a model-free source (free) or from the draft model.

Code edits and chat about code copy long spans of their context, which prompt lookup proposes at no model cost; text
that is new needs the draft model. The policy decides per row which source serves it (`DraftLengthPolicy.free_rows`,
which `goodput` answers from each source's acceptance and the step's cost); without an answer, a row takes prompt
lookup when its continuation covers the requested length. The draft model runs only when some row draft from it;
rows served by prompt lookup keep their accepted tokens in the draft's backlog, which it catches up on later.
"""

from __future__ import annotations

import torch

from ..devices import upload
from ..sequences import TokenBatch
from .base import BatchedProposer, EarlyStop, Proposal
from .draft_model import DraftModelProposer
from .free import ModelFreeProposer, proposal_of


class HybridProposer(BatchedProposer):
    """A model-free offer (prompt lookup, suffix trees, the rollout cache) where a row has one and the policy prefers
    it, the draft model elsewhere."""

    def __init__(self, draft: DraftModelProposer, free: ModelFreeProposer) -> None:
        self.draft = draft
        self.free = free
        self._draft_proposal: Proposal | None = None

    @property
    def model(self):
        return self.draft.model

    @property
    def reads_target_states(self) -> bool:
        return self.draft.reads_target_states

    @property
    def forwards(self) -> int:
        return self.draft.forwards

    def start(self, batch: TokenBatch) -> None:
        self.draft.start(batch)
        self.free.start(batch)

    def couple(self, streams: torch.LongTensor, keying: str = "context") -> None:
        self.draft.couple(streams, keying)

    def backlog(self, batch: TokenBatch) -> torch.LongTensor:
        return self.draft.backlog(batch)

    def free_lengths(self, batch: TokenBatch, max_length: int) -> torch.LongTensor:
        return self.free.offer_lengths(batch, max_length)

    def free_confidence(self, batch: TokenBatch) -> torch.Tensor | None:
        return self.free.free_confidence(batch)

    def free_anchors(self, batch: TokenBatch) -> torch.LongTensor:
        """`[batch]` anchors of this step's model-free offers, after `free_lengths`."""
        return self.free.free_anchors(batch)

    def propose(
        self,
        batch: TokenBatch,
        lengths: torch.LongTensor,
        early_stop: EarlyStop | None = None,
        free_rows: torch.BoolTensor | None = None,
        node_budgets: torch.LongTensor | None = None,
    ) -> Proposal:
        offers = self.free.take_offers(batch, lengths)
        offered = torch.tensor([o.tokens.shape[0] for o in offers], dtype=torch.long)  # [batch] on the host
        if free_rows is None:
            free_rows = offered >= lengths
        free_rows = free_rows.to("cpu", copy=True) & (lengths > 0) & (offered > 0)
        by_draft = torch.where(free_rows, torch.zeros_like(lengths), lengths)
        self.catchup_seconds, self.catchup_tokens, self.setup_seconds, self._draft_proposal = 0.0, 0, 0.0, None
        if int(by_draft.max()) > 0:
            self._draft_proposal = self.draft.propose(batch, by_draft, early_stop)
            self.catchup_seconds, self.catchup_tokens = self.draft.catchup_seconds, self.draft.catchup_tokens
            self.setup_seconds = self.draft.setup_seconds
        found = [o.tokens[: int(n) if bool(free) else 0] for o, n, free in zip(offers, lengths, free_rows)]
        self.last_free_rows = free_rows
        return self._merge(proposal_of(batch, found), free_rows)

    def commit(self, batch: TokenBatch, proposal: Proposal, kept: torch.BoolTensor) -> None:
        if self._draft_proposal is not None:  # steps without a proposal commit nothing
            self.draft.commit(batch, self._draft_proposal, kept & ~self.last_free_rows.unsqueeze(1))
            self._draft_proposal = None

    def finish_rows(self, batch: TokenBatch, done: torch.LongTensor) -> None:
        self.draft.finish_rows(batch, done)
        self.free.finish_rows(batch, done)

    def select_rows(self, keep: torch.LongTensor) -> None:
        self.draft.select_rows(keep)
        self.free.select_rows(keep)

    def release(self) -> None:
        self.draft.release()
        self.free.release()

    def _merge(self, looked_up: Proposal, free_rows: torch.BoolTensor) -> Proposal:
        """One placeholder-padded proposal: lookup rows from `looked_up`, the others from the draft's proposal
        (`free_rows` `[batch]`, on the host)."""
        drafted = self._draft_proposal
        if drafted is None:
            return looked_up
        width = max(looked_up.max_length, drafted.max_length)
        free = upload(free_rows, drafted.tokens.device)  # [batch]
        tokens = _pad(drafted.tokens, width, 0)  # [batch, width]
        tokens = torch.where(free.unsqueeze(1), _pad(looked_up.tokens, width, 0), tokens)
        lengths = torch.where(free, looked_up.lengths, drafted.lengths)
        host_lengths = torch.where(free_rows, looked_up.lengths_on_host(), drafted.lengths_on_host())
        probs = None
        if drafted.probs is not None:  # sampling: lookup rows proposed their tokens with q one-hot
            one_hot = torch.nn.functional.one_hot(tokens, drafted.probs.shape[-1]).to(drafted.probs.dtype)
            padded = torch.nn.functional.pad(drafted.probs, (0, 0, 0, width - drafted.max_length))
            probs = torch.where(free[:, None, None], one_hot, padded)  # [batch, width, vocab]
        return Proposal(tokens, lengths, probs, host_lengths=host_lengths)


def _pad(tokens: torch.LongTensor, width: int, value: int) -> torch.LongTensor:
    """`tokens` (`[batch, w]`) padded on the right to `[batch, width]` with placeholder `value`."""
    return torch.nn.functional.pad(tokens, (0, width - tokens.shape[1]), value=value)
