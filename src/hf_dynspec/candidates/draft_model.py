"""A draft model proposes tokens autoregressively from its own KV cache."""

from __future__ import annotations

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.generation.candidate_generator import CandidateGenerator

from ..cache import RaggedCache, check_cache_supported
from ..config import DynSpecConfig
from ..placement import Placement
from ..processors import process_logits
from ..sequences import TokenBatch
from .base import BatchedProposer, EarlyStop, Proposal

MAX_INLINE_TAIL = 2
"""Backlogs up to this width (the newest token, plus the last draft token after a bonus) ride in the first draft
forward; wider ones are caught up in a forward of their own."""


class DraftModelProposer(CandidateGenerator, BatchedProposer):
    """Proposes draft tokens with a smaller model that shares the target's vocabulary.

    The draft is driven directly (no nested `generate`): it keeps a [`RaggedCache`] and the count of each row's real
    tokens it has processed (`num_seen`). Each `propose` first feeds, in the same forward that predicts the first
    draft token, every committed token the draft has not seen yet: the new token of the last step and, when a row
    accepted all its draft tokens, the last draft token too (its KV was never computed, since the draft stops after
    predicting it). So the bonus token never costs a separate draft pass.

    Longer backlogs (the prompt, the first time a row drafts, or the tokens of steps without speculation) are a
    *catch-up*: one extra forward over all but the newest token, timed apart (`catchup_seconds`) so that policies
    learning draft costs are not misled by what is really the draft's prefill. The prompt is caught up lazily, only
    once some row drafts, so a batch that never speculates never runs the draft at all.

    As a transformers `CandidateGenerator` it also runs inside transformers' own batch-1 assisted loop.
    """

    def __init__(
        self,
        draft_model: PreTrainedModel,
        logits_processor: LogitsProcessorList,
        generation_config: GenerationConfig,
        placement: Placement,
        dynspec_config: DynSpecConfig | None = None,
    ) -> None:
        self.draft_model = draft_model
        self.logits_processor = logits_processor
        self.do_sample = bool(generation_config.do_sample)
        self.placement = placement
        self.config = dynspec_config or DynSpecConfig()
        self.pad_id = 0
        self.ragged: RaggedCache | None = None
        self.num_seen: torch.LongTensor | None = None  # [batch] real tokens in the draft cache
        self.forwards = 0
        self._fed_nodes: torch.LongTensor | None = None  # [batch, fed] tree node of each draft-cache column fed
        self._num_assistant_tokens = self.config.num_speculative_tokens

    # ---- batched interface ---------------------------------------------------------------------------------------
    def start(self, batch: TokenBatch) -> None:
        self.forwards = 0
        self.pad_id = batch.pad_id
        cache = DynamicCache(config=self.draft_model.config)
        check_cache_supported(cache, "draft model")
        empty = torch.zeros((batch.batch_size, 0), dtype=torch.long, device=batch.tokens.device)
        self.ragged = RaggedCache(cache, empty, self.config.compact_min_holes, self.config.compact_hole_fraction)
        self.num_seen = torch.zeros_like(batch.num_real)

    @property
    def model(self) -> PreTrainedModel:
        return self.draft_model

    def backlog(self, batch: TokenBatch) -> torch.LongTensor:
        """`[batch]` committed tokens of each row not yet in the draft's cache (the prompt, before the first draft)."""
        return batch.num_real - self.num_seen

    def propose(
        self,
        batch: TokenBatch,
        lengths: torch.LongTensor,
        early_stop: EarlyStop | None = None,
        free_rows: torch.BoolTensor | None = None,
        node_budgets: torch.LongTensor | None = None,
    ) -> Proposal:
        lengths = lengths.clone()
        ids, mask, positions = self._unseen_tail(batch)
        tokens, probs = [], []
        for position in range(int(lengths.max())):
            scores = self._forward(ids, mask, positions)  # [batch, vocab]
            drafts = torch.stack(tokens, dim=1) if tokens else ids.new_zeros((batch.batch_size, 0))
            scores = process_logits(self.logits_processor, batch, drafts, scores.unsqueeze(1), position).squeeze(1)
            token, token_probs = self._select(scores)
            tokens.append(token)
            probs.append(token_probs)
            if early_stop is not None:
                lengths = self._apply_early_stop(early_stop, position, token, token_probs, scores, lengths)
            if position + 1 >= int(lengths.max()):
                break
            ids, mask = token.unsqueeze(1), torch.ones_like(token).unsqueeze(1)
            positions = (batch.num_real + position).unsqueeze(1)
        fed = torch.arange(1, len(tokens), device=lengths.device)  # every draft token but the last: nodes 1 .. k - 1
        self._fed_nodes = fed.unsqueeze(0).expand(batch.batch_size, -1)
        return self._proposal(tokens, probs, lengths, batch)

    def commit(self, batch: TokenBatch, proposal: Proposal, kept: torch.BoolTensor) -> None:
        """Draft-cache columns of accepted nodes stay, the other fed nodes become holes; the tail is now seen."""
        if proposal.max_length == 0:
            return
        fed = self._fed_nodes  # [batch, fed] node index per column after the tail, -1 for columns of no node
        # Nodes beyond `kept` only occur on a tensor-parallel rank whose own (sampled) tree was replaced by rank 0's.
        in_tree = (fed >= 0) & (fed < kept.shape[1])
        kept_fed = kept.to(fed.device).gather(1, fed.clamp(0, kept.shape[1] - 1)) & in_tree  # [batch, fed]
        self.ragged.set_last(kept_fed.long())
        self.num_seen = self.num_seen + self._tail_lengths + kept_fed.sum(dim=1)
        self.ragged.settle()

    def select_rows(self, keep: torch.LongTensor) -> None:
        self.ragged.select_rows(keep)
        self.num_seen = self.num_seen[keep]

    def release(self) -> None:
        self.ragged = None
        self.num_seen = None

    # ---- helpers ---------------------------------------------------------------------------------------------------
    def _unseen_tail(self, batch: TokenBatch) -> tuple[torch.LongTensor, torch.LongTensor, torch.LongTensor]:
        """Ids, mask and positions (`[batch, width]`) of the committed tokens the draft has not seen, to feed in the
        first draft forward; a wide backlog is caught up first (`_catch_up_backlog`)."""
        ids, mask, positions = batch.tail(self.num_seen)  # [batch, tail]
        self._tail_lengths = batch.num_real - self.num_seen  # [batch] committed tokens fed before drafting
        return self._catch_up_backlog(ids, mask, positions)

    def _catch_up_backlog(
        self, ids: torch.LongTensor, mask: torch.LongTensor, positions: torch.LongTensor
    ) -> tuple[torch.LongTensor, torch.LongTensor, torch.LongTensor]:
        """Feed all but the newest column of a tail wider than `MAX_INLINE_TAIL` in a timed forward of its own."""
        self.catchup_seconds, self.catchup_tokens = 0.0, 0
        if ids.shape[1] <= MAX_INLINE_TAIL:
            return ids, mask, positions
        start = self.placement.clock()
        self._forward(ids[:, :-1], mask[:, :-1], positions[:, :-1])
        self.catchup_seconds, self.catchup_tokens = self.placement.clock() - start, ids[:, :-1].numel()
        return ids[:, -1:], mask[:, -1:], positions[:, -1:]

    def _forward(self, ids: torch.LongTensor, mask: torch.LongTensor, positions: torch.LongTensor) -> torch.Tensor:
        """One draft forward over `[batch, width]` new tokens; returns float32 logits `[batch, vocab]` of the last."""
        self.forwards += 1
        return self.placement.forward(self.draft_model, self.ragged, ids, mask, positions, 1)[:, -1]

    def _select(self, scores: torch.Tensor) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """Pick the draft token from processed scores `[batch, vocab]`; also return q when sampling."""
        if not self.do_sample:
            return scores.argmax(dim=-1), None
        probs = scores.softmax(dim=-1)
        return torch.multinomial(probs, 1).squeeze(1), probs

    @staticmethod
    def _apply_early_stop(
        early_stop: EarlyStop,
        position: int,
        token: torch.LongTensor,
        token_probs: torch.Tensor | None,
        scores: torch.Tensor,
        lengths: torch.LongTensor,
    ) -> torch.LongTensor:
        probs = token_probs if token_probs is not None else scores.softmax(dim=-1)
        confidence = probs.gather(1, token.unsqueeze(1)).squeeze(1)  # [batch]
        keep_going = early_stop(position, confidence)
        if keep_going is None:
            return lengths
        stop = ~keep_going.to(lengths.device) & (lengths > position + 1)
        return torch.where(stop, torch.full_like(lengths, position + 1), lengths)

    def _proposal(self, tokens: list, probs: list, lengths: torch.LongTensor, batch: TokenBatch) -> Proposal:
        if not tokens:
            empty = batch.tokens.new_zeros((batch.batch_size, 0))
            return Proposal(empty, torch.zeros_like(lengths), None)
        stacked_probs = torch.stack(probs, dim=1) if self.do_sample else None  # [batch, k, vocab]
        return Proposal(torch.stack(tokens, dim=1), lengths.clamp(max=len(tokens)), stacked_probs)

    # ---- transformers CandidateGenerator interface (batch size 1) -------------------------------------------------
    def get_candidates(self, input_ids: torch.LongTensor, **kwargs) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """Transformers' assisted loop: `input_ids` `(1, length)` -> candidates `(1, length + k)` and their logits."""
        if input_ids.shape[0] != 1:
            raise ValueError("Inside transformers' assisted loop the draft-model proposer supports batch size 1 only.")
        batch = TokenBatch(
            tokens=input_ids,
            prompt_width=input_ids.shape[1],
            num_prompt=torch.tensor([input_ids.shape[1]], device=input_ids.device),
            num_generated=torch.zeros(1, dtype=torch.long, device=input_ids.device),
            pad_id=self.pad_id,
        )
        self._catch_up(batch)
        lengths = torch.full((1,), self._num_assistant_tokens, dtype=torch.long, device=input_ids.device)
        proposal = self.propose(batch, lengths)
        self._pending = (input_ids, proposal)
        k = int(proposal.lengths[0])
        candidates = torch.cat([input_ids, proposal.tokens[:, :k]], dim=1)
        logits = None if proposal.probs is None else proposal.probs[:, :k].log()
        return candidates, logits

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int) -> None:
        """Nothing to learn here: draft lengths are the policy's job, and the cache catches up on the next call."""

    def _catch_up(self, batch: TokenBatch) -> None:
        """Commit the previous proposal against what transformers' loop kept, or start afresh for a new sequence."""
        pending = getattr(self, "_pending", None)
        current = batch.tokens[0]
        if self.ragged is None or pending is None:
            self.start(batch)
            return
        previous, proposal = pending
        if current.shape[0] <= previous.shape[1] or not bool((current[: previous.shape[1]] == previous[0]).all()):
            self.start(batch)
            return
        new_tokens = current[previous.shape[1] :]
        k = min(int(proposal.lengths[0]), new_tokens.shape[0])
        matches = (new_tokens[:k] == proposal.tokens[0, :k]).long().cumprod(0).sum()
        kept = torch.arange(proposal.max_length + 1, device=current.device) <= matches  # [1 + k] root and accepted
        self.commit(batch, proposal, kept.unsqueeze(0))
