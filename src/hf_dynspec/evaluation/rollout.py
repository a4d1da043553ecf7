"""The rollout scenario's view of a run: how many rows are still generating over time, and where the time goes.

An RL rollout (TRL's `GRPOTrainer` and the like) samples `G` completions of each prompt in adjacent rows; most end
early and a few run long, so the batch "starts off high and ends up small". Plain `generate` computes every row until
the last one ends; the speculative loop drops rows as they finish, and may speculate. [`ActiveRowsTimeline`] records,
for each target forward of a `generate` call, when it started and how many rows were still generating, so the bench
can say how long each method spent while 8 or more, 2 to 7 and 1 rows were active.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

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


def median_buckets(per_repetition: Sequence[dict[str, float]]) -> dict[str, float]:
    """The median over repetitions of each bucket's seconds."""
    return {name: statistics.median(rep[name] for rep in per_repetition) for name in BUCKETS}


def rollout_table(results: dict[str, Any], baseline: str) -> str:
    """Markdown: per method, wall time, tokens/s, speedup (tokens/s: sampled runs differ in length) over plain and over
    `baseline` (the loop without speculation), and the seconds spent while 8+, 2-7 and 1 rows were active (medians of the repetitions)."""
    runs = [r for r in results["runs"] if r.get("active_seconds")]
    if not runs:
        return ""
    speed = {(r["method"], r["batch_size"]): r["tokens_per_s"] for r in runs}
    lines = [
        "Rollout: where the time goes by active rows (seconds, medians of the repetitions):",
        "",
        "| batch | method | wall s | tokens/s | vs plain | vs " + baseline + " | " + " | ".join(
            f"{name} rows s" for name in BUCKETS) + " |",
        "| ---: | --- | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in BUCKETS) + " |",
    ]
    for run in sorted(runs, key=lambda r: r["batch_size"]):
        key = run["batch_size"]
        bases = [speed.get((name, key)) for name in ("plain", baseline)]
        cells = [f"{run['tokens_per_s'] / base:.2f}x" if base else "–" for base in bases]
        buckets = " | ".join(f"{run['active_seconds'][name]:.1f}" for name in BUCKETS)
        lines.append(f"| {key} | {run['method']} | {run['wall_s']:.1f} | {run['tokens_per_s']:.2f} | "
                     f"{cells[0]} | {cells[1]} | {buckets} |")
    return "\n".join(lines)
