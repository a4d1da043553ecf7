"""Stopping criteria called as plain `generate` calls them, although the loop's rows advance at different speeds.

Plain `generate` calls its stopping criteria once per generated position `t = 1, 2, ...` with the whole batch:
`input_ids` `[rows, prompt_width + t]` in the caller's row order (rows that finished earlier hold padding after their
last token) and the processed scores `[rows, vocab]` that chose token `t`. Criteria may keep per-row state between
calls (lm-evaluation-harness's `MultiTokenEOSCriteria` keeps a done flag per row and answers for the whole batch;
transformers' own answer per row). In the loop a row may accept several tokens in one step and run ahead of the
others, so [`LockstepCriteria`] records what each row emits and calls the criteria for position `t` only once every
row still running has reached it; a row a criterion stops at `t` is cut back to `t` tokens (what it generated past
`t` is dropped), exactly where plain `generate` would have stopped it.

Criteria whose answer for a row depends on that row's tokens alone ([`answers_row_by_row`]: transformers' stop-string,
EOS and length criteria, or any criterion with `answers_row_by_row = True`) give the same answers whenever they are
asked, so the loop asks them one row at a time as soon as the row has the token: a row they stop does not wait for
the slowest row of the batch.
"""

from __future__ import annotations

import torch
from transformers import StoppingCriteria
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StopStringCriteria

from .sequences import widen

ROW_BY_ROW_CRITERIA = (StopStringCriteria, EosTokenCriteria, MaxLengthCriteria)
"""transformers' criteria that answer for each row from its own tokens."""


def answers_row_by_row(criterion: StoppingCriteria) -> bool:
    """Whether `criterion` answers for each row from that row's tokens alone, so that asking it about one row at a
    time, whenever that row has its token, gives the answers plain `generate` gets (declare it on a criterion of your
    own with a class attribute `answers_row_by_row = True`)."""
    return isinstance(criterion, ROW_BY_ROW_CRITERIA) or getattr(criterion, "answers_row_by_row", False) is True


class LockstepCriteria:
    """Stopping criteria over the batch `generate` received, called position by position (see the module docstring).

    Args:
        criteria: the criteria the loop does not apply itself (stop strings, user or client criteria).
        input_ids: `[rows, prompt_width]` the left-padded prompts.
        pad_id: the token of rows after their end.
    """

    def __init__(self, criteria: list[StoppingCriteria], input_ids: torch.LongTensor, pad_id: int) -> None:
        self.criteria = criteria
        self.prompt_width = input_ids.shape[1]
        self.tokens = input_ids.clone()  # [rows, prompt_width + recorded], padding past each row's length
        self.lengths = torch.zeros(input_ids.shape[0], dtype=torch.long)  # [rows] generated tokens recorded
        self.final = torch.zeros(input_ids.shape[0], dtype=torch.bool)  # [rows] rows that generate nothing more
        self.pad_id = pad_id
        self.called = 0  # positions the criteria have been called for
        self.scores: list[list[torch.Tensor]] = [[] for _ in range(input_ids.shape[0])]  # per row, not yet called
        self._after_end: torch.Tensor | None = None  # [vocab] the scores of a row past its end: the pad is certain

    def record(
        self,
        row_ids: torch.LongTensor,
        emitted: torch.LongTensor,
        counts: torch.LongTensor,
        finished: torch.BoolTensor,
        scores: torch.Tensor,
    ) -> None:
        """Record one step of the active rows `row_ids` (`[batch]`): `counts[b]` tokens of `emitted[b]`
        (`[batch, width]`), the processed scores before each (`[batch, width, vocab]`), and which rows end here."""
        rows, counts = row_ids.tolist(), counts.tolist()
        needed = self.prompt_width + max(int(self.lengths[r]) + c for r, c in zip(rows, counts))
        if needed > self.tokens.shape[1]:
            grow = max(needed, 2 * self.tokens.shape[1] - self.prompt_width) - self.tokens.shape[1]
            self.tokens = widen(self.tokens, grow, self.pad_id)
        for i, (row, count) in enumerate(zip(rows, counts)):
            start = self.prompt_width + int(self.lengths[row])
            self.tokens[row, start : start + count] = emitted[i, :count].to(self.tokens.device)
            self.scores[row].extend(scores[i, :count].unbind(0))
            self.lengths[row] += count
        self.final[row_ids.cpu()] |= finished.cpu()

    def stops(self) -> dict[int, int]:
        """Call the criteria for every position each running row has reached; `{row: generated tokens}` for the rows
        a criterion stopped, each cut back to that position (every row that reached a position, when the criteria
        answer for the whole batch)."""
        stopped: dict[int, int] = {}
        running = ~self.final
        reached = int(self.lengths[running].min()) if bool(running.any()) else int(self.lengths.max())
        while self.called < reached:
            position = self.called + 1
            live = self.lengths >= position  # [rows] rows that generated a token at `position`
            if not bool(live.any()):
                break
            done = self._call(position) & live & ((self.lengths > position) | ~self.final)  # [rows] newly stopped
            for row in done.nonzero().flatten().tolist():
                self._cut(row, position)
                stopped[row] = position
            self.final |= done
            self.called = position
            for row_scores in self.scores:
                if row_scores:
                    row_scores.pop(0)
        return stopped

    def _call(self, position: int) -> torch.BoolTensor:
        """`[rows]` whether the criteria stop each row after its `position`-th generated token."""
        ids = self.tokens[:, : self.prompt_width + position]  # [rows, prompt_width + position]
        scores = torch.stack([row[0] if row else self._pad_certain() for row in self.scores])  # [rows, vocab]
        done = torch.zeros(ids.shape[0], dtype=torch.bool)
        for criterion in self.criteria:
            answer = torch.as_tensor(criterion(ids, scores)).cpu()
            done |= answer.bool().expand_as(done)  # a scalar answer is the whole batch's, as in `generate`
        return done

    def _pad_certain(self) -> torch.Tensor:
        if self._after_end is None:
            template = next(row[0] for row in self.scores if row)
            self._after_end = torch.full_like(template, float("-inf"))
            self._after_end[self.pad_id] = 0.0
        return self._after_end

    def _cut(self, row: int, length: int) -> None:
        """Drop row `row`'s tokens after its first `length` generated ones."""
        self.tokens[row, self.prompt_width + length :] = self.pad_id
        del self.scores[row][length - self.called :]
        self.lengths[row] = length
