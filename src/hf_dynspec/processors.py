"""Logits processors over ragged rows and several positions per row, exactly as plain `generate` applies them.

Plain `generate` calls each processor with the `input_ids` it holds at that point. In the speculative loop, row `b`
at position `j` of a step stands where plain decoding would hold the row's plain prefix followed by its first `j`
draft tokens. Processors that never read `input_ids` (temperature, top-k, top-p, ...) run once over every row and
position; any other processor (repetition penalty, minimum length, user processors, ...) runs once per row and
position with that exact prefix, placed in the row's slot of a batch as wide as the one `generate` received (some
processors keep per-row state, such as the repetition penalty's padding lengths), so the processed scores equal plain
decoding's. The repetition penalty, which model generation configs often set, has a vectorised path.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from .sequences import TokenBatch

# Processors whose output depends on the scores alone, never on `input_ids`.
PREFIX_FREE_PROCESSORS = (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    MinPLogitsWarper,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)


def process_logits(
    processors: LogitsProcessorList,
    batch: TokenBatch,
    drafts: torch.LongTensor,
    scores: torch.Tensor,
    first_position: int = 0,
    lengths: torch.LongTensor | None = None,
) -> torch.Tensor:
    """Apply `processors` to scores at several positions of every row.

    Args:
        processors: the list `generate` prepared.
        batch: the rows' committed tokens.
        drafts: `[batch, >= first_position + positions - 1]` draft tokens of this step.
        scores: `[batch, positions, vocab]` float32 logits; position `i` follows the row's plain prefix and
            `drafts[:, :first_position + i]`.
        first_position: number of draft tokens before the first position of `scores`.
        lengths: `[batch]` optional draft lengths; positions past `lengths[b]` are never read by the verifier, so
            prefix-dependent processors skip them (their scores stay unprocessed).

    Returns:
        `[batch, positions, vocab]` processed scores.
    """
    if not processors:
        return scores
    num_rows, positions, vocab = scores.shape
    for processor in processors:
        if isinstance(processor, PREFIX_FREE_PROCESSORS):
            flat_ids = scores.new_zeros((num_rows * positions, 0), dtype=torch.long)
            scores = processor(flat_ids, scores.reshape(-1, vocab)).reshape(num_rows, positions, vocab)
        elif type(processor) is RepetitionPenaltyLogitsProcessor:
            scores = _repetition_penalty(processor, batch, drafts, scores, first_position)
        else:
            scores = _apply_per_prefix(processor, batch, drafts, scores, first_position, lengths)
    return scores


def _apply_per_prefix(
    processor,
    batch: TokenBatch,
    drafts: torch.LongTensor,
    scores: torch.Tensor,
    first_position: int,
    lengths: torch.LongTensor | None,
) -> torch.Tensor:
    out = scores.clone()
    for row in range(scores.shape[0]):
        slot = int(batch.row_ids[row])
        last = scores.shape[1] if lengths is None else min(scores.shape[1], int(lengths[row]) - first_position + 1)
        for i in range(max(last, 1)):
            prefix = batch.plain_prefix(row, drafts[row, : first_position + i])  # [1, length]
            # The row sits in its own slot of a batch as wide as the original one; the other slots are copies.
            wide_ids = prefix.expand(batch.original_batch_size, -1)
            wide_scores = scores[row, i].unsqueeze(0).expand(wide_ids.shape[0], -1).clone()
            out[row, i] = processor(wide_ids, wide_scores)[slot]
    return out


def _repetition_penalty(
    processor: RepetitionPenaltyLogitsProcessor,
    batch: TokenBatch,
    drafts: torch.LongTensor,
    scores: torch.Tensor,
    first_position: int,
) -> torch.Tensor:
    """Vectorised `RepetitionPenaltyLogitsProcessor` over rows and positions (same formula, same ignored prompt)."""
    num_rows, positions, vocab = scores.shape
    ignore = processor.prompt_ignore_length
    if ignore is None:
        start = torch.zeros_like(batch.num_generated)
    elif isinstance(ignore, int):
        start = torch.full_like(batch.num_generated, ignore)
    else:
        start = ignore.to(batch.row_ids.device)[batch.row_ids]
    columns = torch.arange(batch.tokens.shape[1], device=batch.tokens.device).unsqueeze(0)
    end = (batch.prompt_width + batch.num_generated).unsqueeze(1)
    in_prefix = (columns >= start.unsqueeze(1)) & (columns < end)  # [batch, width]
    ids = torch.where(in_prefix, batch.tokens.clamp(max=vocab), torch.full_like(batch.tokens, vocab))
    present = torch.zeros((num_rows, vocab + 1), dtype=torch.bool, device=scores.device)
    present.scatter_(1, ids.to(scores.device), True)
    if first_position:
        present.scatter_(1, drafts[:, :first_position].clamp(max=vocab).to(scores.device), True)
    out = torch.empty_like(scores)
    for i in range(positions):
        if i:
            present.scatter_(1, drafts[:, first_position + i - 1 : first_position + i].to(scores.device), True)
        row_scores = scores[:, i]
        penalised = torch.where(row_scores < 0, row_scores * processor.penalty, row_scores / processor.penalty)
        out[:, i] = torch.where(present[:, :vocab], penalised, row_scores)
    return out
