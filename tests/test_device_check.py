"""`scripts/device_check.sh` runs on the CPU (tiny configs, seconds), so it cannot rot before a GPU runs it; it stops
with a clear message where it cannot run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "device_check.sh"


def device_check(*args: str, python: str = sys.executable) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHON": python})


@pytest.mark.slow
def test_device_check_runs_on_the_cpu(tmp_path: Path) -> None:
    result = device_check("--device", "cpu", "--out", str(tmp_path))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads((tmp_path / "device_check.json").read_text())
    assert [row["batch"] for row in report["overhead"]] == [1, 4]
    assert all(row["identical"] and row["loop_speed_vs_plain"] > 0 for row in report["overhead"])
    methods = ("default", "static:4")
    assert all(row[name]["identical"] for row in report["controlled_acceptance"] for name in methods)
    assert {(row["proposer"], row["host_count_per_step"]) for row in report["syncs"]} == {("draft", 1), ("lookup", 1)}
    curve = report["verify_curve"]["target_forward"]
    assert {(point["batch_size"], point["tokens_per_row"]) for point in curve} == {(1, 1), (1, 2), (2, 1), (2, 2)}
    summary = (tmp_path / "device_check.txt").read_text()
    assert "loop without speculation" in summary and "acceptance 0.8" in summary and summary in result.stdout


def test_device_check_names_what_it_lacks(tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    result = device_check("--device", "cpu", "--out", str(tmp_path / "out"), python=str(bare / "bin" / "python"))
    assert result.returncode == 3
    assert "lacks torch transformers numpy tqdm" in result.stderr and "pip download --dest wheels" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_device_check_on_cuda_without_one_says_so(tmp_path: Path) -> None:
    result = device_check("--device", "cuda", "--out", str(tmp_path))
    assert result.returncode == 4 and "--device cpu" in result.stderr
