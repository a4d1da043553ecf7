"""The batched speculative decoding loop, usable as `generate(..., custom_generate=speculative_loop)`.

Over 600 lines because `LoopRun` is the whole of one `generate` call, prefill to the last step, and reads top to bottom
in the order it runs (propose, verify, emit, stop rows, observe); what it calls lives elsewhere: the proposer's choice
(`candidates.choice`), the arguments `generate` hands it (`arguments`), verification, logits processing, placement.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessorList,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    StoppingCriteriaList,
)
from transformers.cache_utils import DynamicCache
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .arguments import applied_by_loop, recover_generate_arguments, resolve_config, translation_for
from .cache import RaggedCache, cached_prefix, check_cache_supported, generation_cache, loop_cache
from .candidates.base import Proposal
from .candidates.choice import LoopChoice, loop_proposer
from .candidates.free import ModelFreeProposer
from .candidates.hybrid import HybridProposer
from .candidates.prompt_lookup import PromptLookupProposer
from .candidates.rollout import RolloutSource
from .candidates.tree import TokenTree, prefix_visibility
from .clocks import Instant
from .config import DynSpecConfig
from .coupling import batch_keys, call_seed, coupled_choice, stream_keys
from .devices import upload
from .distributed import DecisionBroadcast
from .heads import head_for
from .packing import can_pack
from .placement import Placement
from .policies import DraftLengthPolicy, PolicyInput, PrefillFeedback, StepFeedback, learned_policy, parameter_ratio
from .processors import process_logits, process_tree_logits
from .readback import HostOutcome
from .sequences import EmittedScores, TokenBatch, widen
from .stats import DynSpecStats, StepRecord
from .stopping import LockstepCriteria, answers_row_by_row
from .validation import validate_inputs
from .verification import TreeVerification, verify_tree_greedy, verify_tree_sampling, verify_tree_tokens


@dataclass
class DynSpecOutput(GenerateDecoderOnlyOutput):
    """`generate` output with the loop's statistics (`return_dict_in_generate=True`).

    Its KV cache field (`cache`; `past_key_values` before transformers 5.24) is `None`: the loop's caches hold masked
    entries and are not meant for reuse.
    """

    dynspec_stats: DynSpecStats | None = None


INITIAL_CAPACITY = 256
"""Generated tokens per row the token buffers hold at first; they double as rows need more (up to `max_new_tokens`)."""


def speculative_loop(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    synced_gpus: bool = False,
    streamer=None,
    assistant_model: PreTrainedModel | None = None,
    dynspec_config: DynSpecConfig | dict | str | None = None,
    dynspec_policy: DraftLengthPolicy | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    assistant_tokenizer: PreTrainedTokenizerBase | None = None,
    **model_kwargs,
) -> DynSpecOutput | torch.LongTensor:
    """Batched speculative decoding; pass it to `generate` as `custom_generate`.

    `generate` prepares inputs, logits processors, stopping criteria and the cache, then calls this loop. Every row of
    the batch drafts its own number of tokens per step (chosen by the policy of `dynspec_config`) and accepts its own
    number; greedy output is token-identical to plain greedy `generate`, sampled output follows the target's
    distribution exactly.

    Args:
        model: the target model.
        input_ids: `[batch, prompt_width]` left-padded prompts.
        assistant_model: the draft model (or `None` with `prompt_lookup_num_tokens` set for prompt lookup).
        dynspec_config: a [`DynSpecConfig`], its dict form or a JSON path; defaults to the `dynspec` entry of the
            model's generation config, else `DynSpecConfig()`.
        dynspec_policy: a policy object to use instead of building one from the config (it keeps what it learned
            across calls).
        tokenizer: the target's tokenizer, needed with `assistant_tokenizer`.
        assistant_tokenizer: the draft's tokenizer, for a draft with another tokenizer (as in transformers' universal
            assisted decoding; chains only). transformers does not forward either tokenizer to a callable
            `custom_generate`: pass them to `hf_dynspec.generate` or to a model made with `enable`.
    """
    assistant_model, streamer = recover_generate_arguments(assistant_model, streamer)
    input_ids = input_ids.long()  # other integer dtypes would not mix with the loop's token buffers
    config = resolve_config(dynspec_config, generation_config)
    if assistant_model is None and config.draft_head is not None:
        assistant_model = head_for(model, config.draft_head)
    translation = translation_for(assistant_model, tokenizer, assistant_tokenizer, config)
    validate_inputs(
        model, assistant_model, input_ids, generation_config, logits_processor, model_kwargs, synced_gpus, streamer,
        same_vocabulary=translation is None, suffix=config.proposer == "suffix", rollouts=config.reuse_rollouts,
        coupled=config.sampling == "coupled",
    )
    run = LoopRun(
        model, assistant_model, input_ids, logits_processor, stopping_criteria, generation_config, config, translation,
        model_kwargs.get("attention_mask"),
    )
    run.policy = learned_policy(model, assistant_model, config, dynspec_policy)
    run.streamer = streamer
    return run.generate(model_kwargs)


class LoopRun:
    """State of one `generate` call; `generate` runs prefill then steps until every row has finished."""

    def __init__(
        self,
        model: PreTrainedModel,
        draft: PreTrainedModel | None,
        input_ids: torch.LongTensor,
        logits_processor: LogitsProcessorList,
        stopping_criteria: StoppingCriteriaList,
        generation_config: GenerationConfig,
        config: DynSpecConfig,
        translation: tuple | None = None,
        attention_mask: torch.LongTensor | None = None,
    ) -> None:
        self.model = model
        self.translation = translation  # (target tokenizer, draft tokenizer) for a draft with another tokenizer
        self.generation_config = generation_config
        self.config = config
        self.logits_processor = logits_processor
        extra_criteria = [c for c in stopping_criteria if not applied_by_loop(c, generation_config)]
        self.row_criteria = [c for c in extra_criteria if answers_row_by_row(c)]  # asked row by row, at once
        self.placement = Placement.of(input_ids.device, model, draft, config.narrow_linear, config.fold_attention)
        self.decisions = DecisionBroadcast.for_run(model, draft, self.placement)  # rank 0 decides when sharded
        self.do_sample = bool(generation_config.do_sample)
        eos = generation_config._eos_token_tensor
        self.eos = eos.reshape(-1).to(input_ids.device) if eos is not None else None
        pad = generation_config._pad_token_tensor
        self.pad_id = int(pad) if pad is not None else 0
        batch_criteria = [c for c in extra_criteria if not answers_row_by_row(c)]
        self.criteria = LockstepCriteria(batch_criteria, input_ids, self.pad_id) if batch_criteria else None
        # [rows] each row's stream of coupled sampling (`hf_dynspec.coupling`), also the rollout cache's key
        self.streams = self._streams(input_ids, attention_mask) if config.sampling == "coupled" else None
        self.coupled = self.do_sample and self.streams is not None
        choice = LoopChoice(
            model, draft, config, generation_config, logits_processor, self.placement, translation, self.streams,
            across_ranks=not self.decisions.enabled,
        )
        self.proposer = loop_proposer(choice)
        if self.coupled:
            self.proposer.couple(self.streams, config.coupling_keys)
        # verify forwards compute only the real tokens (not where the proposer reads the target's states per row)
        self.packs = config.packed_verify and can_pack(model) and not self.proposer.reads_target_states
        self.max_draft = self._max_draft_tokens()
        # offers priced as model-free (prompt lookup alone is sized as a draft: `PromptLookupProposer`)
        free = isinstance(self.proposer, (HybridProposer, ModelFreeProposer))
        free = free and not isinstance(self.proposer, PromptLookupProposer)
        self.max_free = self.config.prompt_lookup_max_tokens if free else self.max_draft
        num_rows, width = input_ids.shape
        self.max_new_tokens = generation_config.max_length - width
        # [rows, width + capacity] each row's tokens once it finishes; grows with the batch's buffer (`TokenBatch`)
        self.output = input_ids.new_full((num_rows, width + min(self.max_new_tokens, INITIAL_CAPACITY)), self.pad_id)
        self.output[:, :width] = input_ids
        self.output_generated = torch.zeros(num_rows, dtype=torch.long, device=input_ids.device)
        self.stats = DynSpecStats(batch_size=num_rows, prompt_length=width)
        models = {"target": model, "draft": draft}
        self.stats.narrow_rows = {role: self.placement.narrow_rows.get(id(m), 0) for role, m in models.items() if m}
        self.input_ids = input_ids
        returned = generation_config.return_dict_in_generate
        self.kept = {  # what `output_scores` / `output_logits` ask to return, per row
            name: EmittedScores(num_rows, self.pad_id)
            for name in ("scores", "logits")
            if returned and getattr(generation_config, f"output_{name}", False)
        }

    def _streams(self, input_ids: torch.LongTensor, mask: torch.LongTensor | None) -> torch.LongTensor:
        """`[rows]` each row's stream: the seed, its prompt without padding, its index among rows with that prompt."""
        real = torch.ones_like(input_ids, dtype=torch.bool) if mask is None else mask.bool()
        prompts = [row[keep].tolist() for row, keep in zip(input_ids.cpu(), real.cpu())]
        seed = self.decisions.seed(call_seed(self.config.seed, self.config.reuse_rollouts))
        return stream_keys(prompts, seed, input_ids.device, across_ranks=not self.decisions.enabled)

    def _max_draft_tokens(self) -> int:
        lookup = self.generation_config.prompt_lookup_num_tokens
        if isinstance(self.proposer, PromptLookupProposer) and lookup is not None:
            return min(self.config.num_speculative_tokens, int(lookup))
        return self.config.num_speculative_tokens

    # ---- the whole call ------------------------------------------------------------------------------------------
    def generate(self, model_kwargs: dict) -> DynSpecOutput | torch.LongTensor:
        start = self.placement.instant()
        self._overheads: list[tuple[StepRecord, tuple[Instant, ...], float]] = []  # read after the device is
        self.policy.reset(self.input_ids.shape[0])
        batch = self._prefill(model_kwargs)
        step = 0
        while batch.batch_size:
            batch = self.step(batch, step)
            step += 1
        self.proposer.release()
        self.stats.total_seconds = float(self.placement.since(start))
        self._resolve_overheads()
        self.stats.overhead_seconds = self.stats.total_seconds - self.stats.accounted_seconds
        self.stats.draft_forwards += self.proposer.forwards
        drafter = getattr(self.proposer, "draft", self.proposer)  # a hybrid's draft-model proposer
        self.stats.draft_lookahead = getattr(drafter, "lookahead", None)
        source = getattr(getattr(self.proposer, "free", self.proposer), "source", None)  # a hybrid's model-free one
        self.stats.rollout_rows = source.found_rows if isinstance(source, RolloutSource) else 0
        if self.streamer is not None:
            self.streamer.end()
        sequences = self.output[:, : self.input_ids.shape[1] + int(self.output_generated.max())]
        if self.generation_config.return_dict_in_generate:
            steps = sequences.shape[1] - self.input_ids.shape[1]
            kept = {name: record.per_position(steps) for name, record in self.kept.items()}
            return DynSpecOutput(sequences=sequences, dynspec_stats=self.stats, **kept)
        return sequences

    def _prefill(self, model_kwargs: dict) -> TokenBatch:
        """Run the target over the prompts and pick each row's first token, as plain decoding does (with
        `prefill_draft_confidence`, also verify draft tokens on top of each prompt in the same forward)."""
        start = self.placement.instant()
        input_ids = self.input_ids
        mask = model_kwargs.get("attention_mask")
        mask = torch.ones_like(input_ids) if mask is None else mask.long()
        positions = model_kwargs.get("position_ids")
        if positions is None:
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = generation_cache(model_kwargs)
        windows = self.placement.windows.get(id(self.model))
        cached = cached_prefix(cache, input_ids, windows)  # prompt tokens the call's cache already holds
        if cached:
            cache = copy.deepcopy(cache)  # the loop's holes and compactions never reach the caller's cache
        elif windows is not None and isinstance(cache, DynamicCache):
            cache = loop_cache(self.model, windows)  # whole layers: the loop's masks apply the sliding windows
        check_cache_supported(cache, "target model")
        self.target_cache = RaggedCache(
            cache, mask[:, :cached], self.config.compact_min_holes, self.config.compact_hole_fraction
        )
        batch = TokenBatch(
            tokens=self.output.clone(),
            prompt_width=input_ids.shape[1],
            num_prompt=mask.sum(dim=1),
            num_generated=torch.zeros_like(self.output_generated),
            pad_id=self.pad_id,
            max_new_tokens=self.max_new_tokens,
        )
        self.proposer.start(batch)
        proposal, drafting = self._prefill_proposal(batch)
        if proposal is None:
            logits = self._target_forward(input_ids[:, cached:], mask[:, cached:], positions[:, cached:], 1)
            scores = process_logits(self.logits_processor, batch, input_ids[:, :0], logits)  # [batch, 1, vocab]
            no_drafts = torch.zeros_like(batch.num_prompt)
            root_only = TokenTree.from_chain(input_ids[:, :0], no_drafts, input_ids[:, -1], check=False)
            first = self._verify(scores, root_only, None, batch)
            counts, host = self._read(batch, first, no_drafts)
            batch = self._emit(batch, first.emitted, counts, host, {"scores": scores, "logits": logits})
        else:
            batch = self._prefill_verifying(batch, proposal, mask, positions, cached)
        check_cache_supported(cache, "target model")  # the model may have built its cache in the forward
        self.stats.prefill_seconds = float(self.placement.since(start)) - drafting
        ratio = parameter_ratio(self.proposer.model, self.model) if self.proposer.model is not None else None
        prefilled = input_ids[:, cached:].numel()  # tokens the prefill's forward computed
        prefill = PrefillFeedback(
            input_ids.shape[0], prefilled, self.stats.prefill_seconds, ratio, self.proposer.rows_apart, self.packs
        )
        self.policy.observe_prefill(prefill)
        return batch

    def _prefill_proposal(self, batch: TokenBatch) -> tuple[Proposal | None, float]:
        """With `prefill_draft_confidence`, the draft tokens the prefill's forward verifies (each row up to the step's
        cap, stopped after its first token below that draft probability), and the seconds spent drafting them (booked
        as draft and catch-up seconds, the rest as overhead); `(None, 0.0)` otherwise."""
        threshold = self.config.prefill_draft_confidence
        if threshold is None or self.proposer.model is None or self.config.num_speculative_tokens == 0:
            return None, 0.0
        if self.proposer.reads_target_states:  # it drafts from the prefill's states
            return None, 0.0
        lengths = (batch.remaining - 1).clamp(min=0, max=self.max_draft)  # [batch]
        if not bool((lengths > 0).any()):
            return None, 0.0
        start = self.placement.instant()
        lengths = lengths.to("cpu", copy=True)  # proposers take per-row numbers on the host
        budgets = torch.where(lengths > 0, self.config.tree_node_budget, 0) if self.config.tree_node_budget else None
        free_rows = torch.zeros_like(lengths, dtype=torch.bool) if isinstance(self.proposer, HybridProposer) else None
        sure = lambda rows, positions, probs: probs >= threshold  # noqa: E731 - the same rule on every rank
        proposal = self.decisions.proposal(self.proposer.propose(batch, lengths, sure, free_rows, budgets))
        seconds = float(self.placement.since(start))
        catchup, setup = float(self.proposer.catchup_seconds), float(self.proposer.setup_seconds)
        self.stats.draft_seconds += seconds - catchup - setup  # a one-off measurement is loop overhead
        self.stats.catchup_seconds += catchup
        return proposal, seconds

    def _prefill_verifying(
        self, batch: TokenBatch, proposal: Proposal, mask: torch.LongTensor, positions: torch.LongTensor, cached: int
    ) -> TokenBatch:
        """One target forward over each prompt past its `cached` prefix and, on top of its last token, the draft
        tokens of `proposal`: the prefill and the first verify at once. Returns the batch after emitting what it
        accepted."""
        prompt = batch.tokens[:, cached : batch.prompt_width]  # [batch, prompt - cached]
        tree = proposal.tree(batch.last_tokens())  # root: the prompt's last token
        nodes = tree.num_nodes
        ids = torch.cat([prompt[:, :-1], tree.tokens], dim=1)  # [batch, width = prompt - cached - 1 + nodes]
        query_mask = torch.cat([mask[:, cached:-1], tree.valid.long()], dim=1)
        node_positions = tree.position_ids(positions[:, -1])  # [batch, nodes]
        visibility = _past_prefix(mask[:, :cached], query_mask, prefix_visibility(mask[:, cached:-1], tree))
        logits = self._target_forward(
            ids, query_mask, torch.cat([positions[:, cached:-1], node_positions], 1), nodes, visibility
        )
        scores = process_tree_logits(self.logits_processor, batch, tree, logits)  # [batch, nodes, vocab]
        outcome = self._verify(scores, tree, proposal.node_probs(tree), batch)
        counts, host = self._read(batch, outcome, tree.depths.max(dim=1).values)
        self.target_cache.set_last(outcome.kept.long(), host.kept.long())  # the accepted path stays, the rest are holes
        self.target_cache.settle()
        self.proposer.commit(batch, proposal, host.kept)
        self._count_free(proposal, host)
        self.stats.draft_tokens += int(proposal.lengths_on_host().sum())
        self.stats.accepted_tokens += int(host.accepted.sum())
        return self._emit(batch, outcome.emitted, counts, host, self._along_path(scores, logits, outcome))

    # ---- one step -----------------------------------------------------------------------------------------------
    def step(self, batch: TokenBatch, step: int) -> TokenBatch:
        """Draft, verify in one target forward, accept, emit; returns the batch of rows still running.

        The step reads the device once (`_read`, after the verify forward); every per-row number it passes the
        policy and the proposer is on the host."""
        begun = self.placement.instant()
        requested, free_rows, node_budgets = self._requested_lengths(batch, step)

        start = self.placement.instant()
        early_stop = self._early_stop_for(batch.host.row_ids)
        if int(requested.max()) > 0:
            proposal = self.proposer.propose(batch, requested, early_stop, free_rows, node_budgets)
            proposal = self.decisions.proposal(proposal)
            catchup, setup = self.proposer.catchup_seconds, self.proposer.setup_seconds
        else:
            nothing = batch.num_generated.new_zeros(batch.batch_size)
            proposal = Proposal(batch.tokens[:, :0], nothing, None, host_lengths=torch.zeros_like(requested))
            catchup, setup = 0.0, 0.0
        drafted = self.placement.instant()

        # The proposal as a token tree (a chain is a tree of single children): the target checks every node at once.
        tree = proposal.tree(batch.last_tokens())
        nodes = tree.num_nodes
        host_valid = torch.arange(nodes) <= proposal.lengths_on_host().unsqueeze(1)  # [batch, nodes] `tree.valid`
        positions = tree.position_ids(batch.num_real - 1)  # [batch, nodes]
        visibility = tree.visibility(self.target_cache.length)  # [batch, nodes, length + nodes]
        logits = self._target_forward(
            tree.tokens, tree.valid.long(), positions, nodes, visibility, self.packs, host_valid.long()
        )
        scores = process_tree_logits(self.logits_processor, batch, tree, logits)
        outcome = self._verify(scores, tree, proposal.node_probs(tree), batch)
        verified = self.placement.instant()
        counts, host = self._read(batch, outcome, tree.depths.max(dim=1).values)  # the step's one read of the device
        self._resolve_overheads()

        self.target_cache.set_last(outcome.kept.long(), host.kept.long())  # the accepted path stays, the rest: holes
        self.target_cache.settle()
        self.proposer.commit(batch, proposal, host.kept)
        since = self.placement.since
        drafting = since(start, drafted) - catchup - setup  # a one-off measurement is loop overhead, not drafting
        self._observe(requested, proposal, tree, host, drafting, float(catchup), float(since(drafted, verified)), batch)
        batch = self._emit(batch, outcome.emitted, counts, host, self._along_path(scores, logits, outcome))
        self._account_overhead((begun, start, drafted, verified), float(setup))
        return batch

    def _count_free(self, proposal: Proposal, host: HostOutcome) -> None:
        """Add the step's accepted tokens that a model-free source proposed to `stats.copied_tokens` (and, from the
        rollout cache, to `stats.reused_tokens`)."""
        free = self.proposer.last_free_rows
        if proposal.max_length == 0 or free is None:
            return
        copied = int(host.accepted[free.to("cpu", copy=True)].sum())
        self.stats.copied_tokens += copied
        if self.config.reuse_rollouts:
            self.stats.reused_tokens += copied

    def _along_path(
        self, scores: torch.Tensor, logits: torch.Tensor, outcome: TreeVerification
    ) -> dict[str, torch.Tensor]:
        """`[batch, max_depth + 1, vocab]` processed scores and raw logits before each emitted token (at the root,
        then along the accepted path), each only where stopping criteria or the output need them."""
        asked = self.criteria is not None or self.row_criteria
        needed = set(self.kept) | ({"scores"} if asked else set())
        at_nodes = {"scores": scores, "logits": logits}  # [batch, nodes, vocab] each
        rows = torch.arange(scores.shape[0], device=scores.device).unsqueeze(1)
        before = torch.cat([outcome.path.new_zeros((scores.shape[0], 1)), outcome.path.clamp(min=0)], dim=1)
        return {name: at_nodes[name][rows, before] for name in needed}

    def _account_overhead(self, instants: tuple[Instant, ...], setup: float) -> None:
        """Loop time of a step outside drafting, catch-up and verification (policy, acceptance, bookkeeping), from
        `instants` (`begun, start, drafted, verified`) and now; read at the next read of the device, so that reading
        it never waits (`_resolve_overheads`)."""
        if self.config.collect_step_stats and self.stats.steps:
            self._overheads.append((self.stats.steps[-1], (*instants, self.placement.instant()), setup))

    def _resolve_overheads(self) -> None:
        since = self.placement.since
        for record, (begun, start, drafted, verified, end), setup in self._overheads:
            record.overhead_seconds = float(since(begun, end) - since(start, drafted) + setup - since(drafted, verified))
        self._overheads.clear()

    def _requested_lengths(
        self, batch: TokenBatch, step: int
    ) -> tuple[torch.LongTensor, torch.BoolTensor | None, torch.LongTensor | None]:
        """The policy's draft lengths (tree depths), capped so no row drafts past its remaining length budget; the
        rows it serves from the model-free proposal (hybrid proposers; `None` otherwise); and each row's tree node
        budget (`None` for chains), all on the host. Draft-model tokens are capped at `num_speculative_tokens`, prompt-lookup tokens
        of a hybrid at `prompt_lookup_max_tokens` (they cost no draft forward)."""
        backlog, free_lengths = self.proposer.backlog(batch), self.proposer.free_lengths(batch, self.max_free)
        anchors = self.proposer.free_anchors(batch) if free_lengths is not None else None
        confidence = self.proposer.free_confidence(batch) if free_lengths is not None else None
        request = PolicyInput(
            step, batch.host.row_ids, batch.host_remaining, self.max_draft, backlog, free_lengths,
            self.config.tree_node_budget, free_anchors=anchors, free_confidence=confidence,
            draft_tries_free=self.config.draft_lookahead > 0,
        )
        lengths = self.policy.draft_lengths(request).to("cpu", copy=True)
        if lengths.shape != (batch.batch_size,) or bool((lengths < 0).any()):
            raise ValueError(
                f"Policy {type(self.policy).__name__} returned draft lengths {lengths.tolist()}; expected "
                f"{batch.batch_size} non-negative integers (one per active row)."
            )
        free_rows = None
        if free_lengths is not None:  # every rank's proposer offers: each takes rank 0's answer, `None` included
            answer = self.policy.free_rows(request)
            if answer is not None:
                answer = answer.to("cpu", copy=True) & (free_lengths.to("cpu", copy=True) > 0)  # lookup must offer
            free_rows = self.decisions.free_rows(answer, batch.batch_size)
        caps = torch.full_like(lengths, self.max_draft)
        if free_rows is not None:
            caps = torch.where(free_rows, self.max_free, caps)
        lengths = self.decisions.lengths(lengths.minimum(caps).minimum(batch.host_remaining - 1).clamp(min=0))
        budgets = None
        if self.config.tree_node_budget:
            budgets = self.policy.node_budgets(request, lengths).to("cpu", copy=True)
            budgets = self.decisions.lengths(torch.where(lengths > 0, budgets.clamp(1, self.config.tree_node_budget), 0))
        return lengths, free_rows, budgets  # on the host

    def _early_stop_for(self, row_ids: torch.LongTensor):
        """Bind the policy's `continue_drafting` hook to this step's rows (`None` when the policy has none)."""
        if not self.policy.stops_early:
            return None
        return lambda rows, positions, probs: self.policy.continue_drafting(row_ids[rows], positions, probs)

    def _target_forward(
        self,
        ids: torch.LongTensor,
        query_mask: torch.LongTensor,
        positions: torch.LongTensor,
        keep: int,
        visibility: torch.BoolTensor | None = None,
        pack: bool = False,
        host_mask: torch.LongTensor | None = None,
    ) -> torch.Tensor:
        """`[batch, keep, vocab]` float32 target logits for the last `keep` of the new tokens (`pack`: computing
        only the real ones, see `Placement.forward`; `host_mask`: `query_mask` on the host, if known)."""
        self.stats.target_forwards += 1
        return self.placement.forward(
            self.model, self.target_cache, ids, query_mask, positions, keep, visibility, pack=pack, host_mask=host_mask
        )

    def _verify(
        self, scores: torch.Tensor, tree: TokenTree, draft_probs: torch.Tensor | None, batch: TokenBatch
    ) -> TreeVerification:
        """Verify `tree` against the processed target scores at its nodes (`[batch, nodes, vocab]`). Coupled sampling
        matches each node's children against the node's perturbed argmax, keyed as the token it samples (`_keys`)."""
        if self.coupled:
            rows, nodes = tree.valid.nonzero(as_tuple=True)  # [items] each: noise only where a node is real
            keys = self._keys(batch, tree, rows, nodes)  # [items]
            chosen = torch.zeros(tree.tokens.shape, dtype=torch.long, device=scores.device)  # [batch, nodes]
            chosen[rows, nodes] = coupled_choice(scores[rows, nodes], self.streams[batch.row_ids[rows]], keys)
            outcome = verify_tree_tokens(chosen, tree)
        elif self.do_sample:
            outcome = verify_tree_sampling(scores.softmax(dim=-1), tree, draft_probs)
        else:
            outcome = verify_tree_greedy(scores, tree)
        return self.decisions.verdict(tree, outcome)

    def _keys(
        self, batch: TokenBatch, tree: TokenTree, rows: torch.LongTensor, nodes: torch.LongTensor
    ) -> torch.LongTensor:
        """`[items]` the noise key of the token sampled after node `nodes[i]` of row `rows[i]`'s tree."""
        if self.config.coupling_keys == "position":
            return batch_keys(batch, rows, rows.new_zeros(rows.shape[0], 0), tree.depths[rows, nodes], "position")
        paths = tree.paths()[rows, nodes, 1:]  # [items, depth] the nodes after the root on each item's path
        path = tree.tokens[rows].gather(1, paths.clamp(min=0))  # [items, depth]
        return batch_keys(batch, rows, path, tree.depths[rows, nodes], "context")

    # ---- emitting tokens and finishing rows --------------------------------------------------------------------------
    def _read(
        self, batch: TokenBatch, outcome: TreeVerification, deepest: torch.LongTensor
    ) -> tuple[torch.LongTensor, HostOutcome]:
        """The step's one read of the device: `outcome` with each row's emitted tokens cut at its length budget and
        after its first EOS. Returns those counts (`[batch]`, on the device) and everything on the host, with the
        depth of each row's deepest draft node (`deepest` `[batch]`)."""
        counts = (outcome.accepted + 1).minimum(batch.remaining)
        finished = counts >= batch.remaining
        counts, finished = self._cut_at_eos(outcome.emitted, counts, finished)
        return counts, HostOutcome.read(outcome, counts, finished, deepest)

    def _emit(
        self,
        batch: TokenBatch,
        emitted: torch.LongTensor,
        counts: torch.LongTensor,
        host: HostOutcome,
        before: dict[str, torch.Tensor],
    ) -> TokenBatch:
        """Append each row's emitted tokens (`emitted` `[batch, width]`, the first `counts` `[batch]`, as `_read` cut
        them; `host`: the same on the host), cut further at extra stopping criteria; move finished rows to the output.

        `before` holds the processed `scores` and raw `logits` (`[batch, width, vocab]`) before each emitted token,
        as far as extra stopping criteria and `output_scores` / `output_logits` need them.
        """
        host_counts, finished = host.counts, host.finished
        if self.row_criteria:
            host_counts, finished = self._cut_at_row_criteria(batch, emitted, host_counts, finished, before.get("scores"))
            counts = upload(host_counts, counts.device)
        for name, record in self.kept.items():
            record.add(batch.host.row_ids, host_counts, before[name])
        batch.append(emitted, counts, host.emitted, host_counts)
        self.stats.emitted_tokens += int(host_counts.sum())
        if self.criteria is not None:
            self.criteria.record(batch.host.row_ids, emitted, host_counts, finished, before["scores"])
            host_counts, finished = self._stop_rows(batch, self.criteria.stops(), host_counts, finished)
        if self.stats.steps and self.config.collect_step_stats:
            self.stats.steps[-1].emitted = host_counts.tolist()
        if self.streamer is not None:
            self.streamer.put(host.emitted[0, : int(host_counts[0])].clone())
        return self._drop_finished(batch, finished)

    def _cut_at_eos(
        self, emitted: torch.LongTensor, counts: torch.LongTensor, finished: torch.BoolTensor
    ) -> tuple[torch.LongTensor, torch.BoolTensor]:
        if self.eos is None:
            return counts, finished
        in_range = torch.arange(emitted.shape[1], device=emitted.device).unsqueeze(0) < counts.unsqueeze(1)
        is_eos = torch.isin(emitted, self.eos) & in_range  # [batch, width]
        has_eos = is_eos.any(dim=1)
        first_eos = is_eos.long().argmax(dim=1)
        return torch.where(has_eos, first_eos + 1, counts), finished | has_eos

    def _cut_at_row_criteria(
        self,
        batch: TokenBatch,
        emitted: torch.LongTensor,
        counts: torch.LongTensor,
        finished: torch.BoolTensor,
        scores: torch.Tensor | None,
    ) -> tuple[torch.LongTensor, torch.BoolTensor]:
        """Criteria that answer for each row from its own tokens (stop strings, tighter EOS and length criteria), asked
        token by token on each row's plain prefix as soon as it has the token (`counts`, `finished`: on the host)."""
        if not self.row_criteria:
            return counts, finished
        counts, finished = counts.clone(), finished.clone()
        for row in range(batch.batch_size):
            for i in range(int(counts[row])):
                prefix = batch.plain_prefix(row, emitted[row, : i + 1])
                if any(bool(torch.as_tensor(c(prefix, scores[row, i].unsqueeze(0))).any()) for c in self.row_criteria):
                    counts[row], finished[row] = i + 1, True
                    break
        return counts, finished

    def _stop_rows(
        self, batch: TokenBatch, stopped: dict[int, int], counts: torch.LongTensor, finished: torch.BoolTensor
    ) -> tuple[torch.LongTensor, torch.BoolTensor]:
        """Finish the rows stopping criteria stopped (`{row id: generated tokens}`), each cut back to its length,
        whether it is still in `batch` or already in the output; returns this step's counts and finished rows after
        the cuts (on the host, as given)."""
        if not stopped:
            return counts, finished
        counts, finished = counts.clone(), finished.clone()
        index = {row: i for i, row in enumerate(batch.host.row_ids.tolist())}
        start = self.input_ids.shape[1]
        for row, length in stopped.items():
            if row in index:
                i = index[row]
                before = int(batch.host.num_generated[i])
                for tokens, generated in ((batch.tokens, batch.num_generated), (batch.host.tokens, batch.host.num_generated)):
                    tokens[i, start + length : start + before] = self.pad_id
                    generated[i] = length
                counts[i] = max(0, length - (before - int(counts[i])))
                finished[i] = True
            else:
                before = int(self.output_generated[row])
                self.output[row, start + length : start + before] = self.pad_id
                self.output_generated[row] = length
            self.stats.emitted_tokens -= before - length
            for record in self.kept.values():
                record.truncate(row, length)
        return counts, finished

    def _drop_finished(self, batch: TokenBatch, finished: torch.BoolTensor) -> TokenBatch:
        """Move the rows `finished` (`[batch]`, on the host) to the output; the batch of the others."""
        if not bool(finished.any()):
            return batch
        host_done, host_keep = finished.nonzero().squeeze(1), (~finished).nonzero().squeeze(1)
        done, keep = upload(host_done, batch.tokens.device), upload(host_keep, batch.tokens.device)
        rows = batch.row_ids[done]
        self.proposer.finish_rows(batch, host_done)
        if batch.tokens.shape[1] > self.output.shape[1]:
            self.output = widen(self.output, batch.tokens.shape[1] - self.output.shape[1], self.pad_id)
        self.output[rows, : batch.tokens.shape[1]] = batch.tokens[done]
        self.output_generated[rows] = batch.num_generated[done]
        if host_keep.numel():
            self.target_cache.select_rows(keep, host_keep)
            self.proposer.select_rows(host_keep)
        return batch.select_rows(keep, host_keep)

    def _observe(
        self,
        requested: torch.LongTensor,
        proposal: Proposal,
        tree: TokenTree,
        host: HostOutcome,
        draft_seconds: float,
        catchup_seconds: float,
        verify_seconds: float,
        batch: TokenBatch,
    ) -> None:
        lengths = proposal.lengths_on_host()  # [batch]
        # tokens the verify forward computed: the real ones when packed, every row padded to the widest otherwise
        target_tokens = int(lengths.sum()) + batch.batch_size if self.packs else batch.batch_size * tree.num_nodes
        free_rows = self.proposer.last_free_rows if proposal.max_length else None
        catchup_tokens = self.proposer.catchup_tokens if catchup_seconds > 0 else 0
        feedback = StepFeedback(
            batch.host.row_ids, requested, host.deepest, host.accepted, float(draft_seconds), verify_seconds,
            target_tokens, catchup_seconds, catchup_tokens, free_rows,
        )
        self.policy.observe(feedback)
        self._count_free(proposal, host)
        stats = self.stats
        stats.num_steps += 1
        stats.draft_tokens += int(lengths.sum())
        stats.accepted_tokens += int(host.accepted.sum())
        stats.draft_seconds += float(draft_seconds)
        stats.catchup_seconds += catchup_seconds
        stats.verify_seconds += verify_seconds
        stats.compactions = self.target_cache.compactions
        if self.config.collect_step_stats:
            stats.steps.append(
                StepRecord(
                    batch_size=batch.batch_size,
                    row_ids=batch.host.row_ids.tolist(),
                    requested_lengths=requested.tolist(),
                    draft_lengths=lengths.tolist(),
                    accepted=host.accepted.tolist(),
                    emitted=[],
                    draft_seconds=float(draft_seconds),
                    verify_seconds=verify_seconds,
                    target_tokens=target_tokens,
                    catchup_seconds=catchup_seconds,
                    catchup_tokens=catchup_tokens,
                    free_rows=free_rows.tolist() if free_rows is not None else None,
                    draft_depths=host.deepest.tolist() if proposal.parents is not None else None,
                )
            )


def _past_prefix(
    cached_mask: torch.LongTensor, query_mask: torch.LongTensor, visibility: torch.BoolTensor
) -> torch.BoolTensor:
    """`visibility` (`[batch, width, width]`, a forward over the uncached part of the prompt and a tree) widened to
    `[batch, width, cached + width]`: every real token of the forward also sees the row's real cached tokens; padding
    still sees only itself.

    Args:
        cached_mask: `[batch, cached]` 1 on the cached prefix's real tokens.
        query_mask: `[batch, width]` 1 on the forward's real tokens.
    """
    sees = cached_mask.bool().unsqueeze(1) & query_mask.bool().unsqueeze(2)  # [batch, width, cached]
    return torch.cat([sees.to(visibility.device), visibility], dim=2)
