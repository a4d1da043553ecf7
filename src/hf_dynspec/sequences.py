"""The token buffer of a ragged batch: every row has its own number of generated tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenBatch:
    """Tokens of the active rows.

    Layout of `tokens` (`[batch, prompt_width + capacity]`): the left-padded prompt as `generate` received it in
    columns `[0, prompt_width)`, then each row's generated tokens from column `prompt_width` on, followed by `pad_id`.
    The buffer grows as rows generate (`append`, doubling up to `max_new_tokens`), so a large `max_new_tokens` with
    an early EOS costs no more per step than a small one.
    A row's *plain prefix* (`tokens[b, :prompt_width + num_generated[b]]`) is exactly the `input_ids` row plain
    `generate` would hold at the same point, so logits processors and stopping criteria see what they would see there.
    """

    tokens: torch.LongTensor  # [batch, prompt_width + capacity]
    prompt_width: int
    num_prompt: torch.LongTensor  # [batch] real (non-padding) prompt tokens per row
    num_generated: torch.LongTensor  # [batch] generated tokens per row
    pad_id: int
    row_ids: torch.LongTensor | None = None  # [batch] index of each row in the batch `generate` received
    original_batch_size: int = 0  # rows of the batch `generate` received (defaults to the current batch size)
    max_new_tokens: int | None = None  # tokens a row may generate at most (default: as many as the buffer holds)

    def __post_init__(self) -> None:
        if self.max_new_tokens is None:
            self.max_new_tokens = int(self.tokens.shape[1]) - self.prompt_width
        if self.row_ids is None:
            self.row_ids = torch.arange(self.tokens.shape[0], device=self.tokens.device)
        self.original_batch_size = self.original_batch_size or self.tokens.shape[0]

    @property
    def batch_size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_real(self) -> torch.LongTensor:
        """`[batch]` real tokens per row (prompt without padding plus generated)."""
        return self.num_prompt + self.num_generated

    @property
    def remaining(self) -> torch.LongTensor:
        """`[batch]` tokens each row may still generate."""
        return self.max_new_tokens - self.num_generated

    def last_tokens(self) -> torch.LongTensor:
        """`[batch]` the newest token of each row."""
        index = (self.prompt_width + self.num_generated - 1).unsqueeze(1)  # [batch, 1]
        return self.tokens.gather(1, index).squeeze(1)

    def plain_prefix(self, row: int, extra: torch.LongTensor | None = None) -> torch.LongTensor:
        """`[1, length]` the row as plain `generate` would hold it, optionally followed by `extra` tokens."""
        prefix = self.tokens[row, : self.prompt_width + int(self.num_generated[row])]
        if extra is not None and extra.numel():
            prefix = torch.cat([prefix, extra.to(prefix.device)])
        return prefix.unsqueeze(0)

    def real_tokens(self, row: int) -> torch.LongTensor:
        """`[num_real]` the row's tokens without padding."""
        start = self.prompt_width - int(self.num_prompt[row])
        return self.tokens[row, start : self.prompt_width + int(self.num_generated[row])]

    def tail(self, num_seen: torch.LongTensor) -> tuple[torch.LongTensor, torch.LongTensor, torch.LongTensor]:
        """The tokens a model has not processed yet, as one end-aligned block.

        Args:
            num_seen: `[batch]` real tokens of each row already in the model's KV cache.

        Returns:
            `ids` `[batch, width]`, `mask` `[batch, width]` (1 on real tail tokens, 0 on left padding) and
            `positions` `[batch, width]`. Each row's newest token sits in the last column.
        """
        tail_lengths = self.num_real - num_seen  # [batch]
        width = int(tail_lengths.max())
        offsets = torch.arange(width, device=self.tokens.device) - width  # [width], -width .. -1
        end = (self.prompt_width + self.num_generated).unsqueeze(1)  # [batch, 1]
        columns = (end + offsets).clamp(min=0)  # [batch, width]
        ids = self.tokens.gather(1, columns)
        mask = (offsets.unsqueeze(0) >= -tail_lengths.unsqueeze(1)).long()  # [batch, width]
        positions = (self.num_real.unsqueeze(1) + offsets).clamp(min=0)  # [batch, width]
        ids = torch.where(mask.bool(), ids, torch.full_like(ids, self.pad_id))
        return ids, mask, positions

    def append(self, new_tokens: torch.LongTensor, counts: torch.LongTensor) -> None:
        """Write `counts[b]` tokens of `new_tokens[b]` (`[batch, width]`) after each row's generated tokens."""
        width = new_tokens.shape[1]
        if width == 0:
            return
        offsets = torch.arange(width, device=self.tokens.device)
        columns = self.prompt_width + self.num_generated.unsqueeze(1) + offsets  # [batch, width]
        keep = offsets.unsqueeze(0) < counts.unsqueeze(1)
        capacity = int(self.tokens.shape[1]) - self.prompt_width
        needed = int((self.num_generated + counts).max())
        grow = max(needed, min(2 * capacity, self.max_new_tokens)) - capacity if needed > capacity else 0
        sink = self.tokens.shape[1] + grow  # the column dropped entries are written to, cut below
        columns = torch.where(keep, columns, torch.full_like(columns, sink))
        padded = widen(self.tokens, grow + 1, self.pad_id)
        padded.scatter_(1, columns, torch.where(keep, new_tokens, padded.gather(1, columns)))
        self.tokens = padded[:, :-1]
        self.num_generated = self.num_generated + counts

    def select_rows(self, keep: torch.LongTensor) -> TokenBatch:
        """A batch holding only the rows at indices `keep`."""
        return TokenBatch(
            tokens=self.tokens[keep],
            prompt_width=self.prompt_width,
            num_prompt=self.num_prompt[keep],
            num_generated=self.num_generated[keep],
            pad_id=self.pad_id,
            row_ids=self.row_ids[keep],
            original_batch_size=self.original_batch_size,
            max_new_tokens=self.max_new_tokens,
        )


def widen(tokens: torch.LongTensor, columns: int, pad_id: int) -> torch.LongTensor:
    """`tokens` (`[rows, width]`) followed by `columns` columns of `pad_id`: `[rows, width + columns]`."""
    return torch.cat([tokens, tokens.new_full((tokens.shape[0], columns), pad_id)], dim=1)


class EmittedScores:
    """Per row of the batch `generate` received, the scores (or logits) before each token it emitted; gathered at the
    end into `generate`'s `scores` / `logits`: one `[rows, vocab]` tensor per generated position."""

    def __init__(self, num_rows: int, pad_id: int) -> None:
        self.rows: list[list[torch.Tensor]] = [[] for _ in range(num_rows)]  # per row, `[tokens, vocab]` chunks
        self.pad_id = pad_id

    def add(self, row_ids: torch.LongTensor, counts: torch.LongTensor, values: torch.Tensor) -> None:
        """Record row `i`'s first `counts[i]` of `values` (`[batch, width, vocab]`), the rows of `row_ids`."""
        for i, (row, count) in enumerate(zip(row_ids.tolist(), counts.tolist())):
            if count:
                self.rows[row].append(values[i, :count].clone())

    def truncate(self, row: int, length: int) -> None:
        """Keep only row `row`'s values before its first `length` emitted tokens."""
        values = torch.cat(self.rows[row])[:length] if self.rows[row] else None
        self.rows[row] = [values] if values is not None and values.shape[0] else []

    def per_position(self, positions: int) -> tuple[torch.Tensor, ...]:
        """`positions` tensors `[rows, vocab]`. After its last token a row emits padding, as in plain `generate`; its
        scores there are 0 at the pad id and -inf elsewhere (the pad token is certain), not the model's output."""
        emitted = {row: torch.cat(values) for row, values in enumerate(self.rows) if values}  # [tokens, vocab] each
        if not emitted:
            return ()
        first = next(iter(emitted.values()))
        out = first.new_full((positions, len(self.rows), first.shape[-1]), float("-inf"))  # [positions, rows, vocab]
        out[:, :, self.pad_id] = 0.0
        for row, values in emitted.items():
            out[: values.shape[0], row] = values
        return tuple(out.unbind(0))
