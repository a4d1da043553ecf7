"""Markdown tables of benchmark results."""

from __future__ import annotations

from typing import Any

from .plots import speedup_table


def _number(value: float | int | None, digits: int = 2) -> str:
    if value is None:
        return "–"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def markdown_table(results: dict[str, Any]) -> str:
    """One row per (batch size, method): throughput, speedup over plain, work done and agreement with plain."""
    speedups = speedup_table(results)
    lines = [
        "| batch | method | tokens/s | speedup | wall s (median) | tokens/CPU-s | new tokens | mean accepted "
        "| target fwd | draft fwd | matches plain |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    sequential = False
    for run in sorted(results["runs"], key=lambda r: r["batch_size"]):
        name = run["method"]
        if run.get("rows_one_at_a_time"):
            name, sequential = name + " †", True
        speedup = 1.0 if run["method"] == "plain" else speedups.get(run["method"], {}).get(run["batch_size"])
        match = {None: "(reference)", True: "yes"}.get(
            run["matches_plain"], f"no ({run.get('mismatched_prompts')} prompts)"
        )
        lines.append(
            f"| {run['batch_size']} | {name} | {_number(run['tokens_per_s'])} | {_number(speedup)}x | "
            f"{_number(run['wall_s'])} | {_number(run.get('tokens_per_cpu_s'))} | {run['new_tokens']} | "
            f"{_number(run['mean_accepted'])} | "
            f"{run['target_forwards']} | {run['draft_forwards']} | {match} |"
        )
    if sequential:
        lines.append("")
        lines.append("† transformers cannot batch assisted generation: these rows ran one at a time.")
    return "\n".join(lines)
