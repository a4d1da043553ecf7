"""Lossless verification of draft tokens: greedy matching and speculative rejection sampling.

Words (shared with the stats and docs): each row `b` proposes `lengths[b]` *draft tokens*; the verifier keeps the
leading ones it *accepts*, then adds one more token: the *recovered token* at the first rejected position, or the
*bonus token* after the last draft token when all were accepted. Rows with fewer draft tokens than the longest row
are padded with *placeholder tokens*, which are never accepted.

Notation follows Leviathan et al. (2023) and Chen et al. (2023): `p` is the target's distribution, `q` the
distribution the draft token was sampled from. Accepting draft token `x` with probability `min(1, p(x) / q(x))` and
otherwise sampling from `norm(max(0, p - q))` yields tokens distributed exactly as `p`.
"""

from __future__ import annotations

import torch


def _placeholder_mask(lengths: torch.LongTensor, width: int) -> torch.BoolTensor:
    """`[batch, width]` True where a column holds a real draft token."""
    return torch.arange(width, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)


def _leading_true(flags: torch.BoolTensor) -> torch.LongTensor:
    """`[batch]` number of leading True entries of each row of `flags` (`[batch, width]`)."""
    return flags.long().cumprod(dim=1).sum(dim=1)


def verify_greedy(
    target_scores: torch.Tensor,  # [batch, k + 1, vocab] processed target scores
    draft_tokens: torch.LongTensor,  # [batch, k]
    lengths: torch.LongTensor,  # [batch]
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Accept draft tokens while they equal the target's argmax.

    Returns:
        `accepted` `[batch]` and `next_tokens` `[batch]` (the target's argmax after the accepted tokens: the recovered
        or bonus token). The emitted tokens are exactly those of plain greedy decoding.
    """
    target_tokens = target_scores.argmax(dim=-1)  # [batch, k + 1]
    width = draft_tokens.shape[1]
    matches = (draft_tokens == target_tokens[:, :width]) & _placeholder_mask(lengths, width)
    accepted = _leading_true(matches)
    next_tokens = target_tokens.gather(1, accepted.unsqueeze(1)).squeeze(1)
    return accepted, next_tokens


def verify_sampling(
    target_probs: torch.Tensor,  # [batch, k + 1, vocab] p
    draft_tokens: torch.LongTensor,  # [batch, k]
    lengths: torch.LongTensor,  # [batch]
    draft_probs: torch.Tensor | None,  # [batch, k, vocab] q, or None when each draft token was proposed with q = 1
    generator: torch.Generator | None = None,
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Speculative rejection sampling.

    Returns:
        `accepted` `[batch]` and `next_tokens` `[batch]`: the recovered token sampled from `norm(max(0, p - q))` at the
        first rejected position, or the bonus token sampled from `p` after the last draft token.
    """
    batch, width = draft_tokens.shape
    p_draft = target_probs[:, :width].gather(2, draft_tokens.unsqueeze(2)).squeeze(2)  # [batch, k] p(x)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(2, draft_tokens.unsqueeze(2)).squeeze(2)  # [batch, k] q(x)
    uniform = torch.rand(p_draft.shape, device=p_draft.device, generator=generator)
    accept = (uniform * q_draft < p_draft) & _placeholder_mask(lengths, width)
    accepted = _leading_true(accept)

    rows = torch.arange(batch, device=draft_tokens.device)
    p_next = target_probs[rows, accepted]  # [batch, vocab]
    rejected = accepted < lengths
    residual = _residual(p_next, draft_tokens, draft_probs, accepted.clamp(max=max(width - 1, 0)), rows)
    distribution = torch.where(rejected.unsqueeze(1), residual, p_next)
    next_tokens = torch.multinomial(distribution, 1, generator=generator).squeeze(1)
    return accepted, next_tokens


def _residual(
    p_next: torch.Tensor,  # [batch, vocab] p at the first unaccepted position
    draft_tokens: torch.LongTensor,  # [batch, k]
    draft_probs: torch.Tensor | None,  # [batch, k, vocab]
    position: torch.LongTensor,  # [batch] first unaccepted position, clamped into range
    rows: torch.LongTensor,  # [batch]
) -> torch.Tensor:
    """`norm(max(0, p - q))` at each row's first rejected position (`[batch, vocab]`); `p` where that is all zero."""
    if draft_tokens.shape[1] == 0:
        return p_next
    if draft_probs is None:
        q_next = torch.zeros_like(p_next).scatter_(1, draft_tokens[rows, position].unsqueeze(1), 1.0)
    else:
        q_next = draft_probs[rows, position]
    residual = (p_next - q_next).clamp(min=0)
    total = residual.sum(dim=1, keepdim=True)
    # A zero residual means p <= q everywhere, i.e. p == q, where rejection has probability 0: fall back to p.
    return torch.where(total > 0, residual / total.clamp(min=torch.finfo(residual.dtype).tiny), p_next)
