"""`batch_table`: a draft length per batch-size range, in vLLM's `--speculative-config` schema.

The table is vLLM's `num_speculative_tokens_per_batch_size`, a list of `[start_bs, end_bs, k]` entries: while the
number of active rows lies in `[start_bs, end_bs]` (both ends included) every row drafts `k` tokens.
`num_speculative_tokens` is the maximum; like vLLM, a `k` above it is clamped to it. A batch size outside every range
drafts the maximum by default (`outside_ranges="maximum"`); `outside_ranges="previous"` instead uses the `k` of the
closest range below it, which is what vLLM's current lookup does for gaps and for batch sizes above the last range.
A vLLM speculative config loads unchanged: `method`, `model` and vLLM's other keys are accepted and ignored.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .base import DraftLengthPolicy, PolicyInput

SCHEDULE_KEY = "num_speculative_tokens_per_batch_size"
OUTSIDE_RANGES = ("maximum", "previous")


@dataclass(frozen=True)
class BatchRange:
    """One table entry: batch sizes `start..end` (inclusive) draft `k` tokens; `index` is its position in the list."""

    start: int
    end: int
    k: int
    index: int

    def describe(self) -> str:
        return f"entry {self.index} ([{self.start}, {self.end}, {self.k}])"


def parse_batch_table(entries: Any) -> list[BatchRange]:
    """Validate vLLM's `num_speculative_tokens_per_batch_size` list; returns its ranges sorted by start.

    Raises `ValueError` naming the offending entry for a malformed, inverted or overlapping range or a negative `k`.
    """
    if not isinstance(entries, (list, tuple)) or not entries:
        raise ValueError(
            f"`{SCHEDULE_KEY}` must be a non-empty list of [start_bs, end_bs, k] entries, got {entries!r}."
        )
    ranges = [_parse_entry(index, entry) for index, entry in enumerate(entries)]
    ordered = sorted(ranges, key=lambda r: r.start)
    for before, after in zip(ordered, ordered[1:]):
        if after.start <= before.end:
            raise ValueError(
                f"`{SCHEDULE_KEY}` {before.describe()} and {after.describe()} overlap at batch sizes "
                f"{after.start}..{min(before.end, after.end)}; every batch size may appear in one range only."
            )
    return ordered


def _parse_entry(index: int, entry: Any) -> BatchRange:
    where = f"`{SCHEDULE_KEY}` entry {index} ({entry!r})"
    if isinstance(entry, (list, tuple)) and len(entry) == 5:
        raise ValueError(f"{where} has 5 items (context-length ranges); only [start_bs, end_bs, k] entries are supported.")
    if not isinstance(entry, (list, tuple)) or len(entry) != 3:
        raise ValueError(f"{where} must be a list [start_bs, end_bs, k] of three integers.")
    if any(isinstance(v, bool) or not isinstance(v, int) for v in entry):
        raise ValueError(f"{where} must hold integers only.")
    start, end, k = entry
    if start < 1:
        raise ValueError(f"{where}: start_bs must be >= 1.")
    if start > end:
        raise ValueError(f"{where} is inverted: start_bs {start} > end_bs {end}.")
    if k < 0:
        raise ValueError(f"{where}: k must be >= 0 (0 disables speculation for that range).")
    return BatchRange(start, end, k, index)


class BatchTablePolicy(DraftLengthPolicy):
    """Every row drafts the `k` of the table range holding the current number of active rows."""

    name = "batch_table"

    def __init__(
        self,
        num_speculative_tokens: int,
        table: list[list[int]] | list[BatchRange],
        outside_ranges: str = "maximum",
    ) -> None:
        """
        Args:
            num_speculative_tokens: the maximum draft length (vLLM's `num_speculative_tokens`).
            table: `[start_bs, end_bs, k]` entries (vLLM's `num_speculative_tokens_per_batch_size`).
            outside_ranges: `"maximum"` or `"previous"`, what a batch size in no range drafts (see module docs).
        """
        valid = isinstance(num_speculative_tokens, int) and not isinstance(num_speculative_tokens, bool)
        if not valid or num_speculative_tokens < 1:
            raise ValueError(f"`num_speculative_tokens` must be an integer >= 1, got {num_speculative_tokens!r}.")
        if outside_ranges not in OUTSIDE_RANGES:
            raise ValueError(f"`outside_ranges` must be one of {list(OUTSIDE_RANGES)}, got {outside_ranges!r}.")
        if table and all(isinstance(r, BatchRange) for r in table):
            self.ranges = sorted(table, key=lambda r: r.start)
        else:
            self.ranges = parse_batch_table(table)
        self.num_speculative_tokens = num_speculative_tokens
        self.outside_ranges = outside_ranges
        self.clamped = [r for r in self.ranges if r.k > num_speculative_tokens]  # entries whose k exceeds the maximum
        self.ignored_keys: list[str] = []
        self._starts = [r.start for r in self.ranges]

    @classmethod
    def from_vllm_config(cls, source: dict[str, Any] | str | Path, outside_ranges: str = "maximum") -> BatchTablePolicy:
        """Load vLLM's `--speculative-config`: a dict, a path to a JSON file, or the JSON text itself.

        Requires `num_speculative_tokens` and `num_speculative_tokens_per_batch_size`; `method` and `model` must be
        strings when present; every other key is accepted and ignored (listed in `ignored_keys`).
        """
        config = _read_vllm_config(source)
        for key in ("num_speculative_tokens", SCHEDULE_KEY):
            if key not in config:
                raise ValueError(f"The vLLM speculative config lacks `{key}`; it has keys {sorted(config)}.")
        for key in ("method", "model"):
            if config.get(key) is not None and not isinstance(config[key], str):
                raise ValueError(f"`{key}` in the vLLM speculative config must be a string, got {config[key]!r}.")
        policy = cls(config["num_speculative_tokens"], config[SCHEDULE_KEY], outside_ranges)
        policy.ignored_keys = sorted(set(config) - {"num_speculative_tokens", SCHEDULE_KEY})
        return policy

    def to_vllm_config(self, method: str | None = None, model: str | None = None) -> dict[str, Any]:
        """The table as vLLM's `--speculative-config` dict (with `method` and `model` when given)."""
        config: dict[str, Any] = {}
        if method is not None:
            config["method"] = method
        if model is not None:
            config["model"] = model
        config["num_speculative_tokens"] = self.num_speculative_tokens
        config[SCHEDULE_KEY] = [[r.start, r.end, r.k] for r in sorted(self.ranges, key=lambda r: r.index)]
        return config

    def length_for(self, batch_size: int) -> int:
        """The draft length (before the loop's own cap) used at `batch_size` active rows."""
        position = bisect.bisect_right(self._starts, batch_size) - 1
        if position < 0:
            return self.num_speculative_tokens
        found = self.ranges[position]
        if batch_size > found.end and self.outside_ranges == "maximum":
            return self.num_speculative_tokens
        return min(found.k, self.num_speculative_tokens)

    def draft_lengths(self, request: PolicyInput) -> torch.LongTensor:
        k = min(self.length_for(request.batch_size), request.max_draft_tokens)
        return torch.full((request.batch_size,), k, dtype=torch.long)


def _read_vllm_config(source: dict[str, Any] | str | Path) -> dict[str, Any]:
    if isinstance(source, dict):
        return source
    if not isinstance(source, (str, Path)):
        raise ValueError(f"A vLLM speculative config is a dict, a JSON file path or JSON text, got {type(source).__name__}.")
    text = str(source)
    if text.lstrip().startswith("{"):
        data = _parse_json(text, "the given JSON text")
    else:
        path = Path(text)
        if not path.is_file():
            raise ValueError(f"vLLM speculative config file {text!r} does not exist (pass a dict, a path or JSON text).")
        data = _parse_json(path.read_text(), text)
    if not isinstance(data, dict):
        raise ValueError(f"A vLLM speculative config is a JSON object, got {type(data).__name__}.")
    return data


def _parse_json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"Could not parse {where} as JSON: {error}.") from error
