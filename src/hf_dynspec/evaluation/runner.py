"""Running one method over a list of prompts: padding, generation, timing, forward counts and output trimming."""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import LogitsProcessorList, PreTrainedModel, StoppingCriteria, StoppingCriteriaList

from ..candidates.draft_model import draft_lookahead_tokens
from ..candidates.rollout import RolloutSettings, rollout_cache_for
from ..candidates.suffix import SuffixSettings, clear_suffix_caches, suffix_cache_for
from ..kernels import linear_plan, narrow_linear, row_major_output
from .equivalence import MarginRecorder, RowMargins
from .methods import Method
from .rollout import ActiveRowsTimeline

TIME_FIELDS = ("prefill_seconds", "draft_seconds", "catchup_seconds", "verify_seconds", "overhead_seconds")
"""Where a speculative run's time goes (the loop's own totals, summed over its `generate` calls)."""


def finished_clock(tensor: torch.Tensor) -> float:
    """`time.perf_counter()` once the device of `tensor` has done its queued work (on CUDA the host runs ahead)."""
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
    return time.perf_counter()


class RowBudgets(StoppingCriteria):
    """Stops each row after its own number of new tokens, like requests with different `max_tokens` in a server.

    Rows are recognised by their left-padded prompt (the first `prompts.shape[1]` columns), so the same criterion
    works when the batch shrinks or when `generate` hands over one row at a time.
    """

    answers_row_by_row = True  # the speculative loop may ask it about each row as soon as the row has a token

    def __init__(self, prompts: torch.LongTensor, budgets: Sequence[int]) -> None:
        self.prompts = prompts  # [batch, prompt_width] left-padded prompt ids
        self.budgets = torch.as_tensor(list(budgets), dtype=torch.long)  # [batch]
        if self.budgets.shape[0] != prompts.shape[0]:
            raise ValueError(f"Got {self.budgets.shape[0]} budgets for {prompts.shape[0]} prompts.")

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        width = self.prompts.shape[1]
        same = (input_ids[:, None, :width] == self.prompts[None].to(input_ids.device)).all(dim=-1)  # [rows, batch]
        budget = self.budgets.to(input_ids.device)[same.long().argmax(dim=1)]
        return torch.full_like(budget, input_ids.shape[1] - width) >= budget


@dataclass
class Outcome:
    """What one method produced on all prompts: trimmed new tokens per prompt, time and work done."""

    tokens: list[list[int]]
    seconds: float
    target_forwards: int
    draft_forwards: int
    cpu_seconds: float = 0.0
    """CPU time of this process (all threads) spent in `generate`; less affected than wall time by other load."""
    accepted: Counter = field(default_factory=Counter)
    """Row-steps by accepted draft tokens (dynspec methods; only row-steps that proposed a draft)."""
    steps: list[dict[str, float]] = field(default_factory=list)
    """Per-step summaries of the speculative loop (dynspec methods)."""
    margins: list[RowMargins] = field(default_factory=list)
    """Per prompt, plain greedy decoding's top two tokens and their margin at each position (greedy `plain` only)."""
    times: dict[str, float] = field(default_factory=dict)
    """The loop's time totals by `TIME_FIELDS` name, plus `total_seconds` (dynspec methods)."""
    draft_lookahead: int | None = None
    """The most lookahead guess tokens a draft forward could carry (`DynSpecStats.draft_lookahead`, timed once per
    process, so it may differ between runs); None where no draft model drafted in the loop."""
    timelines: list[list[tuple[float, int]]] = field(default_factory=list)
    """Per `generate` call, `(seconds since its start, active rows)` at each target forward (`Runner(timeline=True)`)."""
    reused_tokens: int = 0
    """Accepted draft tokens the rollout cache proposed (`DynSpecStats.reused_tokens`)."""
    copied_tokens: int = 0
    """Accepted draft tokens a model-free source proposed (`DynSpecStats.copied_tokens`)."""

    @property
    def new_tokens(self) -> int:
        return sum(len(row) for row in self.tokens)

    def extend(self, other: Outcome) -> None:
        """Append `other` (the same method on the next prompts) to this outcome."""
        self.tokens.extend(other.tokens)
        self.seconds += other.seconds
        self.cpu_seconds += other.cpu_seconds
        self.target_forwards += other.target_forwards
        self.draft_forwards += other.draft_forwards
        self.accepted.update(other.accepted)
        self.steps.extend(other.steps)
        self.margins.extend(other.margins)
        self.timelines.extend(other.timelines)
        self.reused_tokens += other.reused_tokens
        self.copied_tokens += other.copied_tokens
        for name, seconds in other.times.items():
            self.times[name] = self.times.get(name, 0.0) + seconds
        self.record_lookahead(other.draft_lookahead)

    def record_lookahead(self, lookahead: int | None) -> None:
        """Keep the widest lookahead seen (`None`: this call drove no draft model)."""
        if lookahead is not None:
            self.draft_lookahead = max(self.draft_lookahead or 0, lookahead)

    def mean_accepted(self, method: Method) -> float | None:
        """Mean accepted draft tokens per verification.

        From the loop's records for dynspec methods; for transformers' methods derived from forward counts (each
        target forward emits the accepted tokens plus one), for `plain` `None`.
        """
        if method.kind == "plain":
            return None
        if method.kind == "dynspec":
            total = sum(self.accepted.values())
            return sum(k * n for k, n in self.accepted.items()) / total if total else 0.0
        return (self.new_tokens - self.target_forwards) / self.target_forwards if self.target_forwards else 0.0


class ForwardCounter:
    """Counts forward calls of a model (a forward pre-hook on its decoder, which every forward runs once, including
    those that compute the logits themselves, as a narrowed draft head does; other modules: on the module)."""

    def __init__(self, module: torch.nn.Module | None) -> None:
        self.count = 0
        hooked = module.get_decoder() if isinstance(module, PreTrainedModel) else module
        self._handle = hooked.register_forward_pre_hook(self._hook) if hooked is not None else None

    def _hook(self, module: torch.nn.Module, args: Any) -> None:
        self.count += 1

    def take(self) -> int:
        """The count since the last `take`, resetting it."""
        count, self.count = self.count, 0
        return count

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.LongTensor, torch.LongTensor]:
    """`(input_ids, attention_mask)`, both `[batch, longest prompt]`, padded on the left."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if len(prompt):
            ids[row, width - len(prompt) :] = torch.as_tensor(list(prompt), dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
    return ids, mask


def trim(generated: torch.LongTensor, eos_ids: set[int], limits: Sequence[int] | None = None) -> list[list[int]]:
    """Each row's new tokens: at most `limits[row]` of them, ending at the first EOS (included).

    Whatever `generate` wrote after a row finished (padding) is dropped, even when the pad id is an EOS id.
    """
    rows = []
    for index, row in enumerate(generated.tolist()):
        if limits is not None:
            row = row[: limits[index]]
        end = next((i for i, token in enumerate(row) if token in eos_ids), None)
        rows.append(row if end is None else row[: end + 1])
    return rows


class Runner:
    """Runs methods on a fixed target/draft pair with fixed generation settings.

    Policy objects of dynspec methods are built once and reused for every call, so a policy that learns online
    (the goodput controller's cost model) keeps what it learned across batches and repetitions. Transformers'
    assisted methods each keep their own copy of the draft's generation config for the same reason (the heuristic
    schedule carries its draft length over between calls).
    """

    def __init__(
        self,
        target: PreTrainedModel,
        draft: PreTrainedModel | None,
        max_new_tokens: int,
        do_sample: bool = False,
        seed: int = 0,
        variant_drafts: dict[str, PreTrainedModel] | None = None,
        tokenizer: Any = None,
        sampling: dict[str, float] | None = None,
        timeline: bool = False,
        foreign_text: Sequence[Sequence[int]] = (),
        rollouts: dict[int, torch.LongTensor] | None = None,
    ) -> None:
        """
        Args:
            variant_drafts: drafts for methods with a `draft_variant`, by variant (e.g. `{"4bit": model}`).
            tokenizer: the target's tokenizer, which methods that draft through text (`+text`) need.
            sampling: `temperature`, `top_p`, `top_k` for every sampled call (instead of the target's generation
                config's).
            timeline: record when each target forward starts and how many rows are active (`Outcome.timelines`).
            foreign_text: token ids of another task's texts, the suffix cache of `+foreign` methods' runs.
            rollouts: responses by stream (`RolloutCache.responses`, an epoch before) that the rollout cache of the
                target holds at the start of every run of a method that reuses rollouts (`Method.reuse`).
        """
        self.rollouts = dict(rollouts or {})
        self.foreign_text = [list(text) for text in foreign_text]
        self.sampling = dict(sampling or {}) if do_sample else {}
        self._timeline = ActiveRowsTimeline(target) if timeline else None
        self.target, self.draft, self.tokenizer = target, draft, tokenizer
        self.variant_drafts = dict(variant_drafts or {})
        self.max_new_tokens, self.do_sample, self.seed = max_new_tokens, do_sample, seed
        config = target.generation_config
        self.pad_id = int(config.pad_token_id if config.pad_token_id is not None else _first(config.eos_token_id))
        eos = config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self._policies: dict[str, Any] = {}
        self._draft_configs: dict[str, Any] = {}
        self._linear_plan = linear_plan(target, "auto")  # `+narrow` methods: what the loop measures for the target
        self._target_counter = ForwardCounter(target)
        self._draft_counters = [ForwardCounter(m) for m in (draft, *self.variant_drafts.values())]

    # ---- public ------------------------------------------------------------------------------------------------
    def run(
        self,
        method: Method,
        prompts: Sequence[Sequence[int]],
        batch_size: int,
        budgets: Sequence[int] | None = None,
        max_new_tokens: int | None = None,
        progress: bool = True,
    ) -> Outcome:
        """Generate for every prompt (in order) with `method`, `batch_size` prompts per `generate` call."""
        if method.uses_draft and self._draft(method) is None:
            raise ValueError(f"Method {method.name!r} needs a draft model; pass one (--draft).")
        if method.through_text and self.tokenizer is None:
            raise ValueError(f"Method {method.name!r} drafts through text and needs the target's tokenizer, which "
                             "tiny models (--tiny) do not have; drop '+text' or bench a real model.")
        chunks = [range(start, min(start + batch_size, len(prompts))) for start in range(0, len(prompts), batch_size)]
        if method.suffix:
            self._start_suffix_cache(method, prompts, chunks, budgets, max_new_tokens)
        if method.reuse:
            self._start_rollout_cache(method)
        self._target_counter.take(), self._draft_forwards()
        outcome = Outcome(tokens=[], seconds=0.0, target_forwards=0, draft_forwards=0)
        for chunk in tqdm(chunks, desc=f"{method.name} @ {batch_size}", leave=False, disable=not progress):
            batch = [prompts[i] for i in chunk]
            batch_budgets = [budgets[i] for i in chunk] if budgets is not None else None
            if method.batched:
                self._generate(method, batch, batch_budgets, max_new_tokens, outcome)
            else:
                for row, prompt in enumerate(batch):
                    row_budget = [batch_budgets[row]] if batch_budgets is not None else None
                    self._generate(method, [prompt], row_budget, max_new_tokens, outcome)
        outcome.target_forwards += self._target_counter.take()
        outcome.draft_forwards += self._draft_forwards()
        return outcome

    def _start_suffix_cache(
        self, method: Method, prompts: Sequence[Sequence[int]], chunks: list[range], budgets, max_new_tokens
    ) -> None:
        """Empty the target's suffix caches, so no run proposes from another's outputs; with `+foreign`, then write
        another task's texts in as earlier outputs; with `+warm`, run the same prompts once untimed with another seed
        (an RL epoch before)."""
        clear_suffix_caches(self.target)
        if method.foreign:
            if not self.foreign_text:
                raise ValueError(f"Method {method.name!r} needs another task's text: pass `foreign_text` to Runner.")
            cache = suffix_cache_for(self.target, SuffixSettings.from_config(method.dynspec_config))
            for text in self.foreign_text:
                request = cache.start([])
                cache.extend(request, text)
                cache.stop(request)
        if not method.warm:
            return
        scratch = Outcome(tokens=[], seconds=0.0, target_forwards=0, draft_forwards=0)
        for chunk in chunks:
            chunk_budgets = [budgets[i] for i in chunk] if budgets is not None else None
            self._generate(method, [prompts[i] for i in chunk], chunk_budgets, max_new_tokens, scratch, self.seed + 1)

    def _start_rollout_cache(self, method: Method) -> None:
        """The target's rollout cache holding `rollouts` alone, so every run reuses the same epoch before."""
        cache = rollout_cache_for(self.target, RolloutSettings.from_config(method.dynspec_config))
        cache.clear()
        for stream, response in self.rollouts.items():
            cache.store(stream, response)

    def prepare(self, method: Method) -> None:
        """Pay `method`'s one-off costs of a process now, untimed: the draft's lookahead width is measured on the
        first call that drafts, which a short warm-up may not reach (a policy may wait before drafting), and would
        otherwise be timed in whichever measured run drafts first."""
        config = method.dynspec_config
        draft = self._draft(method) if method.uses_draft else None
        if method.kind == "dynspec" and draft is not None and config is not None:
            plan = linear_plan(draft, config.narrow_linear)
            for base in sorted({1, config.tree_branching} if config.tree_node_budget else {1}):  # a tree's frontier
                draft_lookahead_tokens(draft, config, plan, base)
            self._draft_forwards()  # the measurement's forwards are no method's

    def close(self) -> None:
        """Remove the forward hooks."""
        self._target_counter.remove()
        if self._timeline is not None:
            self._timeline.remove()
        for counter in self._draft_counters:
            counter.remove()

    def _draft(self, method: Method) -> PreTrainedModel | None:
        """The draft model `method` runs with (a variant's own model when it names one)."""
        if method.draft_variant is None:
            return self.draft
        if method.draft_variant not in self.variant_drafts:
            raise ValueError(f"Method {method.name!r} needs the draft variant {method.draft_variant!r}, which is not "
                             f"loaded; loaded variants: {sorted(self.variant_drafts)}.")
        return self.variant_drafts[method.draft_variant]

    def _draft_forwards(self) -> int:
        """Draft forwards since the last call, over every loaded draft (only the running method's draft counts)."""
        return sum(counter.take() for counter in self._draft_counters)

    # ---- one generate call --------------------------------------------------------------------------------------
    def _generate(
        self,
        method: Method,
        prompts: list[Sequence[int]],
        budgets: list[int] | None,
        max_new_tokens: int | None,
        outcome: Outcome,
        seed: int | None = None,
    ) -> None:
        input_ids, attention_mask = left_pad(prompts, self.pad_id)
        kwargs: dict[str, Any] = dict(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens or self.max_new_tokens,
            do_sample=self.do_sample,
            pad_token_id=self.pad_id,
            return_dict_in_generate=True,
            **self.sampling,
            **method.generate_kwargs,
        )
        if budgets is not None:
            kwargs["stopping_criteria"] = StoppingCriteriaList([RowBudgets(input_ids, budgets)])
        recorder = MarginRecorder() if method.name == "plain" and not self.do_sample else None
        if recorder is not None:
            kwargs["logits_processor"] = LogitsProcessorList([recorder])
        if self.do_sample:
            torch.manual_seed(self.seed if seed is None else seed)
        start, cpu_start = time.perf_counter(), time.process_time()
        models = ((self.target, self._draft(method)) if method.uses_draft else (self.target,)) if method.row_major else ()
        with torch.inference_mode(), narrow_linear(self._linear_plan if method.narrow else 0), row_major_output(*models):
            output = self._call(method, kwargs)
        end = finished_clock(output.sequences)
        outcome.seconds += end - start
        outcome.cpu_seconds += time.process_time() - cpu_start
        tokens = trim(output.sequences[:, input_ids.shape[1] :], self.eos_ids, budgets)
        outcome.tokens.extend(tokens)
        if self._timeline is not None:  # plain `generate` computes finished rows too: count the rows still needed
            lengths = [len(row) for row in tokens] if method.kind != "dynspec" else None
            outcome.timelines.append(self._timeline.take(start, end, lengths))
        if recorder is not None:
            outcome.margins.extend(recorder.rows())
        stats = getattr(output, "dynspec_stats", None)
        if stats is not None:
            self._record_stats(stats, outcome)

    def _call(self, method: Method, kwargs: dict[str, Any]):
        if method.through_text:
            kwargs.update(tokenizer=self.tokenizer, assistant_tokenizer=self.tokenizer)
        if method.kind == "plain":
            return self.target.generate(**kwargs)
        if method.kind == "hf":
            if not method.uses_draft:
                return self.target.generate(**kwargs)
            draft = self._draft(method)
            saved = draft.generation_config
            draft.generation_config = self._draft_config(method)
            try:
                with _without_assistant_deprecation():
                    return self.target.generate(assistant_model=draft, **kwargs)
            finally:
                draft.generation_config = saved
        import hf_dynspec

        if method.uses_draft:
            kwargs["assistant_model"] = self._draft(method)
        return hf_dynspec.generate(
            self.target, dynspec_config=method.dynspec_config, dynspec_policy=self._policy(method), **kwargs
        )

    def _draft_config(self, method: Method):
        if method.name not in self._draft_configs:
            config = copy.deepcopy(self._draft(method).generation_config)
            for key, value in method.assistant_settings.items():
                setattr(config, key, value)
            self._draft_configs[method.name] = config
        return self._draft_configs[method.name]

    def _policy(self, method: Method):
        if method.name not in self._policies:
            from ..policies import build_policy

            self._policies[method.name] = build_policy(method.dynspec_config)
        return self._policies[method.name]

    def policy(self, method: Method):
        """The (persistent) policy object a dynspec method runs with."""
        return self._policy(method)

    @staticmethod
    def _record_stats(stats: Any, outcome: Outcome) -> None:
        parts = {name: getattr(stats, name) for name in TIME_FIELDS[:-1]}
        overhead = getattr(stats, "overhead_seconds", None)
        parts["overhead_seconds"] = stats.total_seconds - sum(parts.values()) if overhead is None else overhead
        for name, seconds in {**parts, "total_seconds": stats.total_seconds}.items():
            outcome.times[name] = outcome.times.get(name, 0.0) + seconds
        outcome.record_lookahead(getattr(stats, "draft_lookahead", None))
        outcome.reused_tokens += getattr(stats, "reused_tokens", 0)
        outcome.copied_tokens += getattr(stats, "copied_tokens", 0)
        for step in stats.steps:
            outcome.accepted.update(a for a, k in zip(step.accepted, step.draft_lengths) if k > 0)
            depths = getattr(step, "draft_depths", None)
            tree = {"draft_nodes": step.draft_lengths, "draft_depths": depths, "accepted_path": step.accepted}
            outcome.steps.append(
                {
                    **(tree if depths is not None else {}),  # token trees: per row, nodes, depth and accepted path
                    "batch_size": step.batch_size,
                    "mean_draft_length": sum(step.draft_lengths) / max(1, len(step.draft_lengths)),
                    "max_draft_length": max(step.draft_lengths, default=0),
                    "mean_requested_length": sum(step.requested_lengths) / max(1, len(step.requested_lengths)),
                    "mean_accepted": sum(step.accepted) / max(1, len(step.accepted)),
                    "draft_seconds": step.draft_seconds,
                    "verify_seconds": step.verify_seconds,
                    "catchup_seconds": step.catchup_seconds,
                    "overhead_seconds": getattr(step, "overhead_seconds", None),
                }
            )


class _AssistantDeprecationFilter(logging.Filter):
    """Drops the deprecation warning transformers' assisted generation triggers itself: its candidate generator calls
    the assistant's `generate` with a `generation_config` and generation arguments together (no call of ours does)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Passing `generation_config` together with generation-related")


@contextlib.contextmanager
def _without_assistant_deprecation():
    logger = logging.getLogger("transformers.generation.utils")
    dropped = _AssistantDeprecationFilter()
    logger.addFilter(dropped)
    try:
        yield
    finally:
        logger.removeFilter(dropped)


def _first(value: int | list[int] | None) -> int:
    if isinstance(value, list):
        return int(value[0])
    if value is None:
        raise ValueError("The target's generation config has neither pad_token_id nor eos_token_id; set one.")
    return int(value)
