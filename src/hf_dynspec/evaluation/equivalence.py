"""Telling low-precision rounding from bugs when a speculative greedy run differs from plain greedy decoding.

In bfloat16 a forward over several tokens adds numbers in another order than one-token forwards over a KV cache, so
the target's logits differ in the last bits. Where plain greedy decoding's top two tokens are within rounding of
each other, a speculative run may pick the runner-up, and the row's tail differs from then on. A bug (a wrong mask, a
hole read as a token, a position off by one) makes rows differ too, but not only at near ties.

- `MarginRecorder` records, during a plain greedy run, each row's best `CONTENDERS` tokens and their gaps to the top
  score at every position.
- `rounding_bound` is the largest margin rounding alone can flip: `TIE_ULPS` units in the last place of the dtype at
  the magnitude of the top logit (measured with `evaluation/rounding.py`, see docs/verification.md).
- `classify` names each row of a speculative run: `identical`, `near_tie` (first divergence at a token whose plain
  score is within the bound of plain's top score: the runner-up, or a third token at a tie of three) or `mismatch`
  (anything else).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from transformers import LogitsProcessor

MANTISSA_BITS: dict[torch.dtype, int] = {
    torch.bfloat16: 7,
    torch.float16: 10,
    torch.float32: 23,
    torch.float64: 52,
}
"""Stored mantissa bits of each floating-point dtype."""

TIE_ULPS = 16
"""Largest top-2 margin that rounding alone can flip, in units in the last place of the top logit.

Measured with `evaluation/rounding.py` (one forward over k tokens against one-token forwards over a KV cache, k =
1..8, 64 prompts) on the tiny target: the top-2 margin moved by at most 2 ulps in bfloat16 and float16 (p99: 1) and
11 ulps in float32 (p99: 7). 16 is the next power of two above the largest change measured in any dtype, which
leaves bfloat16 a factor of eight for deeper models. See docs/verification.md.
"""

CONTENDERS = 8
"""How many of plain's best tokens the recorder keeps per position: a near tie may involve more than two tokens."""

Verdict = Literal["identical", "near_tie", "mismatch"]
VERDICTS: tuple[Verdict, ...] = ("identical", "near_tie", "mismatch")


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """`torch.bfloat16` from `torch.bfloat16`, `"bfloat16"` or `"torch.bfloat16"`."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    if dtype not in MANTISSA_BITS:
        raise ValueError(f"dtype must be one of {[str(d) for d in MANTISSA_BITS]}, got {dtype!r}.")
    return dtype


def ulp(dtype: torch.dtype | str, value: float) -> float:
    """The unit in the last place of `dtype` at the magnitude of `value`: `2**(floor(log2|value|) - mantissa_bits)`.

    Zero and non-finite values use the ulp at magnitude 1.
    """
    bits = MANTISSA_BITS[as_dtype(dtype)]
    exponent = math.floor(math.log2(abs(value))) if value != 0 and math.isfinite(value) else 0
    return 2.0 ** (exponent - bits)


def rounding_bound(dtype: torch.dtype | str, top1_value: float) -> float:
    """The largest top-2 margin that rounding alone can flip: `TIE_ULPS * ulp(dtype, top1_value)`."""
    return TIE_ULPS * ulp(dtype, top1_value)


# ---- recording plain greedy decoding --------------------------------------------------------------------------------
@dataclass
class RowMargins:
    """One row of a plain greedy run, per generated position: top two tokens of the processed scores and their gap."""

    top1: list[int]
    """Plain's token (the first of tied maxima, as greedy decoding picks)."""
    runner_up: list[int]
    """The best other token (at an exact tie, the other tied token)."""
    margin: list[float]
    """`top1 score - runner-up score` (processed scores, float32)."""
    top1_value: list[float]
    gaps: list[dict[int, float]]
    """Per position, `top1 score - score` of each of the next best tokens (`CONTENDERS - 1` of them, runner-up
    included): at a tie of three, a speculative run may take either of the two other tokens."""


class MarginRecorder(LogitsProcessor):
    """Records each row's best `CONTENDERS` tokens and their gaps to the top score at every step of plain `generate`; scores pass unchanged.

    Pass it as `logits_processor=LogitsProcessorList([recorder])`: `generate` runs custom processors after the ones it
    builds from the generation config (repetition penalty, minimum length, ...), and before the sampling warpers, so
    the recorder sees the scores greedy decoding takes its argmax of. Plain `generate` keeps every row in the batch
    until all have finished, so the i-th call scores position i of every row (positions after a row's EOS are
    recorded too and are irrelevant). One recorder serves one `generate` call.
    """

    def __init__(self) -> None:
        self._ids: list[torch.LongTensor] = []  # per step [batch, contenders]: plain's token first
        self._values: list[torch.Tensor] = []  # per step [batch, contenders], descending
        self._shape: tuple[int, int] | None = None  # (batch, input length) at the first call

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        batch, length = input_ids.shape  # input_ids [batch, length], scores [batch, vocab]
        if self._shape is None:
            self._shape = (batch, length)
        elif (batch, length) != (self._shape[0], self._shape[1] + len(self._ids)):
            raise ValueError(
                f"MarginRecorder expected input_ids of shape {(self._shape[0], self._shape[1] + len(self._ids))} "
                f"(one new token per call, every row kept), got {(batch, length)}; use a new recorder per "
                "`generate` call and only with plain greedy decoding."
            )
        values, ids = scores.topk(min(CONTENDERS, scores.shape[-1]), dim=-1)  # [batch, contenders]
        # greedy decoding takes the first of tied maxima, which topk may list later: swap it to the front (its value
        # equals the first one's, so `values` stays as it is)
        chosen = scores.argmax(dim=-1, keepdim=True)  # [batch, 1]
        slot = (ids == chosen).int().argmax(dim=-1, keepdim=True)  # [batch, 1]: where topk listed plain's token
        ids = ids.scatter(1, slot, ids[:, :1]).scatter(1, torch.zeros_like(slot), chosen)  # [batch, contenders]
        self._values.append(values)
        self._ids.append(ids)
        return scores

    def rows(self) -> list[RowMargins]:
        """Per row of the batch, what was recorded at each generated position."""
        if not self._ids:
            return []
        ids = torch.stack(self._ids, dim=1).tolist()  # [batch, steps, contenders]
        values = torch.stack(self._values, dim=1).float()  # [batch, steps, contenders]
        gaps = (values[..., :1] - values[..., 1:]).tolist()  # [batch, steps, contenders - 1]
        tops = values[..., 0].tolist()  # [batch, steps]
        return [
            RowMargins(
                top1=[best[0] for best in row],
                runner_up=[best[1] for best in row],
                margin=[gap[0] for gap in row_gaps],
                top1_value=top,
                gaps=[dict(zip(best[1:], gap)) for best, gap in zip(row, row_gaps)],
            )
            for row, row_gaps, top in zip(ids, gaps, tops)
        ]


# ---- classifying speculative rows ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class RowVerdict:
    """How one row of a speculative greedy run compares with plain greedy decoding.

    For `near_tie` and `mismatch`: the first divergent position (index into the new tokens), plain's top-2 margin and
    the rounding bound there, plain's token and runner-up there, the speculative run's token (`None` past the end of
    a row that stopped early) and its `gap`: plain's top score minus plain's score of that token (`None` when it is
    not among plain's best `CONTENDERS`).
    """

    verdict: Verdict
    position: int | None = None
    margin: float | None = None
    bound: float | None = None
    plain_token: int | None = None
    runner_up: int | None = None
    token: int | None = None
    gap: float | None = None


def classify(
    tokens: Sequence[Sequence[int]],
    reference: Sequence[Sequence[int]],
    margins: Sequence[RowMargins],
    dtype: torch.dtype | str,
) -> list[RowVerdict]:
    """One verdict per row of `tokens` (a speculative run's new tokens) against `reference` (plain's new tokens).

    `margins` are plain's recorded margins for the same rows, `dtype` the target's dtype. A row is a `near_tie` when
    at its first divergent position plain's score of the speculative token is within `rounding_bound(dtype, top1)` of
    plain's top score (plain's runner-up, or another token at a tie of three or more); any other difference is a `mismatch`, a length difference without a differing token
    included (one run stopped where the other went on).
    """
    dtype = as_dtype(dtype)
    if not len(tokens) == len(reference) == len(margins):
        raise ValueError(
            f"classify needs one reference row and one margins row per row: got {len(tokens)} rows, "
            f"{len(reference)} reference rows and {len(margins)} margins rows."
        )
    return [_classify_row(row, ref, row_margins, dtype) for row, ref, row_margins in zip(tokens, reference, margins)]


def _classify_row(row: Sequence[int], ref: Sequence[int], margins: RowMargins, dtype: torch.dtype) -> RowVerdict:
    row, ref = list(row), list(ref)
    if row == ref:
        return RowVerdict("identical")
    shared = min(len(row), len(ref))
    position = next((i for i in range(shared) if row[i] != ref[i]), shared)
    plain_token = ref[position] if position < len(ref) else None
    token = row[position] if position < len(row) else None
    if position >= len(margins.margin):
        return RowVerdict("mismatch", position, None, None, plain_token, None, token)
    margin, top1 = margins.margin[position], margins.top1_value[position]
    runner_up = margins.runner_up[position]
    bound = rounding_bound(dtype, top1)
    gap = margins.gaps[position].get(token) if position < shared else None
    tie = gap is not None and gap <= bound
    return RowVerdict("near_tie" if tie else "mismatch", position, margin, bound, plain_token, runner_up, token, gap)


def summarize(verdicts: Sequence[RowVerdict], dtype: torch.dtype | str, prompts: Sequence[int] | None = None) -> dict:
    """The results-file form: `{"identical": n, "near_tie": n, "mismatch": n, "dtype": ..., "rows": [...]}`.

    `rows` lists the divergent rows only, each with `prompt` (its index in `prompts`, by default its row index),
    `position`, `margin`, `bound`, `plain_token`, `runner_up`, `token`, `gap` and `verdict`. Non-finite margins and gaps
    (a token masked to -inf) are written as `None`.
    """
    counts = Counter(v.verdict for v in verdicts)
    rows = []
    for index, verdict in enumerate(verdicts):
        if verdict.verdict == "identical":
            continue
        entry: dict[str, Any] = {"prompt": prompts[index] if prompts is not None else index, **asdict(verdict)}
        for name in ("margin", "gap"):
            if entry[name] is not None and not math.isfinite(entry[name]):
                entry[name] = None
        rows.append(entry)
    return {**{name: counts.get(name, 0) for name in VERDICTS}, "dtype": str(as_dtype(dtype)).removeprefix("torch."),
            "rows": rows}
