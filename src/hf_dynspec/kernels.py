"""Linear layers over a few rows, computed weight-first where that is faster: [`NarrowLinear`].

A verify forward multiplies `batch * (1 + k)` rows of activations by every weight matrix of the target. At one row
that is a matrix-vector product, bound by reading the weight once; a few rows should cost hardly more. CPU BLAS
libraries do not always see it that way: on an AMD EPYC with AVX2 (MKL, float32), `F.linear(x, W)` (that is
`x @ W.T`) over the default target's MLP weight costs 2.3x one row for 2 rows and 3.2x for 4, while the same product
taken weight-first, `(W @ x.T).T`, costs 1.0x and 1.2x. A whole target forward over 5 tokens per row then costs 1.4x
one token instead of 3.6x, which decides whether speculation can pay at all on such a CPU.

[`NarrowLinear`] is a `TorchFunctionMode` the loop enters around its own forwards (`Placement.forward`): inside it,
`F.linear` over 2 to `max_rows` rows with a float32 (or float64) CPU weight is computed weight-first, and every other
call runs unchanged. Products over one row (every plain step at batch 1, and every step of plain `generate` at batch
1) are never touched.
Both orders compute the same sums in a different order, so logits agree to float32 rounding, as they already do
between a one-row and a many-row forward.

Whether weight-first is faster, and up to how many rows, depends on the CPU, the BLAS and the weight shape:
[`narrow_rows`] measures it once per process for the model's largest linear layer (`DynSpecConfig.narrow_linear`).

Some BLAS libraries are not even monotonic in the number of rows. On an Intel Xeon with AVX512 and no AMX (oneDNN,
float32), the default target's MLP weight costs 5.2 ms over 13 to 15 rows and 3.4 ms over 16: a batch of 16 that
loses a finished row pays 1.6x per step for less work. So `auto` also times `F.linear` over every row count up to
`PADDED_ROWS` and computes a product over fewer rows at the wider row count measured fastest, zero rows added and cut
off again ([`LinearPlan`]): each real row's sums are those of a product over more rows, as in plain `generate`, which
keeps finished rows in its batch. At each of those row counts it also times the product weight-first, and takes
whichever of the three is fastest: on that Xeon, weight-first wins over 4 to 16 rows but loses over 2. A padded
product runs a few operators of its own (the zero rows, a concatenation, a slice), so each padding is timed again as
it runs and kept only where it still wins: over a narrow weight, such as the launch-bound proxy's (width 64, where
`F.linear` times differ by noise), hardly any does: a verify forward of 5 tokens there ran 2575 operators padded,
1765 unpadded.

A forward reads each weight once, and a model larger than the CPU's last-level cache meets every weight cold. So
`auto` times each product on a rotation of copies of the weight that together outgrow the cache (as large as the model,
at most `COLD_BYTES`): on that Xeon a product over 8 rows costs 3.1 ms with the weight in cache and 5.2 ms without, and
weight-first 2.2 ms and 3.4 ms; a plan timed in cache pads 10 to 15 rows to 16 and leaves 4 to 9 alone.

The output layer has a trap of its own: [`row_major_output`]. A forward that keeps the logits of only its last few
positions (`logits_to_keep`, as every prefill does) hands the output layer a slice of the hidden states, `[batch,
keep, hidden]` with the strides of the whole `[batch, width, hidden]` block. `torch.matmul` folds such an input into
one matrix product only when that needs no copy of it, or when the weight requires grad; otherwise it multiplies by
the weight expanded to a batch, and in bfloat16 on the CPU that copies the whole transposed weight first (float32
reads it in place). Weights loaded by
from_pretrained require grad, so a model in memory meets this only after `requires_grad_(False)`; weights that
accelerate loads for each forward of an offloaded layer never require grad. Offloaded, the default target's output layer (151 936 x 1536, bfloat16) then costs 0.9 s
more in every prefill: a prefill over 118 tokens took 2.1 s instead of 0.8 s, and a forward over 8 tokens 1.4 s
instead of 0.44 s, with identical logits.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .clocks import time_call
from .devices import model_devices

NARROW_LINEAR = ("auto", "on", "off")
"""Values of `DynSpecConfig.narrow_linear`."""

MAX_NARROW_ROWS = 64
"""The most rows `narrow_linear="on"` computes weight-first, and the widest product `auto` measures."""

MEASURED_ROWS = (2, 4, 8, 16, 32, 64)
"""Row counts `auto` times both ways."""

MIN_SPEEDUP = 1.05
"""`auto` computes weight-first up to the widest measured row count at which it, and every narrower one, is at
least this much faster."""

PADDED_ROWS = 32
"""`auto` times `F.linear`, and the weight-first product, over every row count up to this many, for
[`LinearPlan.pad_to`] and [`LinearPlan.weight_first`]."""

COLD_BYTES = 1 << 30
"""`auto` times products on copies of a weight that together take as many bytes as the model, up to this many (at
least one copy): each call then reads its weight from memory, as a forward of a model larger than the cache does."""


@dataclass(frozen=True)
class LinearPlan:
    """How [`NarrowLinear`] computes `F.linear` for one model: weight-first over 2 to `narrow_rows` rows and over any
    row count in `weight_first`; otherwise over `rows` rows with `rows < len(pad_to)`, as a product over `pad_to[rows]`
    rows (zero rows added, their outputs dropped; `pad_to[rows] == rows`: unchanged)."""

    narrow_rows: int = 0
    pad_to: tuple[int, ...] = ()
    weight_first: frozenset[int] = frozenset()

    def padded(self, rows: int) -> int:
        """The row count a product over `rows` rows is computed at."""
        return self.pad_to[rows] if 0 <= rows < len(self.pad_to) else rows

    @property
    def changes_anything(self) -> bool:
        return (self.narrow_rows >= 2 or bool(self.weight_first)
                or any(wider != rows for rows, wider in enumerate(self.pad_to)))

    def to_dict(self) -> dict[str, object]:
        """What the plan changes, for results files: `{"narrow_rows": int, "weight_first": [rows, ...],
        "pad_to": {rows: wider rows}}`."""
        padded = {rows: wider for rows, wider in enumerate(self.pad_to) if wider != rows}
        return {"narrow_rows": self.narrow_rows, "weight_first": sorted(self.weight_first), "pad_to": padded}

    def computes_weight_first(self, rows: int) -> bool:
        """Whether a product over `rows` rows is computed weight-first."""
        return 2 <= rows <= self.narrow_rows or rows in self.weight_first

    @functools.cached_property
    def fewest_changed_rows(self) -> int | None:
        """The fewest rows of a product the plan computes otherwise than `F.linear` does; `None` when it changes
        nothing (`changes_anything` is False)."""
        padded = [rows for rows, wider in enumerate(self.pad_to) if wider != rows]
        return min([*padded, *self.weight_first, *([2] if self.narrow_rows >= 2 else [])], default=None)


_MEASURED: dict[tuple, LinearPlan] = {}
"""`linear_plan` decisions per (weight shape, dtype, threads): measured once per process."""

Timer = Callable[[str, int, Callable[[], object]], float]
"""`timer(kind, rows, fn)`: seconds of one call of `fn`, a product over `rows` rows computed as `kind`."""


def weight_first_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` computed as `(weight @ x.T).T`.

    Args:
        x: `[..., in_features]` activations.
        weight: `[out_features, in_features]`.
        bias: `[out_features]` or `None`.

    Returns:
        `[..., out_features]`, contiguous.
    """
    rows = x.reshape(-1, x.shape[-1])  # [rows, in]
    if bias is None:
        out = torch.mm(weight, rows.t())  # [out, rows]
    else:
        out = torch.addmm(bias.unsqueeze(1), weight, rows.t())  # [out, rows]
    return out.t().contiguous().reshape(*x.shape[:-1], weight.shape[0])


FLOAT_DTYPES = (torch.float32, torch.float64)
"""Dtypes computed weight-first: those CPU BLAS libraries multiply themselves (bfloat16 and float16 go through oneDNN,
whose narrow products were not found slower than weight-first ones)."""


def padded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor:
    """`F.linear(x, weight, bias)` computed over `rows` rows: `x`'s rows followed by zero rows, whose outputs are
    dropped.

    Args:
        x: `[..., in_features]` activations, at most `rows` rows once flattened.
        weight: `[out_features, in_features]`.
        bias: `[out_features]` or `None`.

    Returns:
        `[..., out_features]`.
    """
    flat = x.reshape(-1, x.shape[-1])  # [real, in]
    real = flat.shape[0]
    wide = torch.cat([flat, flat.new_zeros(rows - real, flat.shape[1])])  # [rows, in]
    out = F.linear(wide, weight, bias)[:real]  # [real, out]
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _eligible(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Plain CPU tensors of one of `FLOAT_DTYPES` only: no tensor subclass (DTensor, quantized parameters), no
    autograd."""
    plain = (torch.Tensor, torch.nn.Parameter)
    tensors = (x, weight) if bias is None else (x, weight, bias)
    return (
        all(type(t) in plain and t.device.type == "cpu" and t.dtype == weight.dtype for t in tensors)
        and weight.dtype in FLOAT_DTYPES
        and weight.dim() == 2
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
    )


class NarrowLinear(TorchFunctionMode):
    """Inside this mode, `F.linear` over 2 to `max_rows` rows of float32 (or float64) CPU tensors runs weight-first;
    with a [`LinearPlan`] for `max_rows`, products over other row counts are padded as the plan says.

    Example:

    ```python
    >>> import torch
    >>> from hf_dynspec.kernels import NarrowLinear
    >>> layer = torch.nn.Linear(8, 4)
    >>> x = torch.randn(3, 8)
    >>> with NarrowLinear(max_rows=16):
    ...     y = layer(x)
    >>> torch.allclose(y, torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-6)
    True
    ```
    """

    def __init__(self, max_rows: int | LinearPlan) -> None:
        super().__init__()
        self.plan = max_rows if isinstance(max_rows, LinearPlan) else LinearPlan(max_rows)
        self._active = self.plan.changes_anything  # once, not on every linear call of every forward

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and self._active:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            rows = x.numel() // max(x.shape[-1], 1) if x.dim() else 0
            if self.plan.computes_weight_first(rows) and _eligible(x, weight, bias):
                return weight_first_linear(x, weight, bias)
            padded = self.plan.padded(rows)
            if padded > rows and _eligible(x, weight, bias):
                return padded_linear(x, weight, bias, padded)
        return func(*args, **kwargs)


def narrow_linear(max_rows: int | LinearPlan, tokens: int | None = None) -> contextlib.AbstractContextManager:
    """[`NarrowLinear`]`(max_rows)`, or a context that changes nothing (and costs nothing) when it would change
    nothing: `max_rows < 2`, a plan that neither computes weight-first nor pads, or a forward over `tokens` tokens
    (`None`: unknown) fewer than the fewest rows the plan changes.

    A decoder's linear layers multiply at most one row per token of the forward (fewer in an output layer that keeps
    the last logits only, or in a mixture-of-experts expert), so such a forward meets no product the plan changes;
    the mode would only cost its Python call on every operator of the forward (about as much again as the operator's
    own dispatch), which is what a forward over one token per row at batch 1 is made of."""
    plan = max_rows if isinstance(max_rows, LinearPlan) else LinearPlan(max_rows)
    first = plan.fewest_changed_rows
    if first is None or (tokens is not None and tokens < first):
        return contextlib.nullcontext()
    return NarrowLinear(plan)


def row_major(x: torch.Tensor) -> torch.Tensor:
    """`x` itself when `torch.matmul` can fold its leading dimensions into rows without a copy; else a row-major copy
    (`[..., features]`, the same values). A slice such as `hidden[:, -keep:]` of a `[batch, width, hidden]` block keeps
    the block's strides, which the fold rejects (see the module docstring)."""
    strides, shape = x.stride(), x.shape
    if all(strides[i] == strides[i + 1] * shape[i + 1] for i in range(x.dim() - 2)):
        return x
    return x.clone(memory_format=torch.contiguous_format)


def _row_major_input(module: torch.nn.Module, args: tuple) -> tuple | None:
    """Forward pre-hook: the module's first positional input made [`row_major`] (no change when it already is)."""
    if not args or not isinstance(args[0], torch.Tensor) or args[0].dim() < 3:
        return None
    x = row_major(args[0])
    return None if x is args[0] else (x, *args[1:])


@contextlib.contextmanager
def row_major_output(*models: torch.nn.Module | None) -> Iterator[None]:
    """Inside, each model's output layer (`get_output_embeddings()`) receives its input in row-major strides, so that a
    forward keeping the logits of only its last positions multiplies by the output weight in one product, never by a
    copy of it (see the module docstring). Logits do not change. Models without output embeddings are left alone.

    Example:

    ```python
    >>> import torch
    >>> from transformers import Qwen2Config, Qwen2ForCausalLM
    >>> from hf_dynspec.kernels import row_major_output
    >>> config = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    ...                      num_attention_heads=2, num_key_value_heads=1)
    >>> model = Qwen2ForCausalLM(config).requires_grad_(False)
    >>> ids = torch.randint(64, (1, 6))
    >>> with row_major_output(model):
    ...     logits = model(input_ids=ids, logits_to_keep=2).logits
    >>> torch.equal(logits, model(input_ids=ids, logits_to_keep=2).logits)
    True
    ```
    """
    handles = []
    for model in models:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if isinstance(head, torch.nn.Module):
            handles.append(head.register_forward_pre_hook(_row_major_input))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def largest_linear_shape(model: torch.nn.Module) -> tuple[int, int] | None:
    """`(out_features, in_features)` of the model's largest `nn.Linear` other than its output embeddings (which are
    as large as several decoder layers and would make measuring slow); the output embeddings when nothing else is
    linear; `None` when the model has no `nn.Linear` at all."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    body = [m for m in layers if m is not head] or layers
    if not body:
        return None
    largest = max(body, key=lambda m: m.out_features * m.in_features)
    return largest.out_features, largest.in_features


def narrow_rows(model: torch.nn.Module, setting: str, timer: Timer | None = None) -> int:
    """The most rows [`NarrowLinear`] computes weight-first for `model` under `DynSpecConfig.narrow_linear`
    (`linear_plan(...).narrow_rows`)."""
    return linear_plan(model, setting, timer).narrow_rows


def linear_plan(model: torch.nn.Module, setting: str, timer: Timer | None = None) -> LinearPlan:
    """How [`NarrowLinear`] computes `F.linear` for `model` under `DynSpecConfig.narrow_linear`.

    `"off"`: nothing changed. `"on"`: weight-first up to `MAX_NARROW_ROWS` rows for float32 and float64 models,
    nothing for others. `"auto"`: for such a model whose weights compute on the CPU, weight-first up to the widest of
    `MEASURED_ROWS` up to which it beats `F.linear` by `MIN_SPEEDUP` at every measured width; above that and up to
    `PADDED_ROWS` rows, each row count computed the fastest way measured (`F.linear` over itself or over a wider row
    count, or weight-first), where that is `MIN_SPEEDUP` faster than `F.linear` over itself. Timed once per process,
    weight shape, dtype and cold copies, on random matrices of the model's largest linear shape, each call on the next
    of copies that together take as many bytes as the model, up to `COLD_BYTES` (its weights cold, as in a forward);
    nothing for other models.

    Args:
        model: the target or the draft.
        setting: `"auto"`, `"on"` or `"off"`.
        timer: `timer(kind, rows, fn)`, the seconds one call of `fn` takes (`kind` is `"linear"`,
            `"weight_first"` or `"padded"`: `padded_linear` over `rows` rows, for each padding found faster, which
            is kept only if it still is with its own operators, `_priced_padding`); measures anew when given (for
            tests).
    """
    if setting not in NARROW_LINEAR:
        raise ValueError(f"`narrow_linear` must be one of {list(NARROW_LINEAR)}, got {setting!r}.")
    dtype = _model_dtype(model)
    if setting == "off" or dtype not in FLOAT_DTYPES:
        return LinearPlan()
    if setting == "on":
        return LinearPlan(MAX_NARROW_ROWS)
    shape = largest_linear_shape(model)
    if shape is None or not _computes_on_cpu(model):
        return LinearPlan()
    copies = cold_copies(model, shape, dtype)
    key = (shape, dtype, copies, torch.get_num_threads())
    if key not in _MEASURED or timer is not None:
        _MEASURED[key] = _measure(shape, dtype, copies, timer or _median_seconds)
    return _MEASURED[key]


def cold_copies(model: torch.nn.Module, shape: tuple[int, int], dtype: torch.dtype) -> int:
    """How many copies of a `shape` weight `auto` rotates through: as many bytes as the model's parameters (on
    `meta` too, for offloaded ones), up to `COLD_BYTES`, and at least 1."""
    size = dtype.itemsize
    model_bytes = sum(p.numel() for p in model.parameters()) * size
    return max(1, min(model_bytes, COLD_BYTES) // (shape[0] * shape[1] * size))


def _model_dtype(model: torch.nn.Module) -> torch.dtype | None:
    return getattr(model, "dtype", None) or next((p.dtype for p in model.parameters()), None)


def _computes_on_cpu(model: torch.nn.Module) -> bool:
    """Whether the model's weights are used on the CPU (offloaded weights on `meta` are loaded to the CPU)."""
    devices = model_devices(model)
    return bool(devices) and all(device.type == "cpu" for device in devices)


def _measure(shape: tuple[int, int], dtype: torch.dtype, copies: int, timer: Timer) -> LinearPlan:
    """Weight-first up to the widest of `MEASURED_ROWS` at which it, and every narrower one, is `MIN_SPEEDUP`
    faster; above that, both products timed over every row count up to `PADDED_ROWS` (`_fastest_ways`). Each call
    multiplies by the next of `copies` weights."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(shape, generator=generator, dtype=dtype)  # [out, in]
    weights = itertools.cycle([weight] + [weight.clone() for _ in range(copies - 1)])
    widest = 0
    with torch.inference_mode():
        for rows in MEASURED_ROWS:
            x = torch.randn(rows, shape[1], generator=generator, dtype=dtype)  # [rows, in]
            stock = timer("linear", rows, lambda x=x: F.linear(x, next(weights)))
            first = timer("weight_first", rows, lambda x=x: weight_first_linear(x, next(weights)))
            if first * MIN_SPEEDUP > stock:
                break
            widest = rows
        x = torch.randn(PADDED_ROWS, shape[1], generator=generator, dtype=dtype)  # [PADDED_ROWS, in]
        counts = range(max(2, widest + 1), PADDED_ROWS + 1)
        stock = {rows: timer("linear", rows, lambda rows=rows: F.linear(x[:rows], next(weights))) for rows in counts}
        first = {rows: timer("weight_first", rows, lambda rows=rows: weight_first_linear(x[:rows], next(weights)))
                 for rows in counts}
        pad_to, weight_first = _fastest_ways(stock, first)
        pad_to = _priced_padding(pad_to, stock, lambda rows, wider: timer(
            "padded", rows, lambda: padded_linear(x[:rows], next(weights), None, wider)))
    return LinearPlan(widest, pad_to, weight_first)


def _priced_padding(
    pad_to: tuple[int, ...], stock: dict[int, float], padded: Callable[[int, int], float]
) -> tuple[int, ...]:
    """`pad_to` keeping only the paddings whose product, timed as `padded_linear` runs it (`padded(rows, wider)`:
    seconds, the zero rows added and cut off again included), is still `MIN_SPEEDUP` faster than `F.linear` over its
    own row count (`stock`). Over a narrow weight those few operators of its own cost more than the wider product
    saves: on a CPU where a forward costs what its operators cost to launch, padding only adds operators."""
    kept = list(pad_to)
    for rows, wider in enumerate(pad_to):
        if wider != rows and padded(rows, wider) * MIN_SPEEDUP >= stock[rows]:
            kept[rows] = rows
    return tuple(kept)


def _fastest_ways(stock: dict[int, float], first: dict[int, float]) -> tuple[tuple[int, ...], frozenset[int]]:
    """`LinearPlan.pad_to` and `LinearPlan.weight_first` from the seconds of `F.linear` (`stock`) and of the
    weight-first product (`first`) by row count: each row count computed the fastest of `F.linear` over itself or a
    wider row count measured and weight-first over itself, where that is `MIN_SPEEDUP` faster than `F.linear` over
    itself; row counts not measured stay."""
    if not stock:
        return (), frozenset()
    pad_to, weight_first = list(range(max(stock) + 1)), set()
    for rows in stock:
        wider = min((r for r in stock if r >= rows), key=lambda r: (stock[r], r))
        fastest = min(stock[wider], first.get(rows, float("inf")))
        if fastest * MIN_SPEEDUP >= stock[rows]:
            continue
        if first.get(rows, float("inf")) < stock[wider]:
            weight_first.add(rows)
        else:
            pad_to[rows] = wider
    return tuple(pad_to), frozenset(weight_first)


def _median_seconds(kind: str, rows: int, fn: Callable[[], object]) -> float:
    """Median seconds of 5 calls of `fn` after 2 untimed ones (`kind` and `rows` name what is timed)."""
    return statistics.median(time_call(fn, warmup=2, repeats=5))
