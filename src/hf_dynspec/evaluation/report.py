"""Markdown tables of benchmark results."""

from __future__ import annotations

from typing import Any

from ..config import DynSpecConfig
from .plots import speedup_table
from .runner import TIME_FIELDS

DEFAULT_METHOD = f"dynspec-{DynSpecConfig().policy}"
"""The bench method that runs what `DynSpecConfig()` runs (the package's default policy with its default options)."""


def _number(value: float | int | None, digits: int = 2) -> str:
    if value is None:
        return "–"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _spread(speedups: list[float] | None) -> str:
    """The paired per-repetition speedups, lowest to highest (`1.21 – 1.30x`), or `–` without them."""
    if not speedups:
        return "–"
    return f"{min(speedups):.2f}x" if len(speedups) == 1 else f"{min(speedups):.2f} – {max(speedups):.2f}x"


def _sources(run: dict) -> str:
    """Accepted draft tokens by source: copies (model-free offers) / the draft model; "–" where not recorded."""
    copied, accepted = run.get("copied_tokens"), run.get("accepted_tokens")
    if copied is None or accepted is None:
        return "–"
    return f"{copied} / {accepted - copied}"


def _agreement(run: dict[str, Any], sampled: bool) -> str:
    """`identical / near-tie / mismatch` row counts against plain greedy decoding."""
    if run["method"] == "plain":
        return "(reference)"
    equivalence = run.get("equivalence")
    if equivalence is None:
        return "n/a (sampling)" if sampled else "–"
    return f"{equivalence['identical']} / {equivalence['near_tie']} / {equivalence['mismatch']}"


def markdown_table(results: dict[str, Any]) -> str:
    """One row per (batch size, method): throughput, speedup over plain, work done and agreement with plain.

    The speedup is over the medians; "speedup per repetition" is its spread: the lowest and highest tokens/s over
    plain's in the same repetition (`speedup_repetitions` of the run record).

    Agreement is counted in rows (prompts): identical to plain greedy decoding, differing first at a near tie that
    rounding can flip, or mismatching (see `equivalence.classify`); it does not apply to sampling. When dynspec runs
    recorded their time split, a second table ("where the time goes", `time_table`) follows.
    """
    speedups = speedup_table(results)
    sampled = bool(results.get("config", {}).get("do_sample"))
    lines = [
        "| batch | method | tokens/s | speedup | speedup per repetition | wall s (median) | tokens/CPU-s | new tokens "
        "| mean accepted | accepted copied / drafted | target fwd | draft fwd | identical / near-tie / mismatch |",
        "| ---: | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    sequential = False
    default_marked = False
    options = results.get("config", {}).get("policy_options") or {}
    for run in sorted(results["runs"], key=lambda r: r["batch_size"]):
        name = run["method"]
        if name == DEFAULT_METHOD and DynSpecConfig().policy not in options:
            name, default_marked = name + " *", True
        if run.get("rows_one_at_a_time"):
            name, sequential = name + " †", True
        speedup = 1.0 if run["method"] == "plain" else speedups.get(run["method"], {}).get(run["batch_size"])
        match = _agreement(run, sampled)
        lines.append(
            f"| {run['batch_size']} | {name} | {_number(run['tokens_per_s'])} | {_number(speedup)}x | "
            f"{_spread(run.get('speedup_repetitions'))} | {_number(run['wall_s'])} | {_number(run.get('tokens_per_cpu_s'))} | {run['new_tokens']} | "
            f"{_number(run['mean_accepted'])} | {_sources(run)} | "
            f"{run['target_forwards']} | {run['draft_forwards']} | {match} |"
        )
    if default_marked:
        lines.append("")
        lines.append("* the package's default: what `DynSpecConfig()` runs.")
    if sequential:
        lines.append("")
        lines.append("† transformers cannot batch assisted generation: these rows ran one at a time.")
    if sampled:
        lines.append("")
        lines.append("Sampled runs are not compared token by token with plain: only their distribution is the same.")
    times = time_table(results)
    return "\n".join(lines) + (f"\n\n{times}" if times else "")


def time_table(results: dict[str, Any]) -> str:
    """Where the time goes: the loop's prefill, draft, catch-up, verify and overhead seconds per dynspec run.

    Summed over the `generate` calls of the repetition the other per-run numbers come from; overhead is the loop's
    own bookkeeping (its total minus the other four). Empty when no run recorded these totals.
    """
    runs = [r for r in results["runs"] if r.get("prefill_seconds") is not None]
    if not runs:
        return ""
    lines = [
        "Where the time goes (seconds, last repetition):",
        "",
        "| batch | method | prefill | draft | catch-up | verify | overhead | overhead share |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for run in sorted(runs, key=lambda r: r["batch_size"]):
        parts = [run.get(name) for name in TIME_FIELDS]
        total = sum(p for p in parts if p is not None)
        share = run["overhead_seconds"] / total if total > 0 and run["overhead_seconds"] is not None else None
        cells = " | ".join(_number(p, 3) for p in parts)
        lines.append(f"| {run['batch_size']} | {run['method']} | {cells} | "
                     f"{'–' if share is None else f'{100 * share:.1f}%'} |")
    return "\n".join(lines)


def summary_line(results: dict[str, Any]) -> str:
    """One sentence for a newcomer: the default's speedup over plain `generate` at each batch size, and transformers'
    assisted generation's (`hf-assisted`) beside it, when both ran; empty otherwise."""
    speedups = speedup_table(results)
    default = speedups.get(DEFAULT_METHOD)
    if not default:
        return ""
    sizes = sorted(default)
    ours = ", ".join(f"{default[b]:.2f}x at batch {b}" for b in sizes)
    line = f"Summary: the default ({DEFAULT_METHOD}) ran at {ours} the speed of plain generate"
    assisted = speedups.get("hf-assisted")
    if assisted:
        theirs = ", ".join(f"{assisted[b]:.2f}x at batch {b}" for b in sorted(assisted))
        line += f"; transformers' assisted generation at {theirs}"
    config = results.get("config", {})
    dtype = config.get("loaded_models", {}).get("target", {}).get("dtype")
    where = ", ".join(str(v) for v in (results.get("machine", {}).get("cpu"), dtype) if v)
    repetitions = config.get("repetitions")
    return line + (f" ({where}; medians of {repetitions} repetitions)." if where else ".")
