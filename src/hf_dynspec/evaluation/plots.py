"""PNG plots of benchmark results: speedup over `plain` by batch size, accepted-token histogram, draft length over time,
and (rollouts) rows still generating over time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def speedup_table(results: dict[str, Any]) -> dict[str, dict[int, float]]:
    """`{method: {batch_size: tokens_per_s / plain's tokens_per_s}}` for every non-plain method."""
    plain = {r["batch_size"]: r["tokens_per_s"] for r in results["runs"] if r["method"] == "plain"}
    table: dict[str, dict[int, float]] = {}
    for run in results["runs"]:
        base = plain.get(run["batch_size"])
        if run["method"] != "plain" and base and run["tokens_per_s"]:
            table.setdefault(run["method"], {})[run["batch_size"]] = run["tokens_per_s"] / base
    return table


def plot_speedup(results: dict[str, Any], path: Path) -> Path:
    """Speedup over plain (y) by batch size (x), one line per method."""
    figure, axes = plt.subplots(figsize=(6, 4))
    for method, by_batch in speedup_table(results).items():
        sizes = sorted(by_batch)
        axes.plot(sizes, [by_batch[s] for s in sizes], marker="o", label=method)
    axes.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("batch size")
    axes.set_ylabel("speedup over plain (tokens/s)")
    axes.legend(fontsize=8)
    return _save(figure, path)


def plot_acceptance(results: dict[str, Any], path: Path) -> Path:
    """Histogram of accepted draft tokens per row-step, one group of bars per (dynspec method, batch size)."""
    traces = [t for t in results.get("traces", []) if t["accepted_histogram"]]
    figure, axes = plt.subplots(figsize=(6, 4))
    width = 0.8 / max(1, len(traces))
    for index, trace in enumerate(traces):
        counts = {int(k): v for k, v in trace["accepted_histogram"].items()}
        total = sum(counts.values())
        keys = sorted(counts)
        axes.bar([k + index * width for k in keys], [counts[k] / total for k in keys], width=width,
                 label=f"{trace['method']} @ {trace['batch_size']}")
    axes.set_xlabel("accepted draft tokens in a step")
    axes.set_ylabel("fraction of row-steps")
    if traces:
        axes.legend(fontsize=8)
    return _save(figure, path)


def plot_draft_lengths(results: dict[str, Any], path: Path) -> Path:
    """Mean draft length per step (solid) and active batch size (dotted, right axis) over the steps of a run."""
    figure, axes = plt.subplots(figsize=(7, 4))
    batch_axes = axes.twinx()
    for trace in results.get("traces", []):
        steps = trace["steps"]
        if not steps:
            continue
        label = f"{trace['method']} @ {trace['batch_size']}"
        (line,) = axes.plot([s["mean_draft_length"] for s in steps], label=label, linewidth=1)
        batch_axes.plot([s["batch_size"] for s in steps], linestyle=":", color=line.get_color(), linewidth=1)
    axes.set_xlabel("step (all generate calls of the last repetition, in order)")
    axes.set_ylabel("mean draft length")
    batch_axes.set_ylabel("active rows (dotted)")
    if axes.lines:
        axes.legend(fontsize=8)
    return _save(figure, path)


def write_plots(results: dict[str, Any], directory: str | Path) -> list[Path]:
    """Every plot as a PNG file in `directory` (created if needed): speedup, acceptance, draft lengths, and active rows
    over time when the runs recorded timelines."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = [
        plot_speedup(results, directory / "speedup.png"),
        plot_acceptance(results, directory / "acceptance.png"),
        plot_draft_lengths(results, directory / "draft_length.png"),
    ]
    if any(entry["calls"] for entry in results.get("timelines", [])):
        paths.append(plot_active_rows(results, directory / "active_rows.png"))
    return paths


def plot_active_rows(results: dict[str, Any], path: Path) -> Path:
    """Active rows (y) over seconds (x) of each method's first `generate` call of the last repetition, one step line
    per (method, batch size): how fast each method gets through the batch and its long tail."""
    figure, axes = plt.subplots(figsize=(7, 4))
    for entry in results.get("timelines", []):
        if not entry["calls"]:
            continue
        seconds, rows = zip(*entry["calls"][0])
        label = entry["method"] if len({e["batch_size"] for e in results["timelines"]}) == 1 else (
            f"{entry['method']} @ {entry['batch_size']}")
        axes.step(seconds, rows, where="post", label=label)
    axes.set_xlabel("seconds since the call started")
    axes.set_ylabel("rows still generating")
    axes.legend(fontsize=8)
    return _save(figure, path)


def _save(figure: Any, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
