"""The evaluation notebooks run top to bottom in their tiny mode (tiny random models, seconds each)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent.parent / "evaluation"


def _set_parameters(notebook: nbformat.NotebookNode, source: str) -> None:
    """Replace the cell tagged `parameters` (the notebook's settings) with `source`."""
    cells = [cell for cell in notebook.cells if "parameters" in cell.metadata.get("tags", [])]
    assert len(cells) == 1, "each evaluation notebook has exactly one cell tagged 'parameters'"
    cells[0].source = source


def _outputs_text(notebook: nbformat.NotebookNode) -> str:
    parts = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            parts.append(output.get("text", ""))
            parts.extend(str(value) for value in output.get("data", {}).values())
    return "\n".join(parts)


@pytest.mark.parametrize(
    "name, parameters, expected",
    [
        ("benchmark.ipynb", 'MODE = "tiny"\nOUT_DIR = "plots"', ["| 4 | hf-assisted † |", "| mismatches: none"]),
        ("goodput_walkthrough.ipynb", 'MODE = "tiny"', ["same tokens as plain greedy decoding: True", "steps were priced"]),
    ],
)
@pytest.mark.slow
def test_notebook_runs_in_tiny_mode(name, parameters, expected, tmp_path):
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    _set_parameters(notebook, parameters)
    NotebookClient(notebook, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = _outputs_text(notebook)
    for snippet in expected:
        assert snippet in text
    if name == "benchmark.ipynb":
        assert (tmp_path / "plots" / "speedup.png").is_file()
