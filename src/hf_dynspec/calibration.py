"""Measure a target/draft pair's step costs on this machine (a [`Profile`]) and derive a vLLM batch table from it.

What is timed mirrors one step of the loop: a target forward over `batch_size` rows of `tokens_per_row` new tokens
(`1 + k`: the last token and `k` draft tokens) and a draft forward over `batch_size` rows of one new token, both on
top of a KV cache of `context_length` tokens per row, which is cropped back after every forward so each repeat sees
the same cache. Each point is run `warmup` times untimed, then `repeats` times; the profile keeps every sample and
their median (the machine may be shared: the median ignores the odd slow run).
"""

from __future__ import annotations

import datetime
import math
import platform
import statistics
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from .cache import cache_kwarg, loop_cache, sliding_windows
from .clocks import time_call
from .cost_models import DraftTiming, PaddedCostModel, Profile, ProfileCostModel, TargetTiming
from .devices import cuda_devices, input_device
from .estimators import expected_tokens
from .kernels import NARROW_LINEAR, LinearPlan, linear_plan, narrow_linear, narrow_rows, row_major_output
from .policies.batch_table import BatchTablePolicy


@dataclass
class CalibrationSettings:
    """What `calibrate` measures."""

    batch_sizes: list[int] = field(
        default_factory=lambda: [1, 2, 4, 8, 16, 32], metadata={"help": "Batch sizes to time (increasing)."}
    )
    tokens_per_row: list[int] = field(
        default_factory=lambda: [1, 2, 3, 5, 9],
        metadata={"help": "New tokens per row in a target forward (1 + draft length); must include 1."},
    )
    context_length: int = field(default=256, metadata={"help": "Tokens per row already in the KV cache."})
    warmup: int = field(default=2, metadata={"help": "Untimed runs before each measured point."})
    repeats: int = field(default=5, metadata={"help": "Timed runs per point (the profile keeps their median)."})
    seed: int = field(default=0, metadata={"help": "Seed of the random token ids fed to the models."})
    narrow_linear: str = field(
        default="auto",
        metadata={"help": "Time forwards as the loop runs them under this `DynSpecConfig.narrow_linear` setting."},
    )

    def __post_init__(self) -> None:
        for name in ("batch_sizes", "tokens_per_row"):
            values = getattr(self, name)
            if not isinstance(values, (list, tuple)) or not values:
                raise ValueError(f"`{name}` must be a non-empty list of integers >= 1, got {values!r}.")
            if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"`{name}` must hold integers >= 1 only, got {values!r}.")
            if list(values) != sorted(set(values)):
                raise ValueError(f"`{name}` must be strictly increasing without repeats, got {values!r}.")
        if self.tokens_per_row[0] != 1:
            raise ValueError(f"`tokens_per_row` must include 1 (the plain decoding step), got {self.tokens_per_row!r}.")
        if self.narrow_linear not in NARROW_LINEAR:
            raise ValueError(f"`narrow_linear` must be one of {list(NARROW_LINEAR)}, got {self.narrow_linear!r}.")
        for name, minimum in (("context_length", 1), ("warmup", 0), ("repeats", 1), ("seed", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value!r}.")


class _CachedForward:
    """Forwards of `tokens_per_row` random tokens on top of a fixed `context_length`-token KV cache, with linear
    layers over up to `narrow_rows` rows computed weight-first (or as a `kernels.LinearPlan` says), as the loop
    computes them (`kernels.NarrowLinear`)."""

    def __init__(
        self,
        model: PreTrainedModel,
        batch_size: int,
        context_length: int,
        generator: torch.Generator,
        narrow_rows: int | LinearPlan = 0,
    ):
        self.model, self.narrow_rows = model, narrow_rows
        self.device = input_device(model)  # works for offloaded models too (their embeddings may sit on `meta`)
        self.devices = cuda_devices(model)  # what timing a forward waits for
        self.vocab = int(model.config.vocab_size)
        self.batch_size, self.context_length, self.generator = batch_size, context_length, generator
        self.cache = loop_cache(model, sliding_windows(model, "model"))  # as the loop keeps it: croppable
        self.cache_key = cache_kwarg(model.forward)
        with torch.inference_mode():
            self._forward(self.context_length, offset=0, keep=1)

    def __call__(self, tokens_per_row: int, keep: int) -> None:
        """One timed forward (logits of the last `keep` positions), then the cache is cut back to the context."""
        with torch.inference_mode():
            self._forward(tokens_per_row, offset=self.context_length, keep=keep)
        self.cache.crop(-tokens_per_row)

    def _forward(self, width: int, offset: int, keep: int) -> None:
        ids = torch.randint(self.vocab, (self.batch_size, width), generator=self.generator).to(self.device)
        positions = (offset + torch.arange(width)).unsqueeze(0).expand(self.batch_size, -1).to(self.device)
        mask = torch.ones((self.batch_size, offset + width), dtype=torch.long, device=self.device)
        with narrow_linear(self.narrow_rows), row_major_output(self.model):  # the kernels the loop runs
            self._call(ids, mask, positions, keep)

    def _call(self, ids: torch.LongTensor, mask: torch.LongTensor, positions: torch.LongTensor, keep: int) -> None:
        cache = {self.cache_key: self.cache}
        self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=keep, **cache)


LOOKAHEAD_WIDTHS = (2, 3, 5, 9, 17, 33)
"""Forward widths (the newest token plus guess tokens) `affordable_lookahead` times, besides one token and the widest
the lookahead allows."""

LOOKAHEAD_ROUNDS = 3
"""Rounds of `affordable_lookahead`'s timing: each times every width once, and a width is worth its fastest sample."""

LOOKAHEAD_CONTEXT = 32
"""Cached tokens under the forwards `affordable_lookahead` times (attention over them is cheap at any width)."""

_AFFORDABLE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""`affordable_lookahead` results per model: `{(most, max_cost, linear plan, threads, base): guess tokens}`."""

WidthTimer = Callable[[int], float]
"""`timer(width)`: seconds of one forward over `width` new tokens at batch size 1."""


def affordable_lookahead(
    model: PreTrainedModel,
    most: int,
    max_cost: float,
    narrow: int | LinearPlan = 0,
    timer: WidthTimer | None = None,
    base: int = 1,
) -> int:
    """The most guess tokens (at most `most`) a lookahead forward of `model` may carry and cost at most `max_cost`
    times the forward it rides on, over `base` tokens (`DynSpecConfig.draft_lookahead_max_cost`): a chain's forward
    feeds one token, a tree's feeds its frontier of `branching` nodes.

    Times forwards over `base` tokens and over `base + g` tokens for `g + 1` in `LOOKAHEAD_WIDTHS` up to `1 + most`
    (and `most` itself), at batch size 1 on a `LOOKAHEAD_CONTEXT`-token cache, with linear layers computed as the loop
    computes them (`narrow`: the model's `kernels.LinearPlan`, or weight-first up to that many rows). After one
    untimed pass over all widths, `LOOKAHEAD_ROUNDS` rounds each time every width once, and a width is worth its
    fastest sample: other processes only ever slow a forward down, and a burst of load shorter than the rounds leaves
    every width a clean sample, where timing one width's samples back to back could price that width alone at the
    burst's speed. Returns the widest `g` within the cost at that width and every narrower one, 0 when one guess token
    already costs more. Measured once per process, model, setting and `base`; `timer` (seconds of one forward over
    `width` tokens) measures anew (for tests).
    """
    if not isinstance(base, int) or base < 1:
        raise ValueError(f"`base` must be an int >= 1 (the tokens a forward feeds besides guesses), got {base!r}.")
    plan = narrow if isinstance(narrow, LinearPlan) else LinearPlan(narrow)  # an int and its plan: one key
    key = (most, max_cost, plan, torch.get_num_threads(), base)
    cached = _AFFORDABLE.setdefault(model, {})
    if key not in cached or timer is not None:
        guesses = sorted({w - 1 for w in LOOKAHEAD_WIDTHS if w - 1 <= most} | {most}) if most > 0 else []
        widths = [base + g for g in guesses]
        cached[key] = _widest_within(widths, max_cost, timer or _width_timer(model, plan, [base, *widths]), base)
    return cached[key]


def _widest_within(widths: Sequence[int], max_cost: float, timer: WidthTimer, base: int = 1) -> int:
    """The widest of `widths` (minus the `base` tokens) whose forward, and every narrower one's, costs at most
    `max_cost` times one over `base` tokens; each width priced at its fastest sample over `LOOKAHEAD_ROUNDS`
    interleaved rounds."""
    samples: dict[int, list[float]] = {width: [] for width in (base, *widths)}
    for _ in range(LOOKAHEAD_ROUNDS):
        for width, timed in samples.items():
            timed.append(timer(width))
    floor = min(samples[base])
    affordable = 0
    for width in widths:
        if min(samples[width]) > max_cost * floor:
            break
        affordable = width - base
    return affordable


def _width_timer(model: PreTrainedModel, narrow: int | LinearPlan, widths: Sequence[int]) -> WidthTimer:
    """`timer(width)`: seconds of one batch-1 forward over `width` tokens, after one untimed pass over `widths`."""
    forward = _CachedForward(model, 1, LOOKAHEAD_CONTEXT, torch.Generator().manual_seed(0), narrow)
    for width in widths:
        forward(width, keep=width)
    return lambda width: time_call(partial(forward, width, width), warmup=0, repeats=1, devices=forward.devices)[0]


def _time_forwards(
    model: PreTrainedModel,
    batch_size: int,
    tokens_per_row: Sequence[int],
    settings: CalibrationSettings,
    generator: torch.Generator,
    bar: tqdm,
) -> list[tuple[int, list[float]]]:
    """`[(tokens, samples)]`: seconds of forwards of `tokens` new tokens per row, each after `warmup` untimed runs."""
    plan = linear_plan(model, settings.narrow_linear)
    forward = _CachedForward(model, batch_size, settings.context_length, generator, plan)
    timed = []
    for tokens in tokens_per_row:
        samples = time_call(partial(forward, tokens, tokens), settings.warmup, settings.repeats, forward.devices)
        timed.append((tokens, samples))
        bar.update()
    return timed


def calibrate(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    settings: CalibrationSettings | None = None,
    target_name: str = "",
    draft_name: str = "",
    progress: bool = True,
) -> Profile:
    """Time the pair's forwards (tqdm progress bar unless `progress=False`) and return the [`Profile`]."""
    settings = settings or CalibrationSettings()
    generator = torch.Generator().manual_seed(settings.seed)
    target_timings: list[TargetTiming] = []
    draft_timings: list[DraftTiming] = []
    total = len(settings.batch_sizes) * (len(settings.tokens_per_row) + 1)
    with tqdm(total=total, desc="calibrating", unit="point", disable=not progress) as bar:
        for batch_size in settings.batch_sizes:
            bar.set_postfix(model="target", batch=batch_size)
            timed = _time_forwards(target, batch_size, settings.tokens_per_row, settings, generator, bar)
            target_timings += [TargetTiming(batch_size, t, statistics.median(s), s) for t, s in timed]
            bar.set_postfix(model="draft", batch=batch_size)
            [(_, samples)] = _time_forwards(draft, batch_size, [1], settings, generator, bar)
            draft_timings.append(DraftTiming(batch_size, statistics.median(samples), samples))
    return Profile(
        target_forward=target_timings,
        draft_forward=draft_timings,
        target=target_name,
        draft=draft_name,
        device=str(input_device(target)),
        dtype=str(target.dtype).replace("torch.", ""),
        context_length=settings.context_length,
        warmup=settings.warmup,
        repeats=settings.repeats,
        narrow_rows={role: narrow_rows(model, settings.narrow_linear) for role, model in (("target", target), ("draft", draft))},
        created=f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')} on {platform.node()}",
    )


def uniform_draft_length(cost_model: PaddedCostModel, batch_size: int, acceptance: float, max_draft_tokens: int) -> int:
    """The draft length `goodput` picks when every one of `batch_size` rows has acceptance `acceptance`.

    Under the padded cost every row may as well draft the longest length, so this is
    `argmax_K batch * E(a, K) / C(batch, K)` over `K = 0 .. max_draft_tokens` (ties: the shorter length).
    """
    lengths = torch.arange(max_draft_tokens + 1)
    tokens = batch_size * expected_tokens(torch.full((max_draft_tokens + 1,), float(acceptance)), lengths).numpy()
    seconds = cost_model.padded_seconds(batch_size, lengths.numpy())
    return int(np.argmax(tokens / seconds))


def vllm_speculative_config(
    profile: Profile,
    acceptance: float,
    num_speculative_tokens: int,
    max_batch_size: int = 256,
    method: str | None = "draft_model",
    model: str | None = None,
) -> dict[str, Any]:
    """vLLM's `--speculative-config` with `num_speculative_tokens_per_batch_size` derived from `profile`.

    Every batch size `1 .. max_batch_size` gets `uniform_draft_length` under the profile's cost model (beyond the
    calibrated batch sizes the cost model extrapolates linearly); consecutive batch sizes with the same length are
    merged into one `[start_bs, end_bs, k]` range. Choose `max_batch_size` at least vLLM's `max_num_seqs`: vLLM reuses
    the last range's `k` above the table, while the `batch_table` policy here drafts the maximum there.
    """
    if not isinstance(acceptance, (int, float)) or not 0.0 <= acceptance <= 1.0 or math.isnan(acceptance):
        raise ValueError(f"`acceptance` must be a number in [0, 1], got {acceptance!r}.")
    if isinstance(num_speculative_tokens, bool) or not isinstance(num_speculative_tokens, int) or num_speculative_tokens < 1:
        raise ValueError(f"`num_speculative_tokens` must be an integer >= 1, got {num_speculative_tokens!r}.")
    if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise ValueError(f"`max_batch_size` must be an integer >= 1, got {max_batch_size!r}.")
    cost_model = ProfileCostModel(profile)
    table: list[list[int]] = []
    for batch_size in range(1, max_batch_size + 1):
        k = uniform_draft_length(cost_model, batch_size, acceptance, num_speculative_tokens)
        if table and table[-1][2] == k:
            table[-1][1] = batch_size
        else:
            table.append([batch_size, batch_size, k])
    policy = BatchTablePolicy(num_speculative_tokens, table)
    return policy.to_vllm_config(method=method, model=model if model is not None else profile.draft or None)


def parse_int_list(text: str, name: str) -> list[int]:
    """`"1,2,4"` -> `[1, 2, 4]`; a clear error naming `name` otherwise."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise ValueError(f"{name} must be comma-separated integers such as 1,2,4, got {text!r}.") from error
    if not values:
        raise ValueError(f"{name} must list at least one integer, got {text!r}.")
    return values


def summarize(profile: Profile, batch_sizes: Sequence[int] | None = None) -> str:
    """A short text table of the profile's median milliseconds."""
    tokens = sorted({t.tokens_per_row for t in profile.target_forward})
    sizes = sorted({t.batch_size for t in profile.target_forward}) if batch_sizes is None else list(batch_sizes)
    target = {(t.batch_size, t.tokens_per_row): t.seconds for t in profile.target_forward}
    draft = {t.batch_size: t.seconds for t in profile.draft_forward}
    header = "batch | " + " | ".join(f"target t={t}" for t in tokens) + " | draft (ms)"
    lines = [header]
    for b in sizes:
        cells = [f"{target[(b, t)] * 1e3:.1f}" if (b, t) in target else "-" for t in tokens]
        draft_cell = f"{draft[b] * 1e3:.1f}" if b in draft else "-"
        lines.append(f"{b:5d} | " + " | ".join(cells) + f" | {draft_cell}")
    return "\n".join(lines)

