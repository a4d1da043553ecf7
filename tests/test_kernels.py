"""Weight-first linear layers for narrow products (`hf_dynspec.kernels`): same values, right calls, honest choice."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from conftest import left_padded_prompts, perturbed, tiny_model
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import hf_dynspec
from hf_dynspec import DynSpecConfig, kernels
from hf_dynspec.kernels import MAX_NARROW_ROWS, NarrowLinear, narrow_rows, row_major_output, weight_first_linear
from hf_dynspec.placement import Placement


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(2, 16), (3, 5, 16), (1, 7, 16)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_weight_first_equals_linear(dtype, shape, with_bias):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=generator, dtype=dtype)
    weight = torch.randn(24, 16, generator=generator, dtype=dtype)
    bias = torch.randn(24, generator=generator, dtype=dtype) if with_bias else None
    out = weight_first_linear(x, weight, bias)
    expected = F.linear(x, weight, bias)
    assert out.shape == expected.shape and out.is_contiguous()
    tolerance = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)


class _Spy:
    """Counts the rows of every product `NarrowLinear` routes weight-first."""

    def __init__(self, monkeypatch):
        self.rows: list[int] = []
        original = kernels.weight_first_linear

        def spy(x, weight, bias=None):
            self.rows.append(x.numel() // x.shape[-1])
            return original(x, weight, bias)

        monkeypatch.setattr(kernels, "weight_first_linear", spy)


def test_mode_routes_only_narrow_float_products_on_plain_cpu_tensors(monkeypatch):
    spy = _Spy(monkeypatch)
    layer = torch.nn.Linear(16, 8)
    with torch.inference_mode(), NarrowLinear(max_rows=6):
        layer(torch.randn(1, 16))  # one row: a plain decoding step
        layer(torch.randn(2, 3, 16))  # 6 rows
        layer(torch.randn(7, 16))  # wider than max_rows
        layer.to(torch.bfloat16)(torch.randn(4, 16, dtype=torch.bfloat16))  # bfloat16 goes to oneDNN as before
        layer.to(torch.float32)
        torch.matmul(torch.randn(3, 16), layer.weight.t())  # not F.linear
    assert spy.rows == [6]
    layer(torch.randn(3, 16))  # outside the mode
    assert spy.rows == [6]


def test_mode_leaves_autograd_and_tensor_subclasses_alone(monkeypatch):
    spy = _Spy(monkeypatch)
    layer = torch.nn.Linear(16, 8)

    class Marked(torch.Tensor):
        pass

    with NarrowLinear(max_rows=8):
        out = layer(torch.randn(3, 16))  # weights require grad and grad mode is on
        out.sum().backward()
        with torch.no_grad():
            F.linear(torch.randn(3, 16).as_subclass(Marked), layer.weight)
            layer(torch.randn(3, 16))
    assert layer.weight.grad is not None
    assert spy.rows == [3]


def test_narrow_rows_settings():
    model32 = tiny_model("llama", seed=0, dtype=torch.float32)
    assert narrow_rows(model32, "off") == 0
    assert narrow_rows(model32, "on") == MAX_NARROW_ROWS
    assert narrow_rows(tiny_model("llama", seed=0, dtype=torch.bfloat16), "on") == 0
    with pytest.raises(ValueError, match="narrow_linear"):
        narrow_rows(model32, "always")
    with pytest.raises(ValueError, match="narrow_linear"):
        DynSpecConfig(narrow_linear="yes")


def _timer(faster_up_to: int):
    """Weight-first takes half the time of `F.linear` up to `faster_up_to` rows and twice as long beyond."""

    def timer(kind: str, rows: int, fn) -> float:
        fn()
        if kind == "linear":
            return 1.0
        return 0.5 if rows <= faster_up_to else 2.0

    return timer


@pytest.mark.parametrize("faster_up_to, expected", [(0, 0), (1, 0), (2, 2), (8, 8), (12, 8), (10_000, 64)])
def test_auto_takes_the_widest_product_measured_faster(faster_up_to, expected):
    model = tiny_model("qwen2", seed=0, dtype=torch.float32)
    assert narrow_rows(model, "auto", timer=_timer(faster_up_to)) == expected
    assert narrow_rows(tiny_model("qwen2", seed=0, dtype=torch.bfloat16), "auto", timer=_timer(64)) == 0


def test_auto_measures_the_largest_linear_but_the_head():
    model = tiny_model("llama", seed=0, dtype=torch.float32)  # MLP 64 x 32, head 96 x 32
    assert kernels.largest_linear_shape(model) == (64, 32)
    seen: list[int] = []

    def timer(kind, rows, fn):
        seen.append(rows)
        return 1.0

    plan = kernels.linear_plan(model, "auto", timer=timer)
    assert seen[:2] == [2, 2]  # equal times: weight-first not faster, so its measuring stops at the first width
    counts = list(range(2, kernels.PADDED_ROWS + 1))
    assert seen[2:] == counts + counts  # F.linear, then weight-first, at every row count
    assert plan == kernels.LinearPlan(0, tuple(range(kernels.PADDED_ROWS + 1)))  # equal times: nothing changed


def test_auto_pads_a_product_to_a_wider_row_count_measured_faster():
    """As oneDNN in float32 on an Intel Xeon without AMX: 13 to 15 rows cost 1.5x 16 rows. Products over 12 to 15 rows
    are computed over 16, which is at least `MIN_SPEEDUP` faster (11 rows cost 4.3, 16 rows 4.1: not enough); 16 and
    wider stay."""
    model = tiny_model("llama", seed=0, dtype=torch.float32)
    costs = {rows: 1.0 + 0.3 * rows for rows in range(1, 13)} | {13: 5.2, 14: 5.2, 15: 5.2}
    costs |= {rows: 3.3 + 0.05 * rows for rows in range(16, kernels.PADDED_ROWS + 1)}

    def timer(kind, rows, fn):
        if kind == "padded":  # over 16 rows, and the padding's own operators
            return costs[16] + 0.1
        return costs[rows] if kind == "linear" else 2.0 * costs[rows]  # weight-first never faster

    plan = kernels.linear_plan(model, "auto", timer=timer)
    assert plan.narrow_rows == 0
    assert [plan.padded(rows) for rows in range(1, 18)] == list(range(1, 12)) + [16] * 5 + [17]
    assert plan.padded(kernels.PADDED_ROWS + 10) == kernels.PADDED_ROWS + 10
    assert plan.to_dict() == {"narrow_rows": 0, "weight_first": [], "pad_to": {12: 16, 13: 16, 14: 16, 15: 16}}
    layer = torch.nn.Linear(32, 64)
    x = torch.randn(2, 7, 32)  # 14 rows: computed over 16
    with torch.inference_mode():
        reference = layer(x)
        seen: list[int] = []
        with NarrowLinear(plan):
            hook = layer.register_forward_hook(lambda module, args, out: seen.append(out.shape[:-1].numel()))
            padded = layer(x)
            hook.remove()
    assert padded.shape == reference.shape and torch.allclose(padded, reference, atol=1e-6)
    assert seen == [14]  # the padding rows are dropped again
    assert kernels.padded_linear(x, layer.weight, layer.bias, 16).shape == (2, 7, 64)
    assert isinstance(kernels.narrow_linear(kernels.LinearPlan()), contextlib.nullcontext)
    assert plan.fewest_changed_rows == 12 and kernels.LinearPlan().fewest_changed_rows is None
    assert isinstance(kernels.narrow_linear(plan, tokens=11), contextlib.nullcontext)  # no product it changes
    assert isinstance(kernels.narrow_linear(plan, tokens=12), NarrowLinear)


def test_auto_pads_only_where_the_padding_pays_for_its_own_operators():
    """A narrow weight, as the launch-bound proxy's (width 64): `F.linear` times are noise (13 rows seem slower than
    16), but the padded product adds operators (zero rows, a concatenation, a slice) that cost more than any such
    difference: nothing is padded."""
    model = tiny_model("llama", seed=0, dtype=torch.float32)
    costs = {rows: 3.0 for rows in range(1, kernels.PADDED_ROWS + 1)} | {13: 3.3}

    def timer(kind, rows, fn):
        fn()
        return {"linear": costs[rows], "weight_first": 4.0, "padded": 3.0 + 2.0}[kind]

    plan = kernels.linear_plan(model, "auto", timer=timer)
    assert not plan.changes_anything and plan.fewest_changed_rows is None
    assert kernels._priced_padding((0, 1, 4, 4, 4), {2: 3.3, 3: 3.0}, lambda rows, wider: 3.0) == (0, 1, 4, 3, 4)


def test_auto_computes_weight_first_at_the_row_counts_it_wins(monkeypatch):
    """As oneDNN in float32 on an Intel Xeon without AMX, weights cold: `F.linear` passes over the weight once per
    3 rows up to 15 rows (1.9 ms per pass) and is a GEMM from 16 rows (4.2 ms); weight-first costs 3.4 ms at every
    width. So 2 and 3 rows stay, 4 and wider go weight-first (16 too: 3.4 against 4.2), and nothing is padded."""
    model = tiny_model("llama", seed=0, dtype=torch.float32)
    stock = {rows: 1.9 * -(-rows // 3) for rows in range(1, 16)} | {rows: 4.2 + 0.05 * (rows - 16)
                                                                     for rows in range(16, kernels.PADDED_ROWS + 1)}

    def timer(kind, rows, fn):
        return stock[rows] if kind == "linear" else 3.4

    plan = kernels.linear_plan(model, "auto", timer=timer)
    assert plan.narrow_rows == 0  # weight-first loses at 2 rows, so no prefix of row counts
    assert [rows for rows in range(1, kernels.PADDED_ROWS + 3) if plan.computes_weight_first(rows)] == list(
        range(4, kernels.PADDED_ROWS + 1))
    assert all(plan.padded(rows) == rows for rows in range(kernels.PADDED_ROWS + 3))
    assert plan.to_dict() == {"narrow_rows": 0, "weight_first": list(range(4, kernels.PADDED_ROWS + 1)), "pad_to": {}}
    spy = _Spy(monkeypatch)
    layer = torch.nn.Linear(32, 64)
    with torch.inference_mode():
        for rows in (1, 2, 3, 4, 9, 16, 33):
            x = torch.randn(rows, 32)
            with NarrowLinear(plan):
                out = layer(x)
            torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    assert spy.rows == [4, 9, 16]


class _WeightsSeen(TorchFunctionMode):
    """Records the storage of the weight of every `F.linear` and `torch.mm` (weight-first) call."""

    def __init__(self):
        super().__init__()
        self.pointers: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear:
            self.pointers.append(args[1].data_ptr())
        elif func is torch.mm:
            self.pointers.append(args[0].data_ptr())
        return func(*args, **(kwargs or {}))


def test_auto_times_each_call_on_a_cold_copy_of_the_weight(monkeypatch):
    """Each timed call multiplies by the next of copies as large together as the model (up to `COLD_BYTES`), so a
    model larger than the cache is timed with its weights read from memory, as its forwards read them."""
    model = tiny_model("llama", seed=0, dtype=torch.float32)  # largest linear 64 x 32 floats: 8 KiB
    model_bytes = sum(p.numel() for p in model.parameters()) * 4
    assert kernels.cold_copies(model, (64, 32), torch.float32) == model_bytes // (64 * 32 * 4) > 3
    monkeypatch.setattr(kernels, "COLD_BYTES", 3 * 64 * 32 * 4)
    assert kernels.cold_copies(model, (64, 32), torch.float32) == 3
    assert kernels.cold_copies(model, (64, 32), torch.float64) == 1  # at least one copy
    seen: dict[tuple[str, int], list[int]] = {}

    def timer(kind, rows, fn):
        with _WeightsSeen() as spy:
            for _ in range(4):
                fn()
        seen[kind, rows] = spy.pointers
        return 1.0

    kernels.linear_plan(model, "auto", timer=timer)
    for pointers in seen.values():
        assert len(set(pointers[:3])) == 3 and pointers[3] == pointers[0]  # a rotation of 3 copies


def test_placement_computes_verify_forwards_weight_first(monkeypatch):
    spy = _Spy(monkeypatch)
    target = tiny_model("llama", seed=1, dtype=torch.float32)
    draft = perturbed(target, scale=0.05)
    assert Placement.of(torch.device("cpu"), target, draft, "on").narrow_rows == {id(target): 64, id(draft): 64}
    assert Placement.of(torch.device("cpu"), target, draft, "off").narrow_rows == {id(target): 0, id(draft): 0}
    ids, mask = left_padded_prompts([5, 8], seed=1)
    for setting, routed in (("off", False), ("on", True)):
        spy.rows.clear()
        target.generate(
            input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=8, assistant_model=draft,
            custom_generate=hf_dynspec.speculative_loop,
            dynspec_config=DynSpecConfig(policy="static", num_speculative_tokens=3, narrow_linear=setting),
        )
        assert bool(spy.rows) == routed
        assert all(2 <= rows <= MAX_NARROW_ROWS for rows in spy.rows)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("tree_node_budget", [0, 8])
def test_weight_first_forwards_match_plain_greedy(family, dtype, tree_node_budget):
    target = tiny_model(family, seed=4, dtype=dtype)
    draft = perturbed(target, scale=0.05, seed=2)
    ids, mask = left_padded_prompts([3, 9, 6, 12, 1], seed=8)
    expected = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=30)
    config = DynSpecConfig(policy="static", num_speculative_tokens=5, narrow_linear="on",
                           tree_node_budget=tree_node_budget, compact_min_holes=1, compact_hole_fraction=0.1)
    out = target.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=30, assistant_model=draft,
        custom_generate=hf_dynspec.speculative_loop, dynspec_config=config, return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, expected)
    assert out.dynspec_stats.accepted_tokens > 0 and out.dynspec_stats.compactions > 0


class _Ops(TorchDispatchMode):
    """Records the name of every aten op run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _foldable(x: torch.Tensor) -> bool:
    return all(x.stride(i) == x.stride(i + 1) * x.shape[i + 1] for i in range(x.dim() - 2))


def test_row_major_copies_only_what_matmul_cannot_fold():
    block = torch.randn(2, 5, 8)  # [batch, width, hidden]
    assert kernels.row_major(block) is block
    last = block[:, -2:]  # [2, 2, 8] with the block's strides
    copied = kernels.row_major(last)
    assert not _foldable(last) and _foldable(copied) and copied.stride() == (16, 8, 1) and torch.equal(copied, last)
    one = torch.randn(1, 3, 8)[:, -1:]  # "contiguous" by PyTorch's rule (size-1 dims), yet not foldable
    assert one.is_contiguous() and not _foldable(one) and _foldable(kernels.row_major(one))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_output_layer_takes_one_product_on_a_slice(family):
    """Weights that do not require grad (as accelerate loads offloaded ones) and a slice of the last positions:
    stock `F.linear` multiplies by the weight expanded to a batch (`bmm`, a copy of the weight first), inside
    `row_major_output` it is one matrix product, with the same logits."""
    model = tiny_model(family, seed=3, dtype=torch.float32).requires_grad_(False)
    hidden = torch.randn(2, 6, model.config.hidden_size)[:, -2:]  # [2, 2, hidden]
    with torch.no_grad():
        with _Ops() as stock:
            expected = model.lm_head(hidden)
        with row_major_output(model), _Ops() as folded:
            logits = model.lm_head(hidden)
    assert "bmm" in stock.names  # the PyTorch behaviour `row_major_output` works around
    assert "bmm" not in folded.names and {"mm", "addmm"} & set(folded.names)
    torch.testing.assert_close(logits, expected)
    assert not model.lm_head._forward_pre_hooks  # removed on exit


def test_the_loop_feeds_output_layers_row_major_and_matches_plain_greedy():
    target = tiny_model("qwen2", seed=5, dtype=torch.float32).requires_grad_(False)
    draft = perturbed(target, scale=0.05, seed=4).requires_grad_(False)
    ids, mask = left_padded_prompts([4, 9, 7], seed=3)
    expected = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=12)
    given: list[bool] = []  # per output-layer call: whether the model handed it a foldable input
    taken: list[bool] = []  # whether the layer computed on a foldable one
    hooks = [hook for m in (target, draft) for hook in (
        m.lm_head.register_forward_pre_hook(lambda module, args: given.append(_foldable(args[0]))),  # runs first
        m.lm_head.register_forward_hook(lambda module, args, out: taken.append(_foldable(args[0]))),
    )]
    config = DynSpecConfig(policy="static", num_speculative_tokens=3, prefill_draft_confidence=0.0, draft_vocab_size=None)
    out = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=12, assistant_model=draft,
                          custom_generate=hf_dynspec.speculative_loop, dynspec_config=config)
    for hook in hooks:
        hook.remove()
    assert torch.equal(out, expected)
    assert not all(given)  # prefills keep the last positions of a wider block: slices matmul cannot fold
    assert len(taken) == len(given) and all(taken)
