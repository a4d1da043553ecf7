"""Counting the host synchronisations a decoding step would make on a GPU, on any machine (the CPU included).

On a CUDA device the host queues kernels and runs ahead of them, until it needs a value the device computes or a
copy that must finish: then it waits for everything queued so far. `SyncCounter` is a `TorchFunctionMode` that records
every call that would make the host wait there, with the line of code that made it:

- reading device values on the host: `.item()`, `.tolist()`, `bool(t)` / `int(t)` / `float(t)` / `t.__index__()`,
  `.cpu()` / `.to("cpu")` / `.numpy()`, `torch.equal`, printing a tensor;
- results whose shape depends on device values: `nonzero`, `argwhere`, `masked_select`, `torch.unique`, `bincount`,
  `torch.where(condition)`, `repeat_interleave` with tensor repeats and no `output_size`, indexing with a boolean mask
  (and assigning through one anything but a single host value);
- blocking uploads: a host tensor or Python data copied to the device without `non_blocking=True` (PyTorch waits for
  the device's stream after such a copy), as `torch.tensor(data, device=...)` and `.new_tensor(data)` do;
- calls that mix host tensors (other than scalars) with device tensors: on a GPU they either fail or copy the host
  tensor over first (indexing a device tensor with host indices), so they are counted too, as `mixed: <name>`.

On a CPU every tensor is a host tensor, so the counter keeps its own notion of where a tensor would be: a tensor is a
*host* tensor when the code made it on the host (a factory call without a `device`, or with the string `"cpu"`;
`.cpu()`; `.to("cpu")`) or computed it from host tensors alone; every other tensor, the models' weights and the
caller's inputs included, would be on the device. Calls on host tensors alone cost no synchronisation and are not
counted. A `torch.device` object is taken for the device (on a GPU the code passes the loop's device), unless it is
the `.device` of a host tensor.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../hf_dynspec
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
_HERE = os.path.abspath(__file__)

_READS = {
    "item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__complex__", "__format__", "__repr__",
    "__str__", "numpy", "__array__", "equal", "allclose", "is_nonzero",
}
"""Calls that read device values on the host."""
_SHAPES = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount"}
"""Calls whose result's shape depends on device values."""
_FACTORIES = {
    "tensor", "as_tensor", "asarray", "from_numpy", "zeros", "ones", "full", "empty", "arange", "range", "linspace",
    "rand", "randn", "randint", "eye",
}
"""Calls that make a tensor from nothing or from host data: on the host unless given a device."""
_UPLOADS = {"tensor", "as_tensor", "asarray", "new_tensor"}
"""Factories that copy host data: given a device, a blocking upload."""
_HOST_NAMES = {"cpu"}
_WATCHED = _READS | _SHAPES | _FACTORIES | _UPLOADS | {
    "to", "cuda", "cpu", "copy_", "where", "repeat_interleave", "__getitem__", "__setitem__", "pin_memory",
}
"""Calls that matter even when no host tensor takes part."""


@dataclass
class SyncEvent:
    """One call that would make the host wait for the device."""

    op: str
    site: str
    """`path:line` of the innermost caller outside torch (the package's own path is relative to the package)."""
    ours: bool
    """Whether that caller is the package's code (else a model's forward or transformers)."""


class SyncCounter(TorchFunctionMode):
    """Counts the calls that would synchronise with a CUDA device, per decoding step (`mark_step` opens a step,
    `close_step` ends it).

    `steps[0]` holds what ran outside the steps (the prefill, the end of the call); `steps[i]` step `i`'s events.
    """

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[list[SyncEvent]] = [[]]
        self._current = self.steps[0]
        self.host_devices: dict[int, torch.device] = {}  # the `.device` objects read from host tensors, by id
    def mark_step(self) -> None:
        self.steps.append([])
        self._current = self.steps[-1]

    def close_step(self) -> None:
        self._current = self.steps[0]

    def per_step(self, ours_only: bool = True) -> list[int]:
        """Events of each decoding step (not the prefill), the package's own only by default."""
        return [sum(1 for e in events if e.ours or not ours_only) for events in self.steps[1:]]

    def sites(self, ours_only: bool = True) -> Counter:
        """`(op, site)` -> events over the decoding steps."""
        return Counter((e.op, e.site) for events in self.steps[1:] for e in events if e.ours or not ours_only)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        result = func(*args, **kwargs)
        if name == "__get__":
            if getattr(func.__self__, "__name__", "") == "device" and _on_host(args[0]):
                if len(self.host_devices) > 4096:
                    self.host_devices.clear()
                self.host_devices[id(result)] = result  # kept alive, so the id stays its own
            return result
        inputs = _tensors(args, kwargs)
        if not any(_on_host(t) for t in inputs) and name not in _WATCHED and "device" not in kwargs:
            return result  # device tensors in, device tensors out, nothing read: most of a forward
        token = _HOST_DEVICES.set(self.host_devices)
        try:
            op = _sync_op(name, args, kwargs, inputs)
            host = _result_on_host(name, args, kwargs, inputs)
        finally:
            _HOST_DEVICES.reset(token)
        if op is not None:
            self._current.append(_event(op))
        _tag(result, host, inputs, moves=name in ("to", "cpu", "cuda"))
        return result


def _on_host(tensor: torch.Tensor) -> bool:
    return getattr(tensor, "_dynspec_host", False)


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among a call's arguments, and in the lists and tuples among them (`torch.cat`, indices)."""
    found = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


def _tag(result: object, host: bool, inputs: list[torch.Tensor], moves: bool) -> None:
    """Mark the tensors of `result` as host tensors when `host`. An input returned as it is keeps its mark after an
    in-place call; after a move (`.to`, `.cpu`, which return their input on a CPU but a copy on a GPU) it takes the
    mark of where it went."""
    values = (result,) if isinstance(result, torch.Tensor) else tree_flatten(result)[0]
    for value in values:
        if not isinstance(value, torch.Tensor) or (any(value is t for t in inputs) and not moves):
            continue
        if host or _on_host(value):
            with contextlib.suppress(AttributeError, RuntimeError):
                value._dynspec_host = host


def _device_argument(name: str, args: tuple, kwargs: dict) -> object:
    """The device a factory or `.to` call names (`None` when none): kwargs' `device`, else a device in `args`."""
    if "device" in kwargs:
        return kwargs["device"]
    if name in ("to", "cuda"):
        for value in args[1:]:
            if isinstance(value, (str, torch.device, int)) and not isinstance(value, bool):
                return value
            if isinstance(value, torch.Tensor):
                return "cpu" if _on_host(value) else torch.device("cuda")
    return None


_HOST_DEVICES: contextvars.ContextVar[dict[int, torch.device] | None] = contextvars.ContextVar("host_devices", default=None)


def _names_host(device: object) -> bool:
    if isinstance(device, torch.device):
        return (_HOST_DEVICES.get() or {}).get(id(device)) is device
    return isinstance(device, str) and device.split(":")[0] in _HOST_NAMES


def _result_on_host(name: str, args: tuple, kwargs: dict, inputs: list[torch.Tensor]) -> bool:
    if name in ("cpu", "numpy"):
        return True
    device = _device_argument(name, args, kwargs)
    if name in _FACTORIES or name.startswith("new_") or name.endswith("_like") or name in ("to", "cuda"):
        if device is not None:
            return _names_host(device)
        if name in _FACTORIES and not (name in ("as_tensor", "asarray") and inputs):
            return True
    return bool(inputs) and all(_on_host(t) for t in inputs)


def _sync_op(name: str, args: tuple, kwargs: dict, inputs: list[torch.Tensor]) -> str | None:
    """The name under which the call is counted, or `None` when it would not synchronise."""
    on_device = [t for t in inputs if not _on_host(t)]
    if name in _UPLOADS and not inputs and not kwargs.get("non_blocking", False):
        device = _device_argument(name, args, kwargs)
        uploads = (device is not None and not _names_host(device)) or name == "new_tensor"
        on_device = [args[0]] if name == "new_tensor" and not _on_host(args[0]) else []
        return f"{name} (upload)" if uploads and (name != "new_tensor" or on_device) else None
    if name in ("to", "cuda", "copy_"):
        return _copy_op(name, args, kwargs)
    if name == "cpu":
        return "cpu" if on_device else None
    if not on_device:
        return None
    if name in _READS or name in _SHAPES:
        return name
    if name == "where" and len(args) + len(kwargs) == 1:
        return "where (one argument)"
    if name == "repeat_interleave" and any(isinstance(a, torch.Tensor) for a in args[1:]) and "output_size" not in kwargs:
        return "repeat_interleave"
    if name in ("__getitem__", "__setitem__") and _masks(args[1]):
        value = args[2] if name == "__setitem__" else None
        single = isinstance(value, (int, float, bool)) or (
            isinstance(value, torch.Tensor) and _on_host(value) and value.numel() == 1
        )
        return None if name == "__setitem__" and single else f"{name} (boolean mask)"
    if any(_on_host(t) and t.dim() > 0 for t in inputs):
        return f"mixed: {name}"
    return None


def _copy_op(name: str, args: tuple, kwargs: dict) -> str | None:
    """A copy between host and device: `.to`, `.cuda`, `copy_` (`None` when it stays where it is or does not wait)."""
    if name == "copy_":
        target, source = args[0], args[1]
        if _on_host(target) != _on_host(source) and not (kwargs.get("non_blocking") or args[2:3] == (True,)):
            return "copy_ (download)" if _on_host(target) else "copy_ (upload)"
        return None
    tensor = args[0]
    device = _device_argument(name, args, kwargs)
    if device is None and name == "to":
        return None
    blocking = not (kwargs.get("non_blocking") or any(a is True for a in args[1:]))
    if _names_host(device):
        return None if _on_host(tensor) else "to (download)"
    return "to (upload)" if _on_host(tensor) and blocking else None


def _masks(index: object) -> bool:
    """Whether an index holds a boolean (or uint8) mask tensor."""
    values = index if isinstance(index, tuple) else (index,)
    return any(isinstance(v, torch.Tensor) and v.dtype in (torch.bool, torch.uint8) for v in values)


def _event(op: str) -> SyncEvent:
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        other_mode = frame.f_code.co_name == "__torch_function__"  # another mode passing the call on
        if not path.startswith(_TORCH) and path != _HERE and "contextlib" not in path and not other_mode:
            break
        frame = frame.f_back
    if frame is None:
        return SyncEvent(op, "?", False)
    ours = path.startswith(_PACKAGE + os.sep)
    shown = os.path.relpath(path, os.path.dirname(_PACKAGE)) if ours else path
    return SyncEvent(op, f"{shown}:{frame.f_lineno} ({frame.f_code.co_name})", ours)


@contextlib.contextmanager
def counting_steps(counter: SyncCounter, step_methods: list[tuple[type, str]]) -> Iterator[SyncCounter]:
    """Run the block with `counter` active in every thread that calls one of `step_methods` (`(class, name)`): the
    first of them opens a step each time it is called, the last ends it when it returns, each runs under the counter.
    The counter is also active in the calling thread, so what runs outside the steps (the prefill) lands in
    `steps[0]`."""
    originals = [(owner, name, owner.__dict__[name]) for owner, name in step_methods]
    opener, closer = step_methods[0], step_methods[-1]

    def wrap(owner: type, name: str, method: Callable) -> Callable:
        def counted(*args, **kwargs):
            if (owner, name) == opener:
                counter.mark_step()
            try:
                if torch.overrides._get_current_function_mode_stack().count(counter):
                    return method(*args, **kwargs)
                with counter:
                    return method(*args, **kwargs)
            finally:
                if (owner, name) == closer:
                    counter.close_step()

        return counted

    from_numpy = torch.from_numpy  # not seen by function modes: its tensors are the host's

    def host_from_numpy(array):
        tensor = from_numpy(array)
        tensor._dynspec_host = True
        return tensor

    try:
        for owner, name, method in originals:
            setattr(owner, name, wrap(owner, name, method))
        torch.from_numpy = host_from_numpy
        with counter:
            yield counter
    finally:
        torch.from_numpy = from_numpy
        for owner, name, method in originals:
            setattr(owner, name, method)
