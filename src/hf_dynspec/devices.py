"""Where a model lives: the devices it computes on, where its inputs go, how host tensors reach a device.

The lowest layer of the package beside `clocks`: it imports nothing of hf_dynspec, so every module may use it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers import PreTrainedModel


def _hooks(module: torch.nn.Module) -> tuple:
    """The module's accelerate hooks (its `_hf_hook`, or the hooks inside a `SequentialHook`)."""
    hook = getattr(module, "_hf_hook", None)
    return () if hook is None else tuple(getattr(hook, "hooks", (hook,)))


def _hook_device(module: torch.nn.Module) -> torch.device | None:
    """The execution device recorded in the module's accelerate hook (`AlignDevicesHook`), or `None`."""
    for hook in _hooks(module):
        device = getattr(hook, "execution_device", None)
        if device is not None:
            return torch.device(device)
    return None


def input_device(model: PreTrainedModel) -> torch.device:
    """The device a model's input ids must be on: where its input embeddings run.

    That is the execution device of the embeddings' accelerate hook when the model was dispatched with a device map
    or offload (an offloaded embedding's weight sits on `meta` until the hook loads it), else the weight's device.
    Raises `ValueError` when the weight is on `meta` and no hook would ever load it.
    """
    embeddings = model.get_input_embeddings()
    hooked = _hook_device(embeddings) or _hook_device(model)
    if hooked is not None:
        return hooked
    device = embeddings.weight.device
    if device.type == "meta":
        raise ValueError(
            f"{type(model).__name__}'s input embeddings are on the meta device without an accelerate hook to load "
            "them, so the model cannot run. Load it with from_pretrained(..., device_map=...) (with max_memory / "
            "offload_folder for offload), or dispatch it with accelerate's dispatch_model or cpu_offload."
        )
    return device


def unloaded_parameters(model: torch.nn.Module) -> list[str]:
    """Names of parameters on `meta` that no accelerate hook loads before use.

    An offloading hook (`AlignDevicesHook(offload=True)`, as `device_map` offload and `cpu_offload` attach) on the
    parameter's module or a parent loads it; hooks that only move inputs and outputs do not.
    """
    names: list[str] = []

    def visit(module: torch.nn.Module, prefix: str, hooked: bool) -> None:
        hooked = hooked or any(getattr(hook, "offload", False) for hook in _hooks(module))
        for name, parameter in module.named_parameters(recurse=False):
            if parameter.device.type == "meta" and not hooked:
                names.append(prefix + name)
        for name, child in module.named_children():
            visit(child, f"{prefix}{name}.", hooked)

    visit(model, "", False)
    return names


def model_devices(model: torch.nn.Module) -> set[torch.device]:
    """Every device a model computes on: its parameters' devices (except `meta`) and its hooks' execution devices."""
    devices = {parameter.device for parameter in model.parameters() if parameter.device.type != "meta"}
    devices |= {device for module in model.modules() if (device := _hook_device(module)) is not None}
    return devices


def cuda_devices(*models: torch.nn.Module | None) -> tuple[torch.device, ...]:
    """Every CUDA device the given models compute on (`model_devices`), in a fixed order."""
    devices = set().union(*(model_devices(m) for m in models if m is not None))
    return tuple(sorted({d for d in devices if d.type == "cuda"}, key=str))


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy on `device` of a host tensor that never makes the host wait: through pinned memory without blocking on
    CUDA (from pageable memory the copy may wait for the device), a plain copy elsewhere. The host tensor may change
    afterwards."""
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device, non_blocking=True, copy=True)


def tensor_parallel_group(model: PreTrainedModel) -> dist.ProcessGroup | None:
    """The group of ranks `model` is tensor-parallel over (`tp_plan` / `DistributedConfig` loading), or `None`.

    `None` also in a single process, and for an unsharded model in a multi-process run: there each rank decodes its
    own prompts (data parallelism), and its decisions are its own.
    """
    if not multi_process():
        return None
    mesh = _tensor_parallel_mesh(model)
    return mesh.get_group() if mesh is not None and mesh.size() > 1 else None


def multi_process() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _tensor_parallel_mesh(model: PreTrainedModel):
    """The `tp` device mesh transformers built for `model`, or `None`."""
    manager = getattr(model, "_mesh_manager", None)
    if manager is not None:
        try:
            return manager.get_mesh("tp")
        except (KeyError, RuntimeError, ValueError):
            pass
    mesh = getattr(model, "_device_mesh", None)
    if mesh is not None and "tp" in (mesh.mesh_dim_names or ()):
        return mesh["tp"]
    return None
