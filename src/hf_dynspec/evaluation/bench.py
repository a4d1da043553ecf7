"""The benchmark: every method on the same prompts, interleaved, warmed up, repeated; compared with `plain`.

`run_benchmark(settings)` returns the `results.json` dict:
`{"machine": {...}, "config": {...}, "runs": [...], "traces": [...]}` (and `"timelines"` where rows of a batch end
at different steps: samples of a prompt, row budgets) where each run is one (method, batch size) with
median timings over the repetitions (`wall_s`: for every batch of prompts the median over repetitions, summed over
the batches), and each trace holds the per-step records of a speculative-loop run (last repetition) for plots.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import os
import platform
import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..kernels import linear_plan
from .equivalence import classify, summarize
from .methods import NO_SPECULATION, Method, parse_methods
from .models import (
    DTYPES,
    cpu_bfloat16_support,
)
from .rollout import BUCKETS, bucket_seconds, forward_seconds, matched_seconds, median_buckets
from .runner import TIME_FIELDS, Outcome, Runner
from .settings import BenchSettings


def long_tail_budgets(num_rows: int, max_new_tokens: int, seed: int = 0) -> list[int]:
    """Per-row output budgets shaped like the end of an RL rollout: most rows short, a few run to the limit.

    Budgets are `max_new_tokens * u**3` for uniform `u` (at least 8 tokens), and the first row always gets the full
    `max_new_tokens`, so the batch shrinks from `num_rows` rows to one long straggler.
    """
    generator = torch.Generator().manual_seed(seed)
    u = torch.rand(num_rows, generator=generator)
    budgets = (u**3 * max_new_tokens).round().clamp(min=min(8, max_new_tokens)).long().tolist()
    budgets[0] = max_new_tokens
    return budgets


def machine_description() -> dict[str, Any]:
    """CPU, cores, memory and library versions of this machine."""
    import transformers

    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")]
        cpu = names[0] if names else cpu
    memory = None
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        total = next((line for line in meminfo.read_text().splitlines() if line.startswith("MemTotal")), None)
        memory = f"{int(total.split()[1]) / 1024**2:.1f} GiB" if total else None
    return {
        "cpu": cpu,
        "bfloat16": {
            "cpu": cpu_bfloat16_support(),
            "cuda": torch.cuda.is_bf16_supported() if torch.cuda.is_available() else None,
        },
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory": memory,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


# ---- the run -------------------------------------------------------------------------------------------------------
@dataclass
class _Measured:
    seconds: list[float] = field(default_factory=list)  # wall seconds of each repetition
    chunk_seconds: dict[int, list[float]] = field(default_factory=dict)  # wall seconds of each batch, per repetition
    chunk_cpu_seconds: dict[int, list[float]] = field(default_factory=dict)
    outcomes: list[Outcome] = field(default_factory=list)  # one per repetition
    mismatched_prompts: int = 0
    mismatched_tokens: int = 0
    equivalence: dict[str, Any] | None = None  # greedy runs: the worst repetition's `equivalence.summarize`
    speedups: list[float] | None = None  # tokens/s over plain's, repetition by repetition (None for plain itself)


def paired_speedups(entry: _Measured, plain: _Measured) -> list[float]:
    """Tokens per second over plain's, one per repetition: repetition `r` of both ran in the same interleaved round,
    so the spread of these ratios is the run-to-run spread of the speedup, free of slow phases that hit both alike."""
    return [
        (mine.new_tokens / seconds) / (ref.new_tokens / ref_seconds)
        for mine, seconds, ref, ref_seconds in zip(entry.outcomes, entry.seconds, plain.outcomes, plain.seconds)
        if seconds > 0 and ref_seconds > 0 and ref.new_tokens > 0
    ]


def compare(tokens: list[list[int]], reference: list[list[int]]) -> tuple[int, int]:
    """`(prompts that differ, tokens that differ)`: a token differs from the first diverging position on."""
    prompts = tokens_off = 0
    for row, ref in zip(tokens, reference):
        if row != ref:
            prompts += 1
            same = next((i for i, (a, b) in enumerate(zip(row, ref)) if a != b), min(len(row), len(ref)))
            tokens_off += max(len(row), len(ref)) - same
    return prompts, tokens_off


def check_equivalence(outcomes: list[Outcome], references: list[Outcome], dtype: torch.dtype) -> dict[str, Any]:
    """The worst repetition's row verdicts (most mismatches, then most near ties) against plain's margins."""
    summaries = [
        summarize(classify(o.tokens, ref.tokens, ref.margins, dtype), dtype) for o, ref in zip(outcomes, references)
    ]
    return max(summaries, key=lambda s: (s["mismatch"], s["near_tie"]))


def run_benchmark(
    settings: BenchSettings,
    target: torch.nn.Module | None = None,
    draft: torch.nn.Module | None = None,
    prompts: list[list[int]] | None = None,
    progress: bool = True,
    variant_drafts: dict[str, torch.nn.Module] | None = None,
    rollouts: dict[int, torch.LongTensor] | None = None,
    keep_rows: bool = False,
) -> dict[str, Any]:
    """Run every method at every batch size; returns the results dict (see the module docstring).

    Models and prompt token ids are loaded from `settings` unless given; so are the draft variants that methods
    name (`method/variant`, see `methods`), unless `variant_drafts` has them. Methods that reuse rollouts start every run
    from `rollouts` (responses by stream, an epoch before); `keep_rows` adds each run's rows (its last repetition's new
    tokens) to its record. Methods run interleaved (the order rotates
    every repetition) so drift in machine speed hits all alike; each (method, batch size) is warmed up once.
    """

    methods = parse_methods(settings.methods, settings.policy_options, require_plain=not settings.do_sample)
    if target is None or prompts is None:
        need_draft = any(m.uses_draft and m.draft_variant is None for m in methods)
        loaded_target, loaded_draft, loaded_prompts = load_inputs(settings, need_draft=need_draft)
        target, draft = target or loaded_target, draft or loaded_draft
        prompts = prompts if prompts is not None else loaded_prompts
    variants = sorted({m.draft_variant for m in methods if m.draft_variant} - set(variant_drafts or {}))
    variant_drafts = {**(variant_drafts or {}), **load_variant_drafts(settings, variants, draft)}
    tokenizer = target_tokenizer(settings) if any(m.through_text for m in methods) and not settings.tiny else None
    foreign = foreign_texts(settings) if any(m.foreign for m in methods) else []
    runner = Runner(target, draft, settings.max_new_tokens, settings.do_sample, settings.seed, variant_drafts, tokenizer,
                    sampling=settings.sampling, timeline=settings.records_timeline, foreign_text=foreign,
                    rollouts=rollouts)
    budgets = (
        long_tail_budgets(len(prompts), settings.max_new_tokens, settings.seed)
        if settings.output_lengths == "long-tail"
        else None
    )
    measured: dict[tuple[str, int], _Measured] = {(m.name, b): _Measured() for b in settings.batch_sizes for m in methods}
    try:
        _warm_up(runner, methods, settings, prompts, budgets, progress)
        jobs = _schedule(methods, settings)
        current: dict[tuple[str, int, int], Outcome] = {}
        for rep, batch_size, chunk, method in tqdm(jobs, desc="benchmark", disable=not progress):
            part = runner.run(
                method, prompts[chunk], batch_size, budgets[chunk] if budgets else None, progress=False
            )
            entry = measured[(method.name, batch_size)]
            entry.chunk_seconds.setdefault(chunk.start, []).append(part.seconds)
            entry.chunk_cpu_seconds.setdefault(chunk.start, []).append(part.cpu_seconds)
            key = (method.name, batch_size, rep)
            current.setdefault(key, Outcome(tokens=[], seconds=0.0, target_forwards=0, draft_forwards=0)).extend(part)
        for (name, batch_size, _rep), outcome in current.items():
            entry = measured[(name, batch_size)]
            entry.seconds.append(outcome.seconds)
            entry.outcomes.append(outcome)
    finally:
        runner.close()
    for (name, batch_size), entry in measured.items():
        if name != "plain" and ("plain", batch_size) in measured:
            entry.speedups = paired_speedups(entry, measured[("plain", batch_size)])
            reference = measured[("plain", batch_size)].outcomes
            errors = [compare(o.tokens, ref.tokens) for o, ref in zip(entry.outcomes, reference)]
            entry.mismatched_prompts = max(e[0] for e in errors)
            entry.mismatched_tokens = max(e[1] for e in errors)
            if not settings.do_sample:
                entry.equivalence = check_equivalence(entry.outcomes, reference, target.dtype)
    config = _config_dict(settings, prompts, budgets)
    # what `narrow_linear="auto"` (the loop's default, and `+narrow` methods) computes weight-first per model
    plans = {role: linear_plan(m, "auto") for role, m in (("target", target), ("draft", draft)) if m}
    config["narrow_rows"] = {role: plan.narrow_rows for role, plan in plans.items()}
    config["linear_plans"] = {role: plan.to_dict() for role, plan in plans.items()}
    results = {
        "machine": machine_description(),
        "config": config,
        "runs": [_run_record(m, b, measured[(m.name, b)], settings, keep_rows)
                 for b in settings.batch_sizes for m in methods],
        "traces": [_trace(m, b, measured[(m.name, b)]) for b in settings.batch_sizes for m in methods if m.kind == "dynspec"],
    }
    if settings.records_timeline and NO_SPECULATION in {m.name for m in methods}:
        for run in results["runs"]:
            run["vs_nospec_same_lengths"] = _same_lengths_speedups(
                measured[(NO_SPECULATION, run["batch_size"])], measured[(run["method"], run["batch_size"])]
            )
    if settings.records_timeline:  # per method, each call's active rows over time (last repetition)
        results["timelines"] = [
            {"method": m.name, "batch_size": b, "calls": measured[(m.name, b)].outcomes[-1].timelines}
            for b in settings.batch_sizes for m in methods
        ]
    return results


def _rotated(methods: list[Method], shift: int) -> list[Method]:
    shift %= len(methods)
    return methods[shift:] + methods[:shift]


def _schedule(methods: list[Method], settings: BenchSettings) -> list[tuple[int, int, slice, Method]]:
    """`(repetition, batch size, prompt slice, method)` in run order.

    Methods are interleaved batch by batch (every method runs on one batch of prompts before the next batch starts),
    and the method order rotates from batch to batch, so slow phases of a shared machine hit every method alike.
    """
    jobs = []
    turn = 0
    for rep in range(settings.repetitions):
        for batch_size in settings.batch_sizes:
            count = settings.prompts_for(batch_size)
            for start in range(0, count, batch_size):
                chunk = slice(start, min(start + batch_size, count))
                jobs.extend((rep, batch_size, chunk, method) for method in _rotated(methods, turn))
                turn += 1
    return jobs


def _warm_up(runner, methods: list[Method], settings: BenchSettings, prompts, budgets, progress: bool) -> None:
    """One short untimed run of every (method, batch size) on the first prompts (at most 2: on a CPU the first call's
    one-off costs do not depend on the batch, and a full batch's prefill would only cost time), after each method's
    one-off measurements (`Runner.prepare`)."""
    if settings.warmup_tokens < 1:
        return
    for method in methods:
        runner.prepare(method)
    pairs = [(m, b) for b in settings.batch_sizes for m in methods]
    for method, batch_size in tqdm(pairs, desc="warm-up", leave=False, disable=not progress):
        count = min(2, batch_size, settings.prompts_for(batch_size))
        runner.run(method, prompts[:count], batch_size, budgets[:count] if budgets else None,
                   max_new_tokens=settings.warmup_tokens, progress=False)


def _run_record(
    method: Method, batch_size: int, entry: _Measured, settings: BenchSettings, keep_rows: bool = False
) -> dict[str, Any]:
    outcome = entry.outcomes[-1]
    # per batch of prompts the median over repetitions, summed: a slow phase of a shared machine during one
    # repetition of one batch does not leak into the result
    wall = sum(statistics.median(values) for values in entry.chunk_seconds.values())
    cpu = sum(statistics.median(values) for values in entry.chunk_cpu_seconds.values())
    return {
        "method": method.name,
        "batch_size": batch_size,
        "tokens_per_s": outcome.new_tokens / wall if wall > 0 else None,
        "wall_s": wall,
        "wall_s_repetitions": entry.seconds,
        "speedup_repetitions": entry.speedups,
        "cpu_s": cpu,
        "tokens_per_cpu_s": outcome.new_tokens / cpu if cpu > 0 else None,
        "num_prompts": len(outcome.tokens),
        "new_tokens": outcome.new_tokens,
        "mean_accepted": outcome.mean_accepted(method),
        "target_forwards": outcome.target_forwards,
        "draft_forwards": outcome.draft_forwards,
        "draft_lookahead": outcome.draft_lookahead,
        "matches_plain": None if method.name == "plain" else entry.mismatched_prompts == 0,
        "near_ties": entry.equivalence["near_tie"] if entry.equivalence else None,
        "mismatches": entry.equivalence["mismatch"] if entry.equivalence else None,
        "mismatched_prompts": None if method.name == "plain" else entry.mismatched_prompts,
        "mismatched_tokens": None if method.name == "plain" else entry.mismatched_tokens,
        "rows_one_at_a_time": not method.batched and batch_size > 1,
        "equivalence": entry.equivalence,
        "active_seconds": _active_seconds(entry.outcomes),
        "reused_tokens": outcome.reused_tokens if method.reuse else None,
        "copied_tokens": outcome.copied_tokens if method.kind == "dynspec" else None,
        "accepted_tokens": sum(a * n for a, n in outcome.accepted.items()) if method.kind == "dynspec" else None,
        **({"rows": outcome.tokens} if keep_rows else {}),
        **{name: outcome.times.get(name) if method.kind == "dynspec" else None for name in TIME_FIELDS},
    }


def _active_seconds(outcomes: list[Outcome]) -> dict[str, float] | None:
    """Seconds spent while 8+, 2-7 and 1 rows were active (`rollout.BUCKETS`), summed over a repetition's calls,
    median over repetitions; `None` without timelines."""
    if not outcomes or not outcomes[0].timelines:
        return None
    per_repetition = []
    for outcome in outcomes:
        calls = [bucket_seconds(timeline) for timeline in outcome.timelines]
        per_repetition.append({name: sum(call[name] for call in calls) for name in BUCKETS})
    return median_buckets(per_repetition)


def _same_lengths_speedups(nospec: _Measured, entry: _Measured) -> list[float]:
    """Per repetition, the seconds the loop without speculation would have taken to write this method's rows (their
    lengths, call by call; `rollout.matched_seconds`, its forwards priced from its own repetitions) over the method's
    seconds: its speedup over that loop at the same lengths."""
    start, by_rows = forward_seconds([timeline for outcome in nospec.outcomes for timeline in outcome.timelines])
    speedups = []
    for outcome, seconds in zip(entry.outcomes, entry.seconds):
        lengths, calls = [len(row) for row in outcome.tokens], []
        for timeline in outcome.timelines:  # a call's rows follow the previous call's; its first forward holds them all
            calls.append(lengths[: timeline[0][1]])
            lengths = lengths[timeline[0][1] :]
        speedups.append(sum(matched_seconds(call, start, by_rows) for call in calls) / seconds)
    return speedups


def _trace(method: Method, batch_size: int, entry: _Measured) -> dict[str, Any]:
    outcome = entry.outcomes[-1]
    return {
        "method": method.name,
        "batch_size": batch_size,
        "accepted_histogram": {str(k): v for k, v in sorted(Counter(outcome.accepted).items())},
        "steps": outcome.steps,
    }


def _config_dict(settings: BenchSettings, prompts: list[list[int]], budgets: list[int] | None) -> dict[str, Any]:
    config = dataclasses.asdict(settings)
    config["batch_size_prompts"] = {str(k): v for k, v in settings.batch_size_prompts.items()}
    for role in ("target", "draft"):
        limits = getattr(settings, f"{role}_max_memory")
        config[f"{role}_max_memory"] = {str(k): v for k, v in limits.items()} if limits else None
    config["prompt_lengths"] = [len(p) for p in prompts]
    config["row_budgets"] = budgets
    config["policy_instances"] = "one per dynspec method, reused across batches, batch sizes and repetitions"
    return config


# ---- loading -------------------------------------------------------------------------------------------------------
def load_inputs(settings: BenchSettings, need_draft: bool = True):
    """`(target, draft, prompt token ids)` for `settings` (tiny random models and prompts when `settings.tiny`)."""
    from .data import random_token_prompts

    count = max(settings.prompts_for(b) for b in settings.batch_sizes) // settings.samples_per_prompt
    if settings.tiny:
        from .tiny import TINY_VOCAB, tiny_pair

        target, draft = tiny_pair(settings.seed)
        # tiny models are built in float32 (what `auto` gives for them); quantization and offload do not apply
        requested = {role: getattr(settings, f"{role}_dtype") or settings.dtype for role in ("target", "draft")}
        dtypes = {"auto": torch.float32, **DTYPES}
        target, draft = target.to(dtypes[requested["target"]]), draft.to(dtypes[requested["draft"]])
        settings.loaded_models = {
            role: {"dtype_requested": requested[role], "dtype": str(model.dtype).removeprefix("torch.")}
            for role, model in (("target", target), ("draft", draft))
        }
        prompts = random_token_prompts(settings.prompt_offset + count, TINY_VOCAB, seed=settings.seed)
        return target, draft, _samples(prompts[settings.prompt_offset :], settings.samples_per_prompt)
    from .models import load_model, load_tokenizer, resolve_model

    target_name, target_options = settings.load_options("target")
    target_location = resolve_model(target_name)
    tokenizer = load_tokenizer(target_location)
    prompts = _samples(prompt_ids(settings, tokenizer, count), settings.samples_per_prompt)
    draft = None
    if need_draft and settings.draft:
        draft_name, draft_options = settings.load_options("draft")
        draft = load_model(resolve_model(draft_name), draft_options)
        settings.loaded_models["draft"] = draft.hf_dynspec_load
    target = load_model(target_location, target_options)
    settings.loaded_models["target"] = target.hf_dynspec_load
    return target, draft, prompts


def _samples(prompts: list[list[int]], copies: int) -> list[list[int]]:
    """Each prompt `copies` times in adjacent rows (TRL's layout of a prompt's `num_generations` samples)."""
    return [prompt for prompt in prompts for _ in range(copies)]


def target_tokenizer(settings: BenchSettings) -> Any:
    """The bench target's tokenizer (methods that draft through text pass it to `generate`)."""
    from .models import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(settings.load_options("target")[0]))


def prompt_ids(settings: BenchSettings, tokenizer: Any, count: int) -> list[list[int]]:
    """Token ids of the dataset's first `count` prompts after `prompt_offset` that fit in `max_prompt_tokens`."""
    from .data import encode, load_prompts

    source = load_prompts(settings.dataset, 4 * count + 8, offset=settings.prompt_offset)
    prompts = encode(source, tokenizer, settings.max_prompt_tokens)[:count]
    if len(prompts) < count:
        raise ValueError(
            f"Only {len(prompts)} prompts of {settings.dataset!r} after the first {settings.prompt_offset} fit in "
            f"{settings.max_prompt_tokens} tokens; lower --num-prompts or --prompt-offset, or raise --max-prompt-tokens."
        )
    return prompts


FOREIGN_TEXTS = 256
"""Texts of another task that fill the suffix cache of `+foreign` methods (the cache's default output bound)."""


def foreign_texts(settings: BenchSettings) -> list[list[int]]:
    """Token ids of another task's texts for `+foreign` methods: ShareGPT chat when the bench's dataset is code,
    HumanEval code otherwise (prompt texts, without a chat template); random tokens for tiny models."""
    from .data import load_prompts, random_token_prompts

    if settings.tiny:
        from .tiny import TINY_VOCAB

        return random_token_prompts(FOREIGN_TEXTS, TINY_VOCAB, 16, 128, seed=settings.seed + 1)
    other = "sharegpt" if settings.dataset in ("humaneval", "codeedit", "agent", "tools", "followups") else "humaneval"
    tokenizer = target_tokenizer(settings)
    texts = [p.text or "\n".join(m["content"] for m in p.messages) for p in load_prompts(other, FOREIGN_TEXTS)]
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


def load_variant_drafts(
    settings: BenchSettings, variants: list[str], draft: torch.nn.Module | None = None
) -> dict[str, torch.nn.Module]:
    """The bench's draft loaded once per variant in `variants` (`models.VARIANTS`), recorded in `loaded_models` as
    `draft/<variant>`. A tiny `draft` takes the dtype variants only (a copy in that dtype)."""
    from .models import VARIANTS, load_model, resolve_model

    drafts: dict[str, torch.nn.Module] = {}
    for variant in variants:
        if settings.tiny:
            if set(VARIANTS[variant]) != {"dtype"} or draft is None:
                raise ValueError(f"Tiny drafts take dtype variants only (fp32, bf16), not {variant!r}.")
            drafts[variant] = copy.deepcopy(draft).to(DTYPES[VARIANTS[variant]["dtype"]])
            record = {"dtype": VARIANTS[variant]["dtype"]}
        else:
            if not settings.draft:
                raise ValueError(f"The draft variant {variant!r} needs a draft model (--draft).")
            name, options = settings.load_options("draft")
            drafts[variant] = load_model(resolve_model(name), options.with_variant(VARIANTS[variant]))
            record = drafts[variant].hf_dynspec_load
        settings.loaded_models[f"draft/{variant}"] = record
    return drafts
