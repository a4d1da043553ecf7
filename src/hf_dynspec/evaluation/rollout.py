"""The rollout scenario's view of a run: how many rows are still generating over time, and where the time goes.

An RL rollout (TRL's `GRPOTrainer` and the like) samples `G` completions of each prompt in adjacent rows; most end
early and a few run long, so the batch "starts off high and ends up small". Plain `generate` computes every row until
the last one ends; the speculative loop drops rows as they finish, and may speculate. [`ActiveRowsTimeline`] records,
for each target forward of a `generate` call, when it started and how many rows were still generating, so the bench
can say how long each method spent while 8 or more, 2 to 7 and 1 rows were active.

Sampled methods write rows of other lengths (speculation draws its random numbers differently), and with a few
prompts one long row moves a repetition's time by tens of percent. To compare one repetition with the loop without
speculation at the *same* lengths, [`forward_seconds`] prices that loop's forwards by active rows from its own
timelines (it writes one token per active row and forward), and [`matched_seconds`] adds up what it would have
spent on a repetition's lengths.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel

from ..cache import cache_kwarg
from ..packing import PackedCache

BUCKETS = {"8+": (8, None), "2-7": (2, 7), "1": (1, 1)}
"""Active-row ranges the report splits a run's time into (inclusive bounds; `None`: no upper bound)."""


class ActiveRowsTimeline:
    """Start time and batch rows of every forward of the target (a forward pre-hook on its decoder)."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.starts: list[float] = []
        self.rows: list[int] = []
        self._handle = model.get_decoder().register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        self.starts.append(time.perf_counter())
        self.rows.append(_forward_rows(module, args, kwargs))

    def take(self, start: float, end: float, lengths: Sequence[int] | None = None) -> list[tuple[float, int]]:
        """The call's forwards as `(seconds since start, active rows)`, then `(end - start, 0)`; clears the record.

        Args:
            lengths: with plain `generate`, which computes finished rows too, each row's generated tokens: forward `i`
                computes token `i + 1`, which only rows with more than `i` tokens needed. Without it, the forward's
                own batch rows are the active rows (the loop drops rows as they finish).
        """
        starts = [begin for begin in self.starts if begin >= start]  # forwards of this call only
        rows = self.rows[len(self.starts) - len(starts) :]
        if lengths is not None:
            rows = [sum(n > i for n in lengths) for i in range(len(starts))]
        timeline = [(begin - start, active) for begin, active in zip(starts, rows)] + [(end - start, 0)]
        self.starts, self.rows = [], []
        return timeline

    def remove(self) -> None:
        self._handle.remove()


def _forward_rows(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> int:
    """Batch rows of a decoder forward; a packed verify forward (`hf_dynspec.packing`) feeds all rows as one sequence
    (`[1, total]`), so its rows are those of its packing."""
    cache = kwargs.get(cache_kwarg(type(module).forward))
    if isinstance(cache, PackedCache):
        return cache.packing.batch
    inputs = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
    if inputs is None and args:
        inputs = args[0]
    return int(inputs.shape[0]) if inputs is not None else 0


def bucket_seconds(timeline: Sequence[tuple[float, int]]) -> dict[str, float]:
    """Seconds of a call's timeline spent while each of `BUCKETS`' row counts was active (a forward's active rows
    hold from its start to the next forward's start: drafting for that forward counts with it)."""
    seconds = dict.fromkeys(BUCKETS, 0.0)
    for (begin, active), (end, _) in zip(timeline, timeline[1:]):
        for name, (low, high) in BUCKETS.items():
            if active >= low and (high is None or active <= high):
                seconds[name] += end - begin
    return seconds


def forward_seconds(timelines: Sequence[Sequence[tuple[float, int]]]) -> tuple[float, dict[int, float]]:
    """From calls of the loop without speculation (`ActiveRowsTimeline.take`'s timelines): the median seconds from a
    call's start to its second forward (set-up and prefill), and by active rows the median seconds of a later
    forward (until the next one starts, or the call ends)."""
    starts, by_rows = [], defaultdict(list)
    for timeline in timelines:
        if len(timeline) < 3:
            continue
        starts.append(timeline[1][0])
        for (begin, active), (end, _) in zip(timeline[1:], timeline[2:]):
            by_rows[active].append(end - begin)
    if not starts:
        raise ValueError("No timeline of a call with two forwards or more: nothing to price the forwards by.")
    return statistics.median(starts), {rows: statistics.median(spans) for rows, spans in sorted(by_rows.items())}


def matched_seconds(lengths: Sequence[int], start: float, by_rows: dict[int, float]) -> float:
    """Seconds the loop without speculation would take to write one call's rows of `lengths` tokens: `start` (set-up
    and the prefill, which gives every row its first token), then forward `i` over the rows with more than `i`
    tokens, priced by `by_rows` (`forward_seconds`; linear between measured row counts, the nearest beyond them)."""
    rows = np.array(list(by_rows), dtype=float)  # [measured row counts], ascending
    seconds = np.array(list(by_rows.values()), dtype=float)
    lengths = np.asarray(lengths)  # [rows]
    active = (lengths[None, :] > np.arange(1, max(lengths, default=0))[:, None]).sum(axis=1)  # [forwards]
    return float(start + np.interp(active, rows, seconds).sum())


def median_buckets(per_repetition: Sequence[dict[str, float]]) -> dict[str, float]:
    """The median over repetitions of each bucket's seconds."""
    return {name: statistics.median(rep[name] for rep in per_repetition) for name in BUCKETS}


def rollout_table(results: dict[str, Any], baseline: str) -> str:
    """Markdown: per method, wall time, tokens/s, speedup (tokens/s: sampled runs differ in length) over plain and over
    `baseline` (the loop without speculation), the lowest and highest speedup over `baseline` at the same lengths in
    one repetition (`matched_seconds`), and the seconds spent while 8+, 2-7 and 1 rows were active (medians of the
    repetitions)."""
    runs = [r for r in results["runs"] if r.get("active_seconds")]
    if not runs:
        return ""
    speed = {(r["method"], r["batch_size"]): r["tokens_per_s"] for r in runs}
    lines = [
        "Rollout: where the time goes by active rows (seconds, medians of the repetitions):",
        "",
        "| batch | method | wall s | tokens/s | vs plain | vs " + baseline + " | same lengths, per repetition | "
        + " | ".join(f"{name} rows s" for name in BUCKETS) + " |",
        "| ---: | --- | ---: | ---: | ---: | ---: | --- | " + " | ".join("---:" for _ in BUCKETS) + " |",
    ]
    for run in sorted(runs, key=lambda r: r["batch_size"]):
        key = run["batch_size"]
        bases = [speed.get((name, key)) for name in ("plain", baseline)]
        cells = [f"{run['tokens_per_s'] / base:.2f}x" if base else "–" for base in bases]
        matched = run.get("vs_nospec_same_lengths")
        cells.append(f"{min(matched):.2f} – {max(matched):.2f}x" if matched else "–")
        buckets = " | ".join(f"{run['active_seconds'][name]:.1f}" for name in BUCKETS)
        lines.append(f"| {key} | {run['method']} | {run['wall_s']:.1f} | {run['tokens_per_s']:.2f} | "
                     f"{' | '.join(cells)} | {buckets} |")
    return "\n".join(lines)
