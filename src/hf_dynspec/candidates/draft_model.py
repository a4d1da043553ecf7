"""A draft model proposes tokens autoregressively from its own KV cache."""

from __future__ import annotations

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel
from transformers.generation.candidate_generator import CandidateGenerator

from ..cache import RaggedCache, check_cache_supported, loop_cache
from ..config import DynSpecConfig
from ..coupling import perturb
from ..kernels import LinearPlan
from ..placement import Placement
from ..processors import process_path_logits
from ..sequences import TokenBatch
from .base import BatchedProposer, EarlyStop, Proposal
from .draft_head import DraftHead
from .prompt_lookup import PromptLookupProposer, lookup_continuation

MAX_INLINE_TAIL = 2
"""Backlogs up to this width (the newest token, plus the last draft token after a bonus) ride in the first draft
forward; wider ones are caught up in a forward of their own."""


def draft_lookahead_tokens(
    draft_model: PreTrainedModel, config: DynSpecConfig, narrow: int | LinearPlan = 0, base: int = 1
) -> int:
    """Guess tokens a draft forward over `base` other tokens (a chain's newest token, a tree's frontier) may carry:
    `config.draft_lookahead`, cut to what stays within `config.draft_lookahead_max_cost` times the forward without
    them (`calibration.affordable_lookahead`: timed on the first call of a process for this model, setting and
    `base`, cached after). `narrow`: how its linear layers are computed (`Placement.linear_plans`; an int:
    weight-first up to that many rows)."""
    most, max_cost = config.draft_lookahead, config.draft_lookahead_max_cost
    if most == 0 or max_cost is None:
        return most
    from ..calibration import affordable_lookahead  # calibration imports the policies, which import this module

    return affordable_lookahead(draft_model, most, max_cost, narrow, base=base)


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
        eos = generation_config.eos_token_id
        self.eos_ids: list[int] = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self.head: DraftHead | None = None  # the draft's output layer over part of the vocabulary, per call
        self.pad_id = 0
        self.ragged: RaggedCache | None = None
        self.num_seen: torch.LongTensor | None = None  # [batch] real tokens in the draft cache
        self.forwards = 0
        self.lookahead: int | None = None  # guess tokens a forward may carry, once drafting starts
        self._fed_nodes: torch.LongTensor | None = None  # [batch, fed] tree node of each draft-cache column fed
        self.streams: torch.LongTensor | None = None  # [rows] coupled sampling's stream per original row (`couple`)
        self._num_assistant_tokens = self.config.num_speculative_tokens

    # ---- batched interface ---------------------------------------------------------------------------------------
    def start(self, batch: TokenBatch) -> None:
        self.forwards = 0
        self.pad_id = batch.pad_id
        cache = loop_cache(self.draft_model, self.placement.windows.get(id(self.draft_model)))
        check_cache_supported(cache, "draft model")
        empty = torch.zeros((batch.batch_size, 0), dtype=torch.long, device=batch.tokens.device)
        self.ragged = RaggedCache(cache, empty, self.config.compact_min_holes, self.config.compact_hole_fraction)
        self.num_seen = torch.zeros_like(batch.num_real)
        prompts = batch.tokens[:, : batch.prompt_width]  # [batch, prompt_width]
        self.head = DraftHead.for_batch(self.draft_model, self.config.draft_vocab_size, prompts, self.eos_ids)

    @property
    def model(self) -> PreTrainedModel:
        return self.draft_model

    def couple(self, streams: torch.LongTensor) -> None:
        """Draw every draft token as the perturbed argmax of the processed draft scores (a fixed proposal)."""
        self.streams = streams
        self.do_sample = False

    def perturbed(
        self, scores: torch.Tensor, batch: TokenBatch, rows: torch.LongTensor, drawn: torch.LongTensor
    ) -> torch.Tensor:
        """Processed draft scores (`[rows, ..., vocab]`) plus, under coupled sampling, the noise the target samples
        with at the same positions: row `rows[i]` of `batch` after `drawn` draft tokens (`[rows, ...]`) samples its
        response position `num_generated + drawn`. Unchanged otherwise."""
        if self.streams is None:
            return scores
        shape = (-1,) + (1,) * (drawn.dim() - 1)
        positions = batch.num_generated[rows].view(shape) + drawn  # [rows, ...]
        streams = self.streams.to(rows.device)[batch.row_ids[rows]].view(shape).expand_as(positions)
        return perturb(scores, streams, positions)

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
        """Each row's draft chain, `lengths[b]` tokens (fewer where `early_stop` ends it).

        With `DynSpecConfig.draft_lookahead`, a forward also feeds, after each row's newest token, a prompt-lookup
        guess of the draft's next tokens (`_guesses`); as far as the draft's own choices match the guess, one forward
        yields several draft tokens. The chain is the one drafting token by token would give (greedy: the same tokens;
        sampling: the same draws from the same `q`); only forwards are saved. Tokens a forward yields this way may
        run past the row's length, up to `prompt_lookup_max_tokens` (`_reach`): they cost no forward, only verify
        width. An early stop judges every token as it is drawn, and a row it stops draws nothing more.
        """
        lengths = lengths.clone()
        begun = self.placement.clock()
        lookahead = self.lookahead = self.lookahead_tokens()  # measured on the first call of a process
        self.setup_seconds = self.placement.clock() - begun
        ids, mask, positions = self._unseen_tail(batch)  # [batch, tail]
        reach = self._reach(batch, lengths, lookahead).clone()  # [batch] (cut in place by an early stop)
        chain = _Chain(batch.batch_size, int(reach.max()) if reach.numel() else 0, lengths.device)
        fed: list[torch.LongTensor] = []  # per forward: [batch, columns] node of each column after the tail, or -1
        while bool((chain.done < lengths).any()):
            guesses, guessed = self._guesses(batch, chain, lengths, reach, lookahead)  # [batch, g]
            offsets = torch.arange(1, guesses.shape[1] + 1, device=positions.device)
            scores = self._forward(
                torch.cat([ids, guesses], 1), torch.cat([mask, guessed], 1),
                torch.cat([positions, positions[:, -1:] + offsets], 1), keep=1 + guesses.shape[1],
            )  # [batch, 1 + g, vocab]
            before = chain.done.clone()
            lengths, reach = self._walk(batch, chain, scores, (guesses, guessed), lengths, reach, early_stop)
            matched = torch.arange(guesses.shape[1], device=lengths.device) < (chain.done - before - 1).unsqueeze(1)
            self.ragged.set_last(guessed * matched)  # guesses past a row's first mismatch become holes now
            nodes = torch.where(guessed.bool() & matched, before.unsqueeze(1) + offsets, -1)  # [batch, g]
            anchors = torch.where(mask[:, -1:].bool(), before.unsqueeze(1), -1)  # the newest draft token fed
            fed.append(nodes if not fed else torch.cat([anchors, nodes], 1))
            ids, mask, positions = chain.anchors(batch, lengths)
            chain.forwards += 1
        self._fed_nodes = torch.cat(fed, 1) if fed else lengths.new_zeros((batch.batch_size, 0))
        return chain.proposal()

    def lookahead_tokens(self, base: int = 1) -> int:
        """Guess tokens a draft forward over `base` other tokens may carry (`draft_lookahead_tokens`, measured once
        per process)."""
        plan = self.placement.linear_plans.get(id(self.draft_model), LinearPlan())
        return draft_lookahead_tokens(self.draft_model, self.config, plan, base)

    def _reach(self, batch: TokenBatch, lengths: torch.LongTensor, lookahead: int) -> torch.LongTensor:
        """`[batch]` most draft tokens each row may end with: its length, or with lookahead up to
        `prompt_lookup_max_tokens` (never past the row's remaining budget) for rows that draft at all."""
        if not lookahead:
            return lengths
        room = (batch.remaining.to(lengths.device) - 1).clamp(min=0, max=self.config.prompt_lookup_max_tokens)
        return torch.where(lengths > 0, lengths.maximum(room), lengths)

    def _guesses(
        self, batch: TokenBatch, chain: _Chain, lengths: torch.LongTensor, reach: torch.LongTensor, lookahead: int
    ) -> tuple[torch.LongTensor, torch.LongTensor]:
        """`[batch, g]` prompt-lookup guesses of each row's next draft tokens (all but its last, which is never fed)
        and their mask; width 0 without lookahead."""
        wanted = torch.where(chain.done < lengths, reach - chain.done - 1, 0).clamp(min=0)  # [batch]
        drafted = [chain.tokens[row, : int(chain.done[row])] for row in range(batch.batch_size)]
        return self._lookups(batch, drafted, wanted, lookahead)

    def _lookups(
        self, batch: TokenBatch, drafted: list[torch.LongTensor], wanted: torch.LongTensor, lookahead: int
    ) -> tuple[torch.LongTensor, torch.LongTensor]:
        """`[batch, g]` prompt-lookup continuations of each row's tokens followed by its `drafted` ones, at most
        `wanted[b]` long, and their mask.

        A forward is saved only when every drafting row's guess holds, while each guess widens the forward, so the
        `lookahead` guess tokens of a forward are shared among the rows that want them: all to one row at batch
        size 1 (where a wider forward costs little), none when more rows draft than there are guess tokens."""
        share = lookahead // max(1, int((wanted > 0).sum()))
        if share == 0:
            return batch.tokens.new_zeros((batch.batch_size, 0)), batch.tokens.new_zeros((batch.batch_size, 0))
        wanted = wanted.clamp(max=share)
        found = [
            lookup_continuation(
                torch.cat([batch.real_tokens(row), drafted[row].to(batch.tokens.device)]),
                self.config.prompt_lookup_max_ngram, self.config.prompt_lookup_min_ngram, int(wanted[row]),
            )
            if int(wanted[row]) > 0 else batch.tokens.new_zeros(0)
            for row in range(batch.batch_size)
        ]
        padded = PromptLookupProposer.proposal(batch, found)  # [batch, g] tokens and each row's count
        guessed = torch.arange(padded.max_length, device=padded.lengths.device) < padded.lengths.unsqueeze(1)
        return padded.tokens, guessed.long()

    def _walk(
        self,
        batch: TokenBatch,
        chain: _Chain,
        scores: torch.Tensor,
        guess: tuple[torch.LongTensor, torch.LongTensor],
        lengths: torch.LongTensor,
        reach: torch.LongTensor,
        early_stop: EarlyStop | None,
    ) -> tuple[torch.LongTensor, torch.LongTensor]:
        """Draw draft tokens from one forward's `scores` (`[batch, 1 + g, vocab]`): position 0 follows each row's newest
        token, position `j` follows guess `j - 1` (`guess`: tokens and mask, `[batch, g]`), valid while every earlier
        guess matched the draw. Returns `lengths` and `reach`, both cut to the tokens drawn where `early_stop` ends a
        row."""
        guesses, guessed = guess
        walking = torch.ones_like(chain.done, dtype=torch.bool)  # [batch] every guess so far matched
        for j in range(scores.shape[1]):
            if j == 0:
                active = walking & (chain.done < lengths)
            else:  # guesses exist only within each row's reach
                active = walking & (chain.done < reach) & guessed[:, j - 1].bool()
            if not bool(active.any()):
                break
            rows = active.nonzero().squeeze(1)
            processed = process_path_logits(
                self.logits_processor, batch, rows, chain.tokens[rows], chain.done[rows], scores[rows, j]
            )  # [rows, vocab]
            token, token_probs = self._select(self.perturbed(processed, batch, rows, chain.done[rows]))
            if early_stop is not None:
                stopped = self._early_stopped(early_stop, rows, chain.done[rows], token, token_probs, processed)
                drawn = chain.done[rows] + 1  # [rows] tokens of each row once this one is appended
                lengths[rows] = torch.where(stopped, drawn.minimum(lengths[rows]), lengths[rows])
                reach[rows] = torch.where(stopped, drawn, reach[rows])
            chain.append(active, token, token_probs)
            if j < guesses.shape[1]:
                walking = active & (chain.last() == guesses[:, j])
        return lengths, reach

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
        self.head = None

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

    def _forward(
        self, ids: torch.LongTensor, mask: torch.LongTensor, positions: torch.LongTensor, keep: int = 1
    ) -> torch.Tensor:
        """One draft forward over `[batch, width]` new tokens; returns float32 logits `[batch, keep, vocab]` of the
        last `keep`."""
        self.forwards += 1
        return self.placement.forward(self.draft_model, self.ragged, ids, mask, positions, keep, head=self.head)

    def _select(self, scores: torch.Tensor) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """Pick the draft token from processed scores `[batch, vocab]`; also return q when sampling."""
        if not self.do_sample:
            return scores.argmax(dim=-1), None
        probs = scores.softmax(dim=-1)
        return torch.multinomial(probs, 1).squeeze(1), probs

    @staticmethod
    def _early_stopped(
        early_stop: EarlyStop,
        rows: torch.LongTensor,
        positions: torch.LongTensor,
        token: torch.LongTensor,
        token_probs: torch.Tensor | None,
        scores: torch.Tensor,
    ) -> torch.BoolTensor:
        """`[rows]` True where `early_stop` ends the row's draft after the token it just drew (`token`, `[rows]`, at
        `positions`, from the processed `scores` `[rows, vocab]`)."""
        probs = token_probs if token_probs is not None else scores.softmax(dim=-1)
        confidence = probs.gather(1, token.unsqueeze(1)).squeeze(1)  # [rows]
        keep_going = early_stop(rows, positions, confidence)
        if keep_going is None:
            return torch.zeros_like(rows, dtype=torch.bool)
        return ~keep_going.to(rows.device)

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

    @property
    def num_drafting_tokens(self) -> int:
        """Draft tokens per step in transformers' loop (transformers >= 5.25 sizes its cache's past recording by it)."""
        return self._num_assistant_tokens

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


class _Chain:
    """The draft tokens of one `propose`: `tokens` `[batch, longest]`, `done` `[batch]` drawn so far per row, and
    `probs` `[batch, longest, vocab]` (the `q` of each draw, when sampling)."""

    def __init__(self, num_rows: int, longest: int, device: torch.device) -> None:
        self.tokens = torch.zeros((num_rows, longest), dtype=torch.long, device=device)
        self.done = torch.zeros(num_rows, dtype=torch.long, device=device)
        self.probs: torch.Tensor | None = None
        self.forwards = 0  # draft forwards of this proposal so far

    def append(self, rows: torch.BoolTensor, token: torch.LongTensor, probs: torch.Tensor | None) -> None:
        """Write one token (`[active]`, with its `q` `[active, vocab]`) after the tokens of each row in `rows`."""
        index = rows.nonzero().squeeze(1)
        self.tokens[index, self.done[index]] = token
        if probs is not None:
            if self.probs is None:
                self.probs = probs.new_zeros((*self.tokens.shape, probs.shape[-1]))
            self.probs[index, self.done[index]] = probs
        self.done = self.done + rows.long()

    def last(self) -> torch.LongTensor:
        """`[batch]` each row's newest draft token (0 for rows without one)."""
        return self.tokens.gather(1, (self.done - 1).clamp(min=0).unsqueeze(1)).squeeze(1)

    def anchors(
        self, batch: TokenBatch, lengths: torch.LongTensor
    ) -> tuple[torch.LongTensor, torch.LongTensor, torch.LongTensor]:
        """Ids, mask and positions (`[batch, 1]`) of each row's newest draft token, to feed next; masked for rows
        that have drawn all their tokens."""
        drafting = (self.done < lengths) & (self.done > 0)
        positions = (batch.num_real + self.done - 1).unsqueeze(1)
        return self.last().unsqueeze(1), drafting.long().unsqueeze(1), positions

    def proposal(self) -> Proposal:
        width = int(self.done.max()) if self.done.numel() else 0
        probs = self.probs[:, :width] if self.probs is not None else None
        return Proposal(self.tokens[:, :width], self.done.clone(), probs)
