"""Recomputes the figures of docs/benchmarks.md and the README from the results files in the repository.

Two kinds of figure are checked:

- **Table cells.** A table in docs/benchmarks.md is checked against the tables that the bench's own generators
  (`markdown_table`, `rollout_table`, `serve_table`, `epochs_table`, `overhead_table`,
  `headroom_table`) print for the results files it links: in its
  rows, or else in the text between the section's heading (or the table before it) and the table. A row is found by
  its method (markers such as `*` and bold dropped) and, where the table has them, its batch size and set; every cell
  whose column the generator also prints must read as the generator prints it. Columns the generators do not print
  are computed by the rules in `COLUMNS`.
- **Figures in the text.** `report_figures.FIGURES` lists each figure of the prose, the goals and the README with the
  sentence it stands in and how it is computed from its results file; the sentence, with the computed figures in
  place, must appear in the page. A measured figure (a ratio, a share, a time) that no listed sentence holds, outside
  the checked tables, is a difference too: every figure has its results file.

Usage: `python scripts/check_report.py` or `make report` (exit 1 and one line per difference).
`tests/test_report_figures.py` runs it in the suite, and shows that a figure changed by hand fails it.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from hf_dynspec.evaluation.epochs import epochs_table
from hf_dynspec.evaluation.headroom import headroom_table
from hf_dynspec.evaluation.overhead import overhead_table
from hf_dynspec.evaluation.report import markdown_table
from hf_dynspec.evaluation.rollout import rollout_table
from hf_dynspec.evaluation.serve import serve_table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report_figures import (  # noqa: E402 - the figures beside this script
    FIGURES,
    README,
    REPORT,
    Figure,
    envelope_best,
    load,
    per_repetition,
    run,
    speed,
    x,
)

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\((benchmarks/[^)#]+\.json)\)")
NUMBER = re.compile(r"\d")


# --------------------------------------------------------------------------------------------------- markdown tables


@dataclass
class Table:
    """A markdown table of a page: its header, its rows (cells as written) and the results files its context links."""

    line: int
    header: list[str]
    rows: list[list[str]]
    links: list[str] = field(default_factory=list)


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def tables(text: str) -> list[Table]:
    """Every table of `text`, each with the results files linked between its section's heading (or the previous
    table) and itself."""
    found: list[Table] = []
    lines = text.splitlines()
    context_start = 0
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.startswith("#"):
            context_start = index
        if line.startswith("|") and index + 1 < len(lines) and lines[index + 1].startswith("| -"):
            end = index + 2
            while end < len(lines) and lines[end].startswith("|"):
                end += 1
            context = "\n".join(lines[context_start:index])
            links = [link.removeprefix("benchmarks/") for link in LINK.findall(context)]
            found.append(Table(index + 1, _cells(line), [_cells(row) for row in lines[index + 2:end]], links))
            context_start = index = end
            continue
        index += 1
    return found


def plain_cell(cell: str) -> str:
    """A cell without emphasis and footnote markers: `**2.03x**` -> `2.03x`, `dynspec-goodput * (chain)` ->
    `dynspec-goodput`, `0.92x*` -> `0.92x`."""
    cell = cell.replace("**", "").replace("`", "")
    cell = re.sub(r"\s*\((chain|same lengths)\)$", "", cell)
    return re.sub(r"\s*[*†]+$", "", cell).strip()


# ---------------------------------------------------------------------------------------------- generators' tables


def generator_text(results: dict[str, Any]) -> str:
    """What the bench prints for a results file (every table it has)."""
    if "second_epoch" in results:
        return epochs_table(results)
    if "rates" in results:
        return serve_table(results)
    if results.get("scenario") == "overhead":
        return overhead_table(results)
    if results.get("scenario") == "head_headroom":
        return headroom_table(results)
    text = markdown_table(results)
    if results.get("config", {}).get("scenario") == "rollout":
        text += "\n\n" + rollout_table(results, "dynspec-nospec")
    return text


@cache
def generator_rows(name: str) -> dict[tuple[str, str], dict[str, str]]:
    """`{(method, batch or rate): {column: cell}}` over every table the bench prints for the file `name`, rows of the
    same key merged."""
    rows: dict[tuple[str, str], dict[str, str]] = {}
    if "runs" not in load(name) and "second_epoch" not in load(name) and load(name).get("scenario") not in (
        "overhead", "head_headroom"
    ):
        return rows  # not a bench results file (a profile, a probe's output)
    for table in tables(generator_text(load(name))):
        for cells in table.rows:
            row = dict(zip(table.header, cells))
            key = (plain_cell(row.get("method", "")), row.get("batch", row.get("rate (req/s)", "")))
            rows.setdefault(key, {}).update({column: plain_cell(cell) for column, cell in row.items()})
    return rows


ALIASES = {
    "per repetition": "speedup per repetition",
    "vs nospec": "vs dynspec-nospec",
    "accepted per drafting row": "mean accepted",
    "seconds with 8+ / 2-7 / 1 rows": ("8+ rows s", "2-7 rows s", "1 rows s"),
}
"""Columns of the report that the generators name otherwise (a tuple: cells joined with ` / `)."""


def generator_cell(row: dict[str, str], column: str) -> str | None:
    wanted = ALIASES.get(column, column)
    if isinstance(wanted, tuple):
        return " / ".join(row[c] for c in wanted) if all(c in row for c in wanted) else None
    if wanted == "speedup per repetition" and wanted not in row:
        return None
    return row.get(wanted)


# ---------------------------------------------------------------------------------- columns computed by rules here


def _per_repetition_against(name: str, method: str, other: str) -> str:
    """`method`'s speed over `other`'s in each repetition, three decimals: `1.363 / 1.363 / 1.404`."""
    return " / ".join(f"{v:.3f}" for v in per_repetition(name, method, other))


def _default_over_best(name: str) -> str:
    return x(speed(name, "dynspec-goodput") / envelope_best(name))


def _draft_forwards(name: str) -> str:
    return f"{run(name, 'dynspec-goodput')['draft_forwards']}, {run(name, 'dynspec-draft')['draft_forwards']}"


ColumnRule = Callable[[str, str], str]
"""(results file, the row's method) -> the cell as the report writes it."""

COLUMNS: dict[str, ColumnRule] = {
    "vs `hf-assisted` per repetition": lambda name, method: _per_repetition_against(name, method, "hf-assisted"),
    "vs `goodput` per repetition": lambda name, method: _per_repetition_against(name, method, "dynspec-goodput"),
    "default / best": lambda name, method: _default_over_best(name),
    "draft fwd (default, draft alone)": lambda name, method: _draft_forwards(name),
    "copied / drafted": lambda name, method: generator_rows(name)[("dynspec-goodput", "1")][
        "accepted copied / drafted"],
}
"""Columns no generator prints, computed from the results file of the row."""


# --------------------------------------------------------------------------------------------- checking a table


@dataclass
class Outcome:
    """How many figures matched, and a line for each that did not (or that nothing computes)."""

    checked: int = 0
    differences: list[str] = field(default_factory=list)

    def compare(self, where: str, written: str, computed: str | None) -> None:
        if computed is None:
            self.differences.append(f"{where}: {written} is computed by no generator column or rule")
        elif plain_cell(written) != computed:
            self.differences.append(f"{where}: the report says {written}, the results give {computed}")
        else:
            self.checked += 1


def _dataset(name: str) -> str:
    return str(load(name).get("config", {}).get("dataset", "")).lower()


def _files_for_row(table: Table, row: dict[str, str]) -> list[str]:
    """The results files of a row: those linked in the row, else the table's, narrowed by the row's set."""
    linked = [link.removeprefix("benchmarks/") for cell in row.values() for link in LINK.findall(cell)]
    files = linked or table.links
    if "set" in row and not linked:
        files = [name for name in files if _dataset(name) == plain_cell(row["set"]).lower()]
    return files


def check_method_table(table: Table, page: str, outcome: Outcome) -> None:
    """A table with a row per method: each cell against the generator's cell for that method (and batch)."""
    for cells in table.rows:
        row = dict(zip(table.header, cells))
        method, batch = plain_cell(row["method"]), plain_cell(row.get("batch", ""))
        candidates = [(name, generator_rows(name)[(method, batch)]) for name in _files_for_row(table, row)
                      if (method, batch) in generator_rows(name)]
        if not batch:
            candidates = [(name, rows) for name in _files_for_row(table, row)
                          for (m, _), rows in generator_rows(name).items() if m == method]
        where = f"{page}:{table.line} {method}{' @ ' + batch if batch else ''}"
        if len(candidates) != 1:
            outcome.differences.append(f"{where}: {len(candidates)} runs of its results files match (want 1)")
            continue
        name, generated = candidates[0]
        for column, cell in row.items():
            if column in ("method", "batch", "set") or not NUMBER.search(cell):
                continue
            rule = COLUMNS.get(column)
            computed = rule(name, method) if rule else generator_cell(generated, column)
            outcome.compare(f"{where} [{column}]", cell, computed)


def check_set_table(table: Table, page: str, outcome: Outcome) -> None:
    """A table with a row per results file and a column per method (the default's envelope): speedups over plain
    and the columns of `COLUMNS`."""
    for cells in table.rows:
        row = dict(zip(table.header, cells))
        files = _files_for_row(table, row)
        where = f"{page}:{table.line} {plain_cell(LINK.sub(']', row['set']))}"
        if len(files) != 1:
            outcome.differences.append(f"{where}: {len(files)} results files (want 1)")
            continue
        methods = {r["method"] for r in load(files[0])["runs"]}
        for column, cell in row.items():
            if column == "set":
                continue
            rule = COLUMNS.get(column)
            method = plain_cell(column)
            if rule:
                computed = rule(files[0], "")
            else:
                computed = x(speed(files[0], method)) if method in methods else None
            outcome.compare(f"{where} [{column}]", cell, computed)


def check_epochs_table(table: Table, page: str, outcome: Outcome) -> None:
    """The RL epochs table: a row per (tokens, updates), cells from `epochs_table` and the epoch's record."""
    files = {load(name)["config"]["bench"]["max_new_tokens"]: name for name in table.links if "second_epoch" in load(name)}
    for cells in table.rows:
        row = dict(zip(table.header, cells))
        name = files.get(int(row["tokens"]))
        where = f"{page}:{table.line} {row['tokens']} tokens, {row['updates']} updates"
        if name is None:
            outcome.differences.append(f"{where}: no results file")
            continue
        epoch = next(e for e in load(name)["second_epoch"] if e["updates"] == int(row["updates"]))
        generated = {m: r for (m, _), r in _epoch_rows(name, epoch["updates"]).items()}
        share = epoch["agreement"]

        def speed(method: str, rows: dict[str, dict[str, str]] = generated) -> str:
            r = rows[method]
            return f"{r['vs nospec (coupled)']} ({r['per repetition'].removesuffix(' (same lengths)')})"

        expected = {
            "KL per token": f"{epoch['kl_per_token']:.1e}".replace("e-04", "e-4"),
            "tokens as epoch 1": f"{100 * share['token_agreement']:.0f}%",
            "rows identical": f"{share['identical_rows']} / {share['rows']}",
            "bound": f"{epoch['bound']['speedup_over_nospec']:.2f}x",
            "reuse:32": speed("dynspec-reuse:32"),
            "reuse:32+draft": speed("dynspec-reuse:32+draft"),
            "goodput (standard)": generated["dynspec-goodput"]["vs nospec (coupled)"],
            "reused tokens": f"{generated['dynspec-reuse:32']['reused tokens']} / "
                             f"{generated['dynspec-reuse:32+draft']['reused tokens']}",
        }
        for column, cell in row.items():
            if column not in ("tokens", "updates"):
                outcome.compare(f"{where} [{column}]", cell, expected.get(plain_cell(column)))


def _epoch_rows(name: str, updates: int) -> dict[tuple[str, str], dict[str, str]]:
    """The generator's rows of the second-epoch table after `updates` updates."""
    text = epochs_table(load(name))
    part = text.split(f"After {updates} update(s)")[1].split("After ")[0]
    rows: dict[tuple[str, str], dict[str, str]] = {}
    for table in tables(part):
        for cells in table.rows:
            row = dict(zip(table.header, cells))
            rows[(plain_cell(row["method"]), "")] = {k: plain_cell(v) for k, v in row.items()}
    return rows


def check_serve_table(table: Table, page: str, outcome: Outcome) -> None:
    """The serving table: a row per method, a column per rate (`latency s (x over cb-plain)`) and TPOT at the lowest
    and highest rates; rates come from the two linked files (light load and the sweep)."""
    for cells in table.rows:
        row = dict(zip(table.header, cells))
        method = plain_cell(row["method"])
        for column, cell in row.items():
            where = f"{page}:{table.line} {method} [{column}]"
            rate = re.fullmatch(r"([\d.]+) req/s", column)
            if rate and cell != "–":
                computed = _serve_cell(table, method, float(rate.group(1)))
                outcome.compare(where, cell, computed)
            elif column.startswith("TPOT ms at"):
                low, high = (float(r) for r in re.findall(r"[\d.]+", column))
                computed = " / ".join(_serve_value(table, method, r, "TPOT ms") or "–" for r in (low, high))
                outcome.compare(where, cell, computed)
            elif column.startswith("drafted a run"):
                outcome.compare(where, cell, _drafted(table, method))


def _serve_value(table: Table, method: str, rate: float, column: str) -> str | None:
    for name in table.links:
        for (m, r), row in generator_rows(name).items():
            if m == method and abs(float(r) - rate) < 0.006:
                return row[column]
    return None


def _serve_cell(table: Table, method: str, rate: float) -> str | None:
    latency = _serve_value(table, method, rate, "mean latency s")
    ratio = _serve_value(table, method, rate, "vs cb-plain")
    return None if latency is None else f"{latency} s" + ("" if method == "cb-plain" else f" ({ratio})")


def _drafted(table: Table, method: str) -> str:
    """Draft tokens per run: the range over the light-load runs, and over the loaded ones where the sweep has them
    (with the share accepted where every run drafted)."""
    light, sweep = (
        [r["speculation"] for r in load(name)["runs"] if r["method"] == method and r["speculation"]]
        for name in table.links
    )
    if not light and not sweep:
        return "–"

    def span(records: list[dict[str, int]]) -> str:
        counts = [r["draft_tokens"] for r in records]
        return f"{min(counts)}-{max(counts)}"

    if not light:
        return span(sweep)
    every = light + sweep
    if all(r["draft_tokens"] > 100 for r in every):
        rates = [100 * r["accepted_tokens"] / r["draft_tokens"] for r in every]
        return f"{span(every)} ({min(rates):.0f}-{max(rates):.0f}%)"
    return f"{span(light)} light, {span(sweep)} loaded"


def check_tables(page: str, outcome: Outcome, root: Path = ROOT) -> list[Table]:
    """Checks every table of `page` that links results files; returns those tables."""
    checked = []
    for table in tables((root / page).read_text()):
        if not table.links and not any(LINK.search(c) for row in table.rows for c in row):
            continue  # no results file: a table of machines
        if table.header[:2] == ["tokens", "updates"]:
            check_epochs_table(table, page, outcome)
        elif any(h.endswith("req/s") for h in table.header):
            check_serve_table(table, page, outcome)
        elif "method" in table.header:
            check_method_table(table, page, outcome)
        elif table.header[0] == "set":
            check_set_table(table, page, outcome)
        else:
            continue  # the goals: its figures are in FIGURES
        checked.append(table)
    return checked


# ------------------------------------------------------------------------------------------------ figures in text


def check_figure(figure: Figure, text: str, outcome: Outcome) -> None:
    """The figure's sentence, with its computed figures, must be in the page (whitespace aside)."""
    written = " ".join(text.split())
    try:
        expected = figure.expected()
    except (LookupError, OSError, StopIteration, ValueError) as error:
        outcome.differences.append(f"{figure.page}: «{figure.sentence}» cannot be computed: {error!r}")
        return
    if expected in written:
        outcome.checked += 1
        return
    pattern = re.escape(figure.sentence).replace(r"\{\}", r"([^\s,;)]+)")
    found = re.search(pattern, written)
    said = found.group(0) if found else "no such sentence"
    outcome.differences.append(f"{figure.page}: the report says «{said}», the results give «{expected}»")


def check_figures(outcome: Outcome, root: Path = ROOT) -> None:
    pages: dict[str, str] = {}
    for figure in FIGURES:
        text = pages.setdefault(figure.page, (root / figure.page).read_text())
        check_figure(figure, text, outcome)


MEASURED = re.compile(r"(?<![\w.≥≤+-])(?<![≥≤] )(?<!default )\d+(?:\.\d+)?(?:x| ?%| ?ms| s\b)")
"""A measured figure in prose: a ratio, a share or a time (not a goal's threshold after `≥` or `≤`, or a default)."""

SETTINGS = (
    "where it is below 2x", "| 2x out of reach", "ends with its longest row: 2x", "Serving `tools` at 0.25x",
    "the target keeps 35%", "Poisson arrivals at 0.5x and 1x", "--rates 0.25x",
)
"""Phrases whose figures are settings or goals, not measurements."""


def uncovered(page: str, root: Path = ROOT) -> list[str]:
    """Measured figures of `page` outside code blocks and the tables checked against results files that no sentence
    of `FIGURES` holds, each with the words before it."""
    text = (root / page).read_text()
    lines = text.splitlines()
    skip = {row for t in check_tables(page, Outcome(), root) for row in range(t.line - 1, t.line + 1 + len(t.rows))}
    fenced = False
    prose = []
    for number, line in enumerate(lines):
        fenced ^= line.startswith("```")
        if not fenced and not line.startswith("```") and number not in skip:
            prose.append(line)
    written = " ".join(" ".join(prose).split())
    covered = [(m.start(), m.end()) for phrase in SETTINGS for m in re.finditer(re.escape(phrase), written)]
    for figure in (f for f in FIGURES if f.page == page):
        try:
            expected = figure.expected()
        except (LookupError, OSError, StopIteration, ValueError):
            continue
        start = written.find(expected)
        if start >= 0:
            covered.append((start, start + len(expected)))
    return [f"{page}: ...{written[max(0, m.start() - 60):m.end()]}" for m in MEASURED.finditer(written)
            if not any(a <= m.start() < b for a, b in covered)]


def check(root: Path = ROOT) -> Outcome:
    """Every figure of the report and the README under `root` against the results files of docs/benchmarks/."""
    outcome = Outcome()
    check_tables(REPORT, outcome, root)
    check_figures(outcome, root)
    for page in (REPORT, README):
        outcome.differences += [f"{where}: a figure that no results file backs (add it to report_figures.py)"
                                for where in uncovered(page, root)]
    return outcome


def main() -> int:
    outcome = check()
    print("\n".join(outcome.differences))
    print(f"{outcome.checked} figures match their results files, {len(outcome.differences)} do not")
    return 1 if outcome.differences else 0


if __name__ == "__main__":
    sys.exit(main())
