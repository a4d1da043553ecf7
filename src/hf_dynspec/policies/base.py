"""The policy interface: each step, a policy chooses a draft length for every active row."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel


@dataclass
class PolicyInput:
    """What a policy sees before a step.

    Row identity is stable for a whole `generate` call: `row_ids` holds each active row's index in the original batch,
    so per-row state (acceptance estimates) can be kept in tensors of size `num_rows` given to `reset`.
    """

    step: int
    row_ids: torch.LongTensor  # [batch] original batch index of each active row
    remaining_tokens: torch.LongTensor  # [batch] tokens each row may still emit before its length limit
    max_draft_tokens: int  # upper bound on any row's draft length (DynSpecConfig.num_speculative_tokens)
    backlog: torch.LongTensor | None = None  # [batch] tokens the draft model must catch up on before it drafts
    free_lengths: torch.LongTensor | None = None  # [batch] draft tokens a model-free proposal offers (hybrid only)
    max_tree_nodes: int = 0  # most draft nodes of a row's token tree (DynSpecConfig.tree_node_budget); 0 = chains
    free_anchors: torch.LongTensor | None = None  # [batch] tokens the row's end shares with the free proposal's source
    free_confidence: torch.Tensor | None = None  # [batch] how sure the free proposal is (`free_confidence`), or None
    draft_tries_free: bool = True  # a hybrid's draft forwards also try the free proposals' tokens (draft lookahead)

    @property
    def batch_size(self) -> int:
        return int(self.row_ids.shape[0])


@dataclass
class StepFeedback:
    """What happened in a step, given to `DraftLengthPolicy.observe` after verification.

    The loop pads draft tokens to the longest row, so the target processes `batch_size * (1 + max(draft_lengths))`
    tokens in the verify forward (`target_tokens`; the real tokens alone when it packs verify forwards), and the draft model runs `max(draft_lengths)` forwards in
    `draft_seconds`. A draft catching up on a backlog (its prompt prefill) spends `catchup_seconds` on top.
    """

    row_ids: torch.LongTensor  # [batch]
    requested_lengths: torch.LongTensor  # [batch] what the policy asked for
    draft_lengths: torch.LongTensor  # [batch] what the proposer actually proposed (<= requested)
    accepted: torch.LongTensor  # [batch] accepted draft tokens per row
    draft_seconds: float
    verify_seconds: float
    target_tokens: int
    catchup_seconds: float = 0.0  # draft catch-up on a backlog (its prefill), not included in draft_seconds
    catchup_tokens: int = 0  # tokens the draft processed in that catch-up forward, padding included
    free_rows: torch.BoolTensor | None = None  # [batch] rows served by the model-free proposal (hybrid only)
    plain_tokens: int | None = None  # the forward's tokens without draft tokens (None: one per row); under continuous
    # batching other requests' prompt chunks ride along in the same forward

    @property
    def batch_size(self) -> int:
        return int(self.row_ids.shape[0])


@dataclass
class PrefillFeedback:
    """The target's prefill of a `generate` call, given to `DraftLengthPolicy.observe_prefill` before the first step.

    `draft_cost_ratio` (the draft's parameter count over the target's) lets a policy price the draft's own prefill
    before paying it; it is `None` without a draft model. With `draft_rows_apart` a step's draft costs grow with the
    rows that draft, not with the longest draft alone.
    """

    batch_size: int
    tokens: int  # tokens the target processed, padding included (batch_size * prompt width)
    seconds: float
    draft_cost_ratio: float | None = None
    draft_rows_apart: bool = False  # the proposer drafts each row in forwards of its own (`BatchedProposer.rows_apart`)
    packed_verify: bool = False  # verify forwards compute only the real tokens (`hf_dynspec.packing`)


class DraftLengthPolicy(ABC):
    """Chooses each active row's draft length (0 .. `max_draft_tokens`) every step.

    Subclasses implement `draft_lengths`; `observe` receives the outcome of each step and `continue_drafting` lets a
    policy stop a row's drafting early from the draft's own confidence.
    """

    name: str = "base"

    def reset(self, num_rows: int) -> None:
        """Called once at the start of each `generate` call with the number of rows in the batch."""

    def forget_rows(self, row_ids: torch.LongTensor) -> None:
        """Rows `row_ids` (`[n]`) now belong to new requests: forget what was learned of them (continuous batching
        hands a finished request's row id to the next one, within one `reset`)."""

    @abstractmethod
    def draft_lengths(self, request: PolicyInput) -> torch.LongTensor:
        """Return `torch.LongTensor` of shape `(batch,)` with values in `[0, request.max_draft_tokens]`."""

    def observe_prefill(self, feedback: PrefillFeedback) -> None:
        """Learn from the target's prefill of this call (called once, after `reset`, before the first step)."""

    def observe(self, feedback: StepFeedback) -> None:
        """Learn from a finished step (accepted counts, timings)."""

    def free_rows(self, request: PolicyInput) -> torch.BoolTensor | None:
        """`[batch]` True where a row's draft tokens should come from the model-free proposal (hybrid proposers).

        Called right after `draft_lengths` with the same request; `None` lets the proposer choose (lookup where it
        has a continuation).
        """
        return None

    def node_budgets(self, request: PolicyInput, lengths: torch.LongTensor) -> torch.LongTensor | None:
        """`[batch]` draft nodes of each row's token tree, given the depths `lengths` just chosen (trees only).

        Called right after `draft_lengths` with the same request when the proposer builds trees
        (`request.max_tree_nodes > 0`). The default gives every drafting row the whole budget.
        """
        return torch.where(lengths > 0, request.max_tree_nodes, 0)

    @property
    def stops_early(self) -> bool:
        """Whether `continue_drafting` may stop rows (the loop then judges every draft token as it is drawn). True
        when a subclass overrides `continue_drafting`."""
        return type(self).continue_drafting is not DraftLengthPolicy.continue_drafting

    def continue_drafting(
        self, row_ids: torch.LongTensor, position: int | torch.LongTensor, draft_probs: torch.Tensor
    ) -> torch.BoolTensor | None:
        """Early stop while drafting, called for the rows that just drew a draft token.

        Args:
            row_ids: `[n]` original indices of those rows.
            position: index (0-based) of the token just drawn in each row's draft: one for all, or `[n]` (with draft
                lookahead one forward may yield several tokens of a row, so rows may be at different positions).
            draft_probs: `[n]` the draft's probability of the token it just drew.

        Returns:
            `[n]` bool, `False` where the row should stop after this token, or `None` to keep every row going.
        """
        return None


def parameter_ratio(draft: PreTrainedModel, target: PreTrainedModel) -> float:
    """Draft parameters over target parameters: the prior of the draft's cost relative to the target's."""
    return sum(p.numel() for p in draft.parameters()) / max(sum(p.numel() for p in target.parameters()), 1)
