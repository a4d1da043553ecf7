"""Logits processors over ragged rows and several positions per row, exactly as plain `generate` applies them.

Plain `generate` calls each processor with the `input_ids` it holds at that point. In the speculative loop, row `b`
at position `j` of a step stands where plain decoding would hold the row's plain prefix followed by its first `j`
draft tokens. Processors that never read `input_ids` (temperature, top-k, top-p, ...) run once over every row and
position; any other processor (repetition penalty, minimum length, user processors, ...) runs once per row and
position with that exact prefix, so the processed scores equal plain decoding's.
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
        last = scores.shape[1] if lengths is None else min(scores.shape[1], int(lengths[row]) - first_position + 1)
        for i in range(max(last, 1)):
            prefix = batch.plain_prefix(row, drafts[row, : first_position + i])  # [1, length]
            out[row, i] = processor(prefix, scores[row, i].unsqueeze(0)).squeeze(0)
    return out
