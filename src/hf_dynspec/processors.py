"""Logits processors over ragged rows and several positions per row, exactly as plain `generate` applies them.

Plain `generate` calls each processor with the `input_ids` it holds at that point. In the speculative loop, row `b`
at position `j` of a chain stands where plain decoding would hold the row's plain prefix followed by its first `j`
draft tokens; at node `j` of a token tree, followed by the draft tokens on the path from the root to `j`. Both are
*items*: a row and the draft tokens after its plain prefix. Processors that never read `input_ids` (temperature, top-k, top-p, ...) run once over every row and
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

from .candidates.tree import TokenTree
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
) -> torch.Tensor:
    """Apply `processors` to scores at several chain positions of every row.

    Args:
        processors: the list `generate` prepared.
        batch: the rows' committed tokens.
        drafts: `[batch, >= first_position + positions - 1]` draft tokens of this step.
        scores: `[batch, positions, vocab]` float32 logits; position `i` follows the row's plain prefix and
            `drafts[:, :first_position + i]`.
        first_position: number of draft tokens before the first position of `scores`.

    Returns:
        `[batch, positions, vocab]` processed scores.
    """
    if not processors:
        return scores
    num_rows, positions, vocab = scores.shape
    rows = torch.arange(num_rows, device=scores.device).repeat_interleave(positions)  # [batch * positions]
    depths = (first_position + torch.arange(positions, device=scores.device)).repeat(num_rows)  # [batch * positions]
    flat = process_path_logits(processors, batch, rows, drafts[rows], depths, scores.reshape(-1, vocab))
    return flat.reshape(num_rows, positions, vocab)


def process_tree_logits(
    processors: LogitsProcessorList, batch: TokenBatch, tree: TokenTree, scores: torch.Tensor
) -> torch.Tensor:
    """Apply `processors` to the scores at every valid node of `tree` (`[batch, nodes, vocab]`).

    The scores at node `j` follow the row's plain prefix and the draft tokens on the path from the root to `j`.
    Placeholder slots keep their unprocessed scores (the verifier never reads them). Processors that work row by row
    on the device (`PREFIX_FREE_PROCESSORS`, the repetition penalty) process every slot and the placeholders' scores
    are put back, so finding the valid nodes never reads the device; others run per valid node.
    """
    if not processors:
        return scores
    if row_wise(processors):
        num_rows, nodes, vocab = scores.shape
        rows = torch.arange(num_rows, device=scores.device).repeat_interleave(nodes)  # [batch * nodes]
        paths = tree.paths()[:, :, 1:].flatten(0, 1)  # [batch * nodes, depth] path nodes after the root, -1 padded
        drafts = tree.tokens[rows].gather(1, paths.clamp(min=0))  # [batch * nodes, depth]
        flat = process_path_logits(processors, batch, rows, drafts, tree.depths.flatten(), scores.flatten(0, 1))
        return torch.where(tree.valid.unsqueeze(2), flat.view(num_rows, nodes, vocab), scores)
    rows, nodes = tree.valid.nonzero(as_tuple=True)  # [items] each
    paths = tree.paths()[rows, nodes, 1:]  # [items, max_depth] path nodes after the root, -1 padded
    drafts = tree.tokens[rows].gather(1, paths.clamp(min=0))  # [items, max_depth]
    out = scores.clone()
    out[rows, nodes] = process_path_logits(processors, batch, rows, drafts, tree.depths[rows, nodes], scores[rows, nodes])
    return out


def row_wise(processors: LogitsProcessorList) -> bool:
    """Whether every processor works on each row's scores apart, on the device (`PREFIX_FREE_PROCESSORS`, the
    repetition penalty): processing more rows than needed then changes none of the others."""
    return all(isinstance(p, PREFIX_FREE_PROCESSORS) or type(p) is RepetitionPenaltyLogitsProcessor for p in processors)


def process_path_logits(
    processors: LogitsProcessorList,
    batch: TokenBatch,
    rows: torch.LongTensor,  # [items] row of each item
    drafts: torch.LongTensor,  # [items, width] draft tokens after the row's plain prefix
    depths: torch.LongTensor,  # [items] how many of them precede the item's scores
    scores: torch.Tensor,  # [items, vocab]
) -> torch.Tensor:
    """Apply every processor to each item's scores (`[items, vocab]`) with the item's prefix: the plain prefix of
    its row followed by the first `depths[i]` of its draft tokens."""
    if not processors:
        return scores
    for processor in processors:
        if isinstance(processor, PREFIX_FREE_PROCESSORS):
            scores = processor(scores.new_zeros((scores.shape[0], 0), dtype=torch.long), scores)
        elif type(processor) is RepetitionPenaltyLogitsProcessor:
            scores = _repetition_penalty(processor, batch, rows, drafts, depths, scores)
        else:
            scores = _apply_per_prefix(processor, batch, rows, drafts, depths, scores)
    return scores


def _apply_per_prefix(
    processor,
    batch: TokenBatch,
    rows: torch.LongTensor,
    drafts: torch.LongTensor,
    depths: torch.LongTensor,
    scores: torch.Tensor,
) -> torch.Tensor:
    out = scores.clone()
    for item in range(scores.shape[0]):
        row = int(rows[item])
        prefix = batch.plain_prefix(row, drafts[item, : int(depths[item])])  # [1, length]
        # The row sits in its own slot of a batch as wide as the original one; the other slots are copies.
        wide_ids = prefix.expand(batch.original_batch_size, -1)
        wide_scores = scores[item].unsqueeze(0).expand(wide_ids.shape[0], -1).clone()
        out[item] = processor(wide_ids, wide_scores)[int(batch.row_ids[row])]
    return out


def _repetition_penalty(
    processor: RepetitionPenaltyLogitsProcessor,
    batch: TokenBatch,
    rows: torch.LongTensor,
    drafts: torch.LongTensor,
    depths: torch.LongTensor,
    scores: torch.Tensor,
) -> torch.Tensor:
    """Vectorised `RepetitionPenaltyLogitsProcessor` over items (same formula, same ignored prompt)."""
    vocab = scores.shape[1]
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
    present = torch.zeros((batch.batch_size, vocab + 1), dtype=torch.bool, device=scores.device)
    present.scatter_(1, ids.to(scores.device), True)
    present = present[rows.to(scores.device)]  # [items, vocab + 1]
    in_path = torch.arange(drafts.shape[1], device=drafts.device).unsqueeze(0) < depths.unsqueeze(1)
    path_ids = torch.where(in_path, drafts.clamp(max=vocab), torch.full_like(drafts, vocab))  # [items, width]
    present.scatter_(1, path_ids.to(scores.device), True)
    penalised = torch.where(scores < 0, scores * processor.penalty, scores / processor.penalty)
    return torch.where(present[:, :vocab], penalised, scores)
