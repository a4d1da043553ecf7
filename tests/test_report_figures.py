"""Every figure of docs/benchmarks.md and the README is computed from a results file (`scripts/check_report.py`), and
the check catches a figure changed by hand, in a table, in the prose and in the goals."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def check_report():
    spec = importlib.util.spec_from_file_location("check_report", ROOT / "scripts" / "check_report.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_every_figure_of_the_report_and_the_readme_matches_its_results_file():
    outcome = check_report().check()
    assert outcome.differences == []
    assert outcome.checked > 350  # the tables' cells and the prose figures


@pytest.mark.parametrize(
    ("page", "written", "changed"),
    [
        ("docs/benchmarks.md", "| 1 | dynspec-static:4 | 2.29x |", "| 1 | dynspec-static:4 | 2.30x |"),  # a table cell
        ("docs/benchmarks.md", "| head-static:8 | 5.59 |", "| head-static:8 | 6.00 |"),  # the overhead proxy
        ("docs/benchmarks.md", "| head | 0.060 | 0.13 / 0.17 / 0.18 |", "| head | 0.060 | 0.31 / 0.17 / 0.18 |"),  # head headroom
        ("docs/benchmarks.md", "| long tail: ≥ 1.2x `plain` | 1.26x", "| long tail: ≥ 1.2x `plain` | 1.29x"),  # goals
        ("README.md", "it decodes 1.55x-2.27x faster", "it decodes 1.55x-2.37x faster"),
        ("docs/benchmarks.md", "0 tokens in 8 of 9 loaded runs", "0 tokens in 7 of 9 loaded runs"),
    ],
)
def test_a_figure_changed_by_hand_is_reported(tmp_path: Path, page: str, written: str, changed: str):
    for name in ("README.md", "docs/benchmarks.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    text = (tmp_path / page).read_text()
    assert text.count(written) == 1
    (tmp_path / page).write_text(text.replace(written, changed))
    differences = check_report().check(tmp_path).differences
    assert len(differences) >= 1 and all(page in line for line in differences), differences


def test_a_figure_with_no_results_file_is_reported(tmp_path: Path):
    for name in ("README.md", "docs/benchmarks.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    readme = tmp_path / "README.md"
    readme.write_text(readme.read_text().replace("## What it does", "It is 9.99x faster.\n\n## What it does"))
    differences = check_report().check(tmp_path).differences
    assert any("9.99x" in line and "no results file" in line for line in differences), differences
