"""The token buffer of a ragged batch: every row has its own number of generated tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class HostRows:
    """A copy on the host of a `TokenBatch`'s tokens and per-row counts, kept in step with it: every decision the
    loop, its policy and its proposers take from them (draft lengths, buffer sizes, prompt lookup) reads no device
    value. On a CPU it is a copy all the same, so writes to one never reach the other."""

    tokens: torch.LongTensor  # [batch, prompt_width + capacity] as `TokenBatch.tokens`
    num_prompt: torch.LongTensor  # [batch]
    num_generated: torch.LongTensor  # [batch]
    row_ids: torch.LongTensor  # [batch]

    @classmethod
    def of(cls, tokens: torch.Tensor, num_prompt: torch.Tensor, num_generated: torch.Tensor, row_ids: torch.Tensor):
        """Copies of the given device tensors (a read of the device: once per `generate` call)."""
        return cls(*(tensor.to("cpu", copy=True) for tensor in (tokens, num_prompt, num_generated, row_ids)))


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
    host: HostRows | None = None  # the same on the host (default: copied, a read of the device)

    def __post_init__(self) -> None:
        if self.max_new_tokens is None:
            self.max_new_tokens = int(self.tokens.shape[1]) - self.prompt_width
        if self.row_ids is None:
            self.row_ids = torch.arange(self.tokens.shape[0], device=self.tokens.device)
        self.original_batch_size = self.original_batch_size or self.tokens.shape[0]
        if self.host is None:
            self.host = HostRows.of(self.tokens, self.num_prompt, self.num_generated, self.row_ids)

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

    @property
    def host_num_real(self) -> torch.LongTensor:
        """`num_real` on the host."""
        return self.host.num_prompt + self.host.num_generated

    @property
    def host_remaining(self) -> torch.LongTensor:
        """`remaining` on the host."""
        return self.max_new_tokens - self.host.num_generated

    def last_tokens(self) -> torch.LongTensor:
        """`[batch]` the newest token of each row."""
        index = (self.prompt_width + self.num_generated - 1).unsqueeze(1)  # [batch, 1]
        return self.tokens.gather(1, index).squeeze(1)

    def host_last_tokens(self) -> torch.LongTensor:
        """`last_tokens` on the host."""
        index = (self.prompt_width + self.host.num_generated - 1).unsqueeze(1)  # [batch, 1]
        return self.host.tokens.gather(1, index).squeeze(1)

    def plain_prefix(self, row: int, extra: torch.LongTensor | None = None) -> torch.LongTensor:
        """`[1, length]` the row as plain `generate` would hold it, optionally followed by `extra` tokens."""
        prefix = self.tokens[row, : self.prompt_width + int(self.host.num_generated[row])]
        if extra is not None and extra.numel():
            prefix = torch.cat([prefix, extra.to(prefix.device)])
        return prefix.unsqueeze(0)

    def real_tokens(self, row: int) -> torch.LongTensor:
        """`[num_real]` the row's tokens without padding."""
        return self.tokens[row, self._real_columns(row)]

    def host_real_tokens(self, row: int) -> torch.LongTensor:
        """`real_tokens` on the host."""
        return self.host.tokens[row, self._real_columns(row)]

    def _real_columns(self, row: int) -> slice:
        start = self.prompt_width - int(self.host.num_prompt[row])
        return slice(start, self.prompt_width + int(self.host.num_generated[row]))

    def tail(
        self, num_seen: torch.LongTensor, width: int | None = None
    ) -> tuple[torch.LongTensor, torch.LongTensor, torch.LongTensor]:
        """The tokens a model has not processed yet, as one end-aligned block.

        Args:
            num_seen: `[batch]` real tokens of each row already in the model's KV cache.
            width: the longest row's count of such tokens, when known on the host (else read from the device).

        Returns:
            `ids` `[batch, width]`, `mask` `[batch, width]` (1 on real tail tokens, 0 on left padding) and
            `positions` `[batch, width]`. Each row's newest token sits in the last column.
        """
        tail_lengths = self.num_real - num_seen  # [batch]
        width = int(tail_lengths.max()) if width is None else width
        offsets = torch.arange(width, device=self.tokens.device) - width  # [width], -width .. -1
        end = (self.prompt_width + self.num_generated).unsqueeze(1)  # [batch, 1]
        columns = (end + offsets).clamp(min=0)  # [batch, width]
        ids = self.tokens.gather(1, columns)
        mask = (offsets.unsqueeze(0) >= -tail_lengths.unsqueeze(1)).long()  # [batch, width]
        positions = (self.num_real.unsqueeze(1) + offsets).clamp(min=0)  # [batch, width]
        ids = torch.where(mask.bool(), ids, torch.full_like(ids, self.pad_id))
        return ids, mask, positions

    def append(
        self,
        new_tokens: torch.LongTensor,
        counts: torch.LongTensor,
        host_tokens: torch.LongTensor | None = None,
        host_counts: torch.LongTensor | None = None,
    ) -> None:
        """Write `counts[b]` tokens of `new_tokens[b]` (`[batch, width]`) after each row's generated tokens.

        `host_tokens` and `host_counts`: the same on the host, when the caller has them (else read from the device).
        """
        width = new_tokens.shape[1]
        if width == 0:
            return
        host_tokens = new_tokens.to("cpu", copy=True) if host_tokens is None else host_tokens
        host_counts = counts.to("cpu", copy=True) if host_counts is None else host_counts
        capacity = int(self.tokens.shape[1]) - self.prompt_width
        needed = int((self.host.num_generated + host_counts).max())
        grow = max(needed, min(2 * capacity, self.max_new_tokens)) - capacity if needed > capacity else 0
        self.tokens = _written(self.tokens, self.prompt_width, self.num_generated, new_tokens, counts, grow, self.pad_id)
        self.num_generated = self.num_generated + counts
        host = self.host
        host.tokens = _written(host.tokens, self.prompt_width, host.num_generated, host_tokens, host_counts, grow,
                               self.pad_id)
        host.num_generated = host.num_generated + host_counts

    def select_rows(self, keep: torch.LongTensor, host_keep: torch.LongTensor | None = None) -> TokenBatch:
        """A batch holding only the rows at indices `keep` (`host_keep`: the same on the host, if the caller has it)."""
        host_keep = keep.to("cpu", copy=True) if host_keep is None else host_keep
        host = self.host
        return TokenBatch(
            tokens=self.tokens[keep],
            prompt_width=self.prompt_width,
            num_prompt=self.num_prompt[keep],
            num_generated=self.num_generated[keep],
            pad_id=self.pad_id,
            row_ids=self.row_ids[keep],
            original_batch_size=self.original_batch_size,
            max_new_tokens=self.max_new_tokens,
            host=HostRows(host.tokens[host_keep], host.num_prompt[host_keep], host.num_generated[host_keep],
                          host.row_ids[host_keep]),
        )


def _written(
    tokens: torch.LongTensor,  # [batch, prompt_width + capacity]
    prompt_width: int,
    num_generated: torch.LongTensor,  # [batch]
    new_tokens: torch.LongTensor,  # [batch, width]
    counts: torch.LongTensor,  # [batch]
    grow: int,
    pad_id: int,
) -> torch.LongTensor:
    """`tokens` widened by `grow` columns, with `counts[b]` of `new_tokens[b]` written after row `b`'s generated
    tokens (all on the device of `tokens`)."""
    offsets = torch.arange(new_tokens.shape[1], device=tokens.device)
    columns = prompt_width + num_generated.unsqueeze(1) + offsets  # [batch, width]
    keep = offsets.unsqueeze(0) < counts.unsqueeze(1)
    sink = tokens.shape[1] + grow  # the column dropped entries are written to, cut below
    columns = torch.where(keep, columns, torch.full_like(columns, sink))
    padded = widen(tokens, grow + 1, pad_id)
    padded.scatter_(1, columns, torch.where(keep, new_tokens, padded.gather(1, columns)))
    return padded[:, :-1]


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
