"""A draft model proposes tokens autoregressively from its own KV cache."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel
from transformers.generation.candidate_generator import CandidateGenerator

from ..cache import RaggedCache, check_cache_supported, loop_cache
from ..config import DynSpecConfig
from ..coupling import batch_keys, perturb
from ..devices import upload
from ..kernels import LinearPlan
from ..placement import Placement
from ..processors import process_path_logits, row_wise
from ..sequences import TokenBatch
from .base import BatchedProposer, EarlyStop, Proposal
from .draft_head import DraftHead
from .free import padded
from .prompt_lookup import lookup_continuation

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
        self.host_num_seen: torch.LongTensor | None = None  # [batch] the same on the host
        self.forwards = 0
        self.lookahead: int | None = None  # guess tokens a forward may carry, once drafting starts
        self._fed_nodes: torch.LongTensor | None = None  # [batch, fed] tree node of each draft-cache column fed
        self.streams: torch.LongTensor | None = None  # [rows] coupled sampling's stream per original row (`couple`)
        self.keying = "context"  # coupled sampling's keys (`DynSpecConfig.coupling_keys`)
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
        self.host_num_seen = torch.zeros_like(batch.host_num_real)
        prompts = batch.tokens[:, : batch.prompt_width]  # [batch, prompt_width]
        self.head = DraftHead.for_batch(self.draft_model, self.config.draft_vocab_size, prompts, self.eos_ids)

    @property
    def model(self) -> PreTrainedModel:
        return self.draft_model

    def couple(self, streams: torch.LongTensor, keying: str = "context") -> None:
        """Draw every draft token as the perturbed argmax of the processed draft scores (a fixed proposal)."""
        self.streams, self.keying = streams, keying
        self.do_sample = False

    def perturbed(
        self,
        scores: torch.Tensor,  # [rows, ..., vocab]
        batch: TokenBatch,
        rows: torch.LongTensor,  # [rows]
        path: torch.LongTensor,  # [rows, ..., depth] draft tokens before each item's token
        drawn: torch.LongTensor,  # [rows, ...] how many of them precede it
    ) -> torch.Tensor:
        """Processed draft scores plus, under coupled sampling, the noise the target samples with at the same place:
        row `rows[i]` of `batch` after `drawn` tokens of its `path` (`coupling.batch_keys`). Unchanged otherwise."""
        if self.streams is None:
            return scores
        keys = batch_keys(batch, rows, path, drawn, self.keying)  # [rows, ...]
        streams = self.streams.to(rows.device)[batch.row_ids[rows]]
        return perturb(scores, streams.view((-1,) + (1,) * (drawn.dim() - 1)).expand_as(keys), keys)

    def backlog(self, batch: TokenBatch) -> torch.LongTensor:
        """`[batch]` committed tokens of each row not yet in the draft's cache (the prompt, before the first draft), on
        the host."""
        return batch.host_num_real - self.host_num_seen

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

        What it takes (`lengths`, on the host) and keeps per row (tokens drawn, draft-cache columns) is also on the
        host, so drafting reads the device only where the draft decided something the host must know: whether a
        guess held (with lookahead, once per guess position walked), the tokens just drawn (when the next forward's
        guesses continue them) and the draft's probabilities (for an early stop).
        """
        lengths = lengths.to("cpu", copy=True)
        begun = self.placement.instant()
        lookahead = self.lookahead = self.lookahead_tokens()  # measured on the first call of a process
        self.setup_seconds = self.placement.since(begun)
        ids, mask, positions, host_mask = self._unseen_tail(batch)  # [batch, tail]
        reach = self._reach(batch, lengths, lookahead).clone()  # [batch] (cut in place by an early stop)
        chain = _Chain(batch.batch_size, int(reach.max()) if reach.numel() else 0, batch.tokens.device)
        fed: list[torch.LongTensor] = []  # per forward: [batch, columns] node of each column after the tail, or -1
        while bool((chain.host_done < lengths).any()):
            guesses, guessed, host_guess = self._guesses(batch, chain, lengths, reach, lookahead)  # [batch, g]
            scores = self._feed(ids, mask, positions, host_mask, (guesses, guessed, host_guess[1]))  # [b, 1 + g, v]
            before = chain.host_done.clone()
            lengths, reach = self._walk(batch, chain, scores, (guesses, host_guess), lengths, reach, early_stop)
            nodes = self._settle_guesses(chain, before, host_guess[1])  # [batch, g]
            anchors = torch.where(host_mask[:, -1:].bool(), before.unsqueeze(1), -1)  # the newest draft token fed
            fed.append(nodes if not fed else torch.cat([anchors, nodes], 1) if nodes.shape[1] else anchors)
            ids, mask, positions, host_mask = chain.anchors(batch, lengths)
            chain.forwards += 1
        self._fed_nodes = torch.cat(fed, 1) if fed else lengths.new_zeros((batch.batch_size, 0))
        return chain.proposal()

    def _feed(
        self,
        ids: torch.LongTensor,
        mask: torch.LongTensor,
        positions: torch.LongTensor,
        host_mask: torch.LongTensor,
        guess: tuple[torch.LongTensor, torch.LongTensor, torch.LongTensor],
    ) -> torch.Tensor:
        """One draft forward over each row's newest tokens (`[batch, t]` ids, mask, positions and the mask on the
        host) followed by its guesses (`guess`: tokens and mask on the device, the mask on the host, `[batch, g]`);
        returns the logits after the newest token and after each guess, `[batch, 1 + g, vocab]`."""
        guesses, guessed, host_guessed = guess
        width = guesses.shape[1]
        if width:  # without guesses (no lookahead) the block is the newest tokens alone
            offsets = torch.arange(1, width + 1, device=positions.device)
            ids, mask = torch.cat([ids, guesses], 1), torch.cat([mask, guessed], 1)
            positions = torch.cat([positions, positions[:, -1:] + offsets], 1)
            host_mask = torch.cat([host_mask, host_guessed], 1)
        return self._forward(ids, mask, positions, keep=1 + width, host_mask=host_mask)

    def _settle_guesses(
        self, chain: _Chain, before: torch.LongTensor, host_guessed: torch.LongTensor
    ) -> torch.LongTensor:
        """After a forward that fed guesses (`host_guessed` `[batch, g]` their mask, on the host), and drew from them
        the chain's tokens past `before` (`[batch]` tokens each row had): the guesses past a row's first mismatch
        become holes in the draft cache. Returns the tree node of each guess column, -1 for holes (`[batch, g]`)."""
        width = host_guessed.shape[1]
        if not width:
            return host_guessed
        matched = torch.arange(width) < (chain.host_done - before - 1).unsqueeze(1)  # [batch, g]
        valid = host_guessed * matched
        self.ragged.set_last(upload(valid, self.num_seen.device), valid)
        return torch.where(valid.bool(), before.unsqueeze(1) + torch.arange(1, width + 1), -1)

    def inline_tail(self) -> int:
        """Backlogs up to this width ride in the first draft forward (`MAX_INLINE_TAIL`)."""
        return MAX_INLINE_TAIL

    def lookahead_tokens(self, base: int = 1) -> int:
        """Guess tokens a draft forward over `base` other tokens may carry (`draft_lookahead_tokens`, measured once
        per process)."""
        plan = self.placement.linear_plans.get(id(self.draft_model), LinearPlan())
        return draft_lookahead_tokens(self.draft_model, self.config, plan, base)

    def _reach(self, batch: TokenBatch, lengths: torch.LongTensor, lookahead: int) -> torch.LongTensor:
        """`[batch]` most draft tokens each row may end with (on the host): its length, or with lookahead up to
        `prompt_lookup_max_tokens` (never past the row's remaining budget) for rows that draft at all."""
        if not lookahead:
            return lengths
        room = (batch.host_remaining - 1).clamp(min=0, max=self.config.prompt_lookup_max_tokens)
        return torch.where(lengths > 0, lengths.maximum(room), lengths)

    def _guesses(
        self, batch: TokenBatch, chain: _Chain, lengths: torch.LongTensor, reach: torch.LongTensor, lookahead: int
    ) -> tuple[torch.LongTensor, torch.LongTensor, tuple[torch.LongTensor, torch.LongTensor]]:
        """`[batch, g]` prompt-lookup guesses of each row's next draft tokens (all but its last, which is never fed)
        and their mask, on the device and on the host (`_lookups`); width 0 without lookahead."""
        if not lookahead:
            return _no_guesses(batch)
        wanted = torch.where(chain.host_done < lengths, reach - chain.host_done - 1, 0).clamp(min=0)  # [batch]

        def drafted() -> list[torch.LongTensor]:
            tokens = chain.host_tokens()
            return [tokens[row, : int(chain.host_done[row])] for row in range(batch.batch_size)]

        return self._lookups(batch, drafted, wanted, lookahead)

    def _lookups(
        self,
        batch: TokenBatch,
        drafted: list[torch.LongTensor] | Callable[[], list[torch.LongTensor]],
        wanted: torch.LongTensor,
        lookahead: int,
    ) -> tuple[torch.LongTensor, torch.LongTensor, tuple[torch.LongTensor, torch.LongTensor]]:
        """`[batch, g]` prompt-lookup continuations of each row's tokens followed by its `drafted` ones (or a function
        that returns them, called only when some row looks up), at most `wanted[b]` (`[batch]`, on the host) long,
        and their mask; both on the device, then both on the host.

        A forward is saved only when every drafting row's guess holds, while each guess widens the forward, so the
        `lookahead` guess tokens of a forward are shared among the rows that want them: all to one row at batch
        size 1 (where a wider forward costs little), none when more rows draft than there are guess tokens."""
        share = lookahead // max(1, int((wanted > 0).sum()))
        if share == 0:
            return _no_guesses(batch)
        wanted = wanted.clamp(max=share)
        drafted = drafted() if callable(drafted) else drafted
        found = [
            lookup_continuation(
                torch.cat([batch.host_real_tokens(row), drafted[row].to("cpu", copy=True)]),
                self.config.prompt_lookup_max_ngram, self.config.prompt_lookup_min_ngram, int(wanted[row]),
            )
            if int(wanted[row]) > 0 else torch.zeros(0, dtype=torch.long)
            for row in range(batch.batch_size)
        ]
        tokens, counts = padded(found, batch.batch_size, batch.pad_id)  # [batch, g] tokens and each row's count
        guessed = (torch.arange(tokens.shape[1]) < counts.unsqueeze(1)).long()
        device = batch.tokens.device
        return upload(tokens, device), upload(guessed, device), (tokens, guessed)

    def _walk(
        self,
        batch: TokenBatch,
        chain: _Chain,
        scores: torch.Tensor,
        guess: tuple[torch.LongTensor, tuple[torch.LongTensor, torch.LongTensor]],
        lengths: torch.LongTensor,
        reach: torch.LongTensor,
        early_stop: EarlyStop | None,
    ) -> tuple[torch.LongTensor, torch.LongTensor]:
        """Draw draft tokens from one forward's `scores` (`[batch, 1 + g, vocab]`): position 0 follows each row's newest
        token, position `j` follows guess `j - 1` (`guess`: tokens on the device, then tokens and mask on the host,
        `[batch, g]`), valid while every earlier guess matched the draw. Returns `lengths` and `reach` (on the host),
        both cut to the tokens drawn where `early_stop` ends a row."""
        if early_stop is None and not self.do_sample and row_wise(self.logits_processor) and guess[1][0].shape[1]:
            return self._walk_greedy(batch, chain, scores, guess, lengths, reach)
        _, (host_guesses, guessed) = guess
        walking = torch.ones_like(chain.host_done, dtype=torch.bool)  # [batch] every guess so far matched
        for j in range(scores.shape[1]):
            if j == 0:
                active = walking & (chain.host_done < lengths)
            else:  # guesses exist only within each row's reach
                active = walking & (chain.host_done < reach) & guessed[:, j - 1].bool()
            if not bool(active.any()):
                break
            host_rows = active.nonzero().squeeze(1)
            rows = upload(host_rows, scores.device)
            drawn = chain.done[rows]  # [rows] draft tokens each row has so far
            processed = process_path_logits(
                self.logits_processor, batch, rows, chain.tokens[rows], drawn, scores[rows, j]
            )  # [rows, vocab]
            token, token_probs = self._select(self.perturbed(processed, batch, rows, chain.tokens[rows], drawn))
            if early_stop is not None:
                done = chain.host_done[host_rows]
                stopped = self._early_stopped(early_stop, host_rows, done, token, token_probs, processed)
                lengths[host_rows] = torch.where(stopped, (done + 1).minimum(lengths[host_rows]), lengths[host_rows])
                reach[host_rows] = torch.where(stopped, done + 1, reach[host_rows])
            chain.append(active, rows, token, token_probs)
            if j < host_guesses.shape[1]:
                walking = active & (chain.host_last() == host_guesses[:, j])  # reads the tokens drawn
        return lengths, reach

    def _walk_greedy(
        self,
        batch: TokenBatch,
        chain: _Chain,
        scores: torch.Tensor,
        guess: tuple[torch.LongTensor, tuple[torch.LongTensor, torch.LongTensor]],
        lengths: torch.LongTensor,
        reach: torch.LongTensor,
    ) -> tuple[torch.LongTensor, torch.LongTensor]:
        """`_walk` for greedy drafting (no early stop, processors that work row by row) of a forward that fed
        guesses: every row's token at every position is drawn on the device and kept where the row still walks,
        which gives each row the tokens `_walk` would, and the forward's outcome is read once, at its end."""
        guesses, (_, guessed) = guess
        device = scores.device
        every = torch.arange(batch.batch_size, device=device)  # [batch]
        bounds = upload(torch.stack([lengths, reach]), device)  # [2, batch]
        fed = upload(guessed.bool(), device)  # [batch, g]
        walking = torch.ones(batch.batch_size, dtype=torch.bool, device=device)
        for j in range(scores.shape[1]):
            if j > 0 and not bool(guessed[:, j - 1].any()):
                break  # no row has a guess here
            if j == 0:
                active = walking & (chain.done < bounds[0])
            else:  # guesses exist only within each row's reach
                active = walking & (chain.done < bounds[1]) & fed[:, j - 1]
            processed = process_path_logits(self.logits_processor, batch, every, chain.tokens, chain.done, scores[:, j])
            token, _ = self._select(self.perturbed(processed, batch, every, chain.tokens, chain.done))  # [batch]
            chain.append_where(active, token)
            if j < guesses.shape[1]:
                walking = active & (token == guesses[:, j])
        chain.read()
        return lengths, reach

    def commit(self, batch: TokenBatch, proposal: Proposal, kept: torch.BoolTensor) -> None:
        """Draft-cache columns of accepted nodes stay, the other fed nodes become holes; the tail is now seen. `kept`
        (`[batch, nodes]`) is on the host, as the loop passes it."""
        if proposal.max_length == 0:
            return
        kept = kept.to("cpu", copy=True)
        fed = self._fed_nodes.to("cpu", copy=True)  # [batch, fed] node per column after the tail, -1 for columns of no node
        # Nodes beyond `kept` only occur on a tensor-parallel rank whose own (sampled) tree was replaced by rank 0's.
        in_tree = (fed >= 0) & (fed < kept.shape[1])
        kept_fed = (kept.gather(1, fed.clamp(0, kept.shape[1] - 1)) & in_tree).long()  # [batch, fed]
        device = self.num_seen.device
        self.ragged.set_last(upload(kept_fed, device), kept_fed)
        seen = self._tail_lengths + kept_fed.sum(dim=1)  # [batch]
        self.num_seen = self.num_seen + upload(seen, device)
        self.host_num_seen = self.host_num_seen + seen
        self.ragged.settle()

    def select_rows(self, keep: torch.LongTensor) -> None:
        """Keep the rows at indices `keep` (`[kept]`, on the host)."""
        host_keep = keep.to("cpu", copy=True)
        keep = upload(host_keep, self.num_seen.device)
        self.ragged.select_rows(keep, host_keep)
        self.num_seen = self.num_seen[keep]
        self.host_num_seen = self.host_num_seen[host_keep]

    def release(self) -> None:
        self.ragged = None
        self.num_seen = None
        self.host_num_seen = None
        self.head = None

    # ---- helpers ---------------------------------------------------------------------------------------------------
    def _unseen_tail(
        self, batch: TokenBatch
    ) -> tuple[torch.LongTensor, torch.LongTensor, torch.LongTensor, torch.LongTensor]:
        """Ids, mask and positions (`[batch, width]`) of the committed tokens the draft has not seen, to feed in the
        first draft forward, and the mask again on the host; a wide backlog is caught up first
        (`_catch_up_backlog`)."""
        tail = batch.host_num_real - self.host_num_seen  # [batch] committed tokens fed before drafting
        width = int(tail.max()) if tail.numel() else 0
        ids, mask, positions = batch.tail(self.num_seen, width)  # [batch, tail]
        self._tail_lengths = tail
        host_mask = (torch.arange(width) - width >= -tail.unsqueeze(1)).long()  # [batch, tail] as `batch.tail`'s
        return self._catch_up_backlog(ids, mask, positions, host_mask)

    def _catch_up_backlog(
        self, ids: torch.LongTensor, mask: torch.LongTensor, positions: torch.LongTensor, host_mask: torch.LongTensor
    ) -> tuple[torch.LongTensor, torch.LongTensor, torch.LongTensor, torch.LongTensor]:
        """Feed all but the newest column of a tail wider than `MAX_INLINE_TAIL` in a timed forward of its own."""
        self.catchup_seconds, self.catchup_tokens = 0.0, 0
        if ids.shape[1] <= self.inline_tail():
            return ids, mask, positions, host_mask
        start = self.placement.instant()
        self._forward(ids[:, :-1], mask[:, :-1], positions[:, :-1], host_mask=host_mask[:, :-1])
        self.catchup_seconds, self.catchup_tokens = self.placement.since(start), ids[:, :-1].numel()
        return ids[:, -1:], mask[:, -1:], positions[:, -1:], host_mask[:, -1:]

    def _forward(
        self,
        ids: torch.LongTensor,
        mask: torch.LongTensor,
        positions: torch.LongTensor,
        keep: int = 1,
        host_mask: torch.LongTensor | None = None,
    ) -> torch.Tensor:
        """One draft forward over `[batch, width]` new tokens (`host_mask`: `mask` on the host, if known); returns
        float32 logits `[batch, keep, vocab]` of the last `keep`."""
        self.forwards += 1
        return self.placement.forward(
            self.draft_model, self.ragged, ids, mask, positions, keep, head=self.head, host_mask=host_mask
        )

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
        return ~keep_going.to(rows.device)  # `rows` on the host: the answer too

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
        lengths = torch.full((1,), self._num_assistant_tokens, dtype=torch.long)  # on the host, as the loop passes it
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


def _no_guesses(
    batch: TokenBatch,
) -> tuple[torch.LongTensor, torch.LongTensor, tuple[torch.LongTensor, torch.LongTensor]]:
    """`_lookups`' answer when no row guesses: `[batch, 0]` tokens and mask, on the device and on the host."""
    empty = torch.zeros((batch.batch_size, 0), dtype=torch.long)
    return batch.tokens.new_zeros(empty.shape), batch.tokens.new_zeros(empty.shape), (empty, empty)


class _Chain:
    """The draft tokens of one `propose`: `tokens` `[batch, longest]`, `done` `[batch]` drawn so far per row (also on
    the host: `host_done`), and `probs` `[batch, longest, vocab]` (the `q` of each draw, when sampling)."""

    def __init__(self, num_rows: int, longest: int, device: torch.device) -> None:
        self.tokens = torch.zeros((num_rows, longest), dtype=torch.long, device=device)
        self.done = torch.zeros(num_rows, dtype=torch.long, device=device)
        self.host_done = torch.zeros(num_rows, dtype=torch.long)
        self.probs: torch.Tensor | None = None
        self.forwards = 0  # draft forwards of this proposal so far
        self._host_tokens: torch.LongTensor | None = None  # `tokens` on the host, once read

    def append(
        self, active: torch.BoolTensor, rows: torch.LongTensor, token: torch.LongTensor, probs: torch.Tensor | None
    ) -> None:
        """Write one token (`[n]`, with its `q` `[n, vocab]`) after the tokens of each row in `rows` (`[n]`, the rows
        the host mask `active` `[batch]` marks)."""
        self.tokens[rows, self.done[rows]] = token
        if probs is not None:
            if self.probs is None:
                self.probs = probs.new_zeros((*self.tokens.shape, probs.shape[-1]))
            self.probs[rows, self.done[rows]] = probs
        self.done = self.done.index_add(0, rows, torch.ones_like(rows))
        self.host_done = self.host_done + active.long()
        self._host_tokens = None

    def append_where(self, active: torch.BoolTensor, token: torch.LongTensor) -> None:
        """Write `token[b]` after the tokens of each row where `active` (`[batch]` each, on the device); the host's
        counts are stale until `read`."""
        index = self.done.clamp(max=self.tokens.shape[1] - 1).unsqueeze(1)  # [batch, 1]
        self.tokens.scatter_(1, index, torch.where(active.unsqueeze(1), token.unsqueeze(1), self.tokens.gather(1, index)))
        self.done = self.done + active.long()
        self._host_tokens = None

    def read(self) -> None:
        """`done` and `tokens` on the host, in one read of the device."""
        both = torch.cat([self.done.unsqueeze(1), self.tokens], dim=1).to("cpu", copy=True)  # [batch, 1 + longest]
        self.host_done, self._host_tokens = both[:, 0], both[:, 1:]

    def host_tokens(self) -> torch.LongTensor:
        """`tokens` on the host: a read of the device, unless nothing was drawn since the last one."""
        if self._host_tokens is None:
            drew = bool(self.host_done.any())
            self._host_tokens = self.tokens.to("cpu", copy=True) if drew else torch.zeros(self.tokens.shape, dtype=torch.long)
        return self._host_tokens

    def host_last(self) -> torch.LongTensor:
        """`[batch]` each row's newest draft token, on the host (0 for rows without one)."""
        return self.host_tokens().gather(1, (self.host_done - 1).clamp(min=0).unsqueeze(1)).squeeze(1)

    def last(self) -> torch.LongTensor:
        """`[batch]` each row's newest draft token (0 for rows without one)."""
        return self.tokens.gather(1, (self.done - 1).clamp(min=0).unsqueeze(1)).squeeze(1)

    def anchors(
        self, batch: TokenBatch, lengths: torch.LongTensor
    ) -> tuple[torch.LongTensor, torch.LongTensor, torch.LongTensor, torch.LongTensor]:
        """Ids, mask and positions (`[batch, 1]`) of each row's newest draft token, to feed next, and the mask on the
        host; masked for rows that have drawn all their tokens (`lengths`, on the host)."""
        drafting = ((self.host_done < lengths) & (self.host_done > 0)).long().unsqueeze(1)  # [batch, 1]
        positions = (batch.num_real + self.done - 1).unsqueeze(1)
        return self.last().unsqueeze(1), upload(drafting, self.tokens.device), positions, drafting

    def proposal(self) -> Proposal:
        width = int(self.host_done.max()) if self.host_done.numel() else 0
        probs = self.probs[:, :width] if self.probs is not None else None
        return Proposal(self.tokens[:, :width], self.done.clone(), probs, host_lengths=self.host_done.clone())
