"""The throw-away environment of `make test-oldest` sees the active environment's packages, venv or not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _purelib(python: Path) -> Path:
    code = "import sysconfig; print(sysconfig.get_path('purelib'))"
    return Path(subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True).stdout.strip())


def _import(python: Path, code: str) -> str:
    return subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True).stdout.strip()


def test_the_nested_environment_sees_an_activated_venv_and_its_own_packages_first(tmp_path: Path) -> None:
    """An active venv (not the base interpreter) holds the packages, one of them through an editable-install `.pth`;
    the nested environment imports them, and a package of its own shadows the active environment's."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "active")], check=True)
    active = tmp_path / "active" / "bin" / "python"
    site_packages = _purelib(active)
    (site_packages / "only_in_active.py").write_text("WHERE = 'active'\n")
    (site_packages / "in_both.py").write_text("WHERE = 'active'\n")
    editable = tmp_path / "src"
    editable.mkdir()
    (editable / "editable_pkg.py").write_text("WHERE = 'editable'\n")
    (site_packages / "editable.pth").write_text(f"{editable}\n")

    nested = tmp_path / "nested"
    subprocess.run(["bash", str(SCRIPTS / "nested_venv.sh"), str(active), str(nested)], check=True)
    nested_python = nested / "bin" / "python"
    (_purelib(nested_python) / "in_both.py").write_text("WHERE = 'nested'\n")

    code = "import only_in_active, in_both, editable_pkg; print(only_in_active.WHERE, in_both.WHERE, editable_pkg.WHERE)"
    assert _import(nested_python, code) == "active nested editable"


def test_the_nested_environment_sees_the_machine_python(tmp_path: Path) -> None:
    """From the interpreter running the tests (the machine's or a venv's), the nested environment imports torch and
    hf_dynspec (an editable install) from where that interpreter has them."""
    nested = tmp_path / "nested"
    subprocess.run(["bash", str(SCRIPTS / "nested_venv.sh"), sys.executable, str(nested)], check=True)
    code = "from importlib.util import find_spec; print(find_spec('torch').origin); print(find_spec('hf_dynspec').origin)"
    found = _import(nested / "bin" / "python", code).splitlines()
    import torch

    import hf_dynspec

    assert found == [torch.__file__, hf_dynspec.__file__]
