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

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .candidates.tree import TokenTree


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


# ---- token trees -----------------------------------------------------------------------------------------------------
# A tree (`candidates.tree.TokenTree`) gives each row several candidate continuations; node 0 is the root (the newest
# committed token) and the target's scores at node `j` are its distribution over `j`'s children. The verifier walks
# from the root and accepts the longest path it can; the next token is recovered at the node where it stops, or a
# bonus token when that node is a leaf. A chain given as a tree (`TokenTree.from_chain`) gives exactly what
# `verify_greedy` gives, and with the same generator the same samples as `verify_sampling`.


@dataclass
class TreeVerification:
    """Outcome of verifying a `TokenTree`: the accepted path of every row and the token after it."""

    accepted: torch.LongTensor  # [batch] draft tokens accepted = depth of the last accepted node
    last_node: torch.LongTensor  # [batch] last accepted node (0, the root, when nothing was accepted)
    path: torch.LongTensor  # [batch, max_depth] accepted nodes from depth 1 on, padded with -1
    kept: torch.BoolTensor  # [batch, nodes] the root and the accepted nodes: their KV columns stay valid
    next_tokens: torch.LongTensor  # [batch] recovered token, or bonus token after a leaf
    emitted: torch.LongTensor  # [batch, max_depth + 1] accepted tokens then the next token (`accepted + 1` each)


def verify_tree_greedy(
    target_scores: torch.Tensor,  # [batch, nodes, vocab] processed target scores at every node
    tree: TokenTree,
) -> TreeVerification:
    """Follow the target's argmax from the root: accept the longest path of nodes that each equal it.

    The emitted tokens are exactly those of plain greedy decoding.
    """
    return verify_tree_tokens(target_scores.argmax(dim=-1), tree)


def verify_tree_tokens(
    target_tokens: torch.LongTensor,  # [batch, nodes] the target's token at every node (what follows it)
    tree: TokenTree,
) -> TreeVerification:
    """Accept the longest path of nodes that each equal the target's token at their parent; the next token is the
    target's at the path's end. Greedy decoding's target token is the argmax; coupled sampling's the perturbed argmax
    (`coupling.coupled_choice`)."""
    wanted = target_tokens.gather(1, tree.parents.clamp(min=0))  # [batch, nodes] argmax at each node's parent
    matches = tree.valid & ((tree.tokens == wanted) | (tree.parents < 0))  # the root always "matches"
    paths = tree.paths()  # [batch, nodes, max_depth + 1]
    path_matches = matches.gather(1, paths.clamp(min=0).flatten(1)).view_as(paths) | (paths < 0)
    reachable = path_matches.all(dim=2) & tree.valid  # [batch, nodes] every node from the root to here matches
    # Siblings carry distinct tokens, so at most one node per depth is reachable: the deepest ends the path.
    last_node = torch.where(reachable, tree.depths, -1).argmax(dim=1)  # [batch]
    next_tokens = target_tokens.gather(1, last_node.unsqueeze(1)).squeeze(1)
    return tree_outcome(tree, last_node, next_tokens, paths)


def verify_tree_sampling(
    target_probs: torch.Tensor,  # [batch, nodes, vocab] p at every node
    tree: TokenTree,
    draft_probs: torch.Tensor | None,  # [batch, nodes, vocab] q each node's children were drawn from; None = fixed
    generator: torch.Generator | None = None,
) -> TreeVerification:
    """Multi-draft recursive rejection sampling (SpecInfer), for children drawn without replacement (SpecTr).

    At a node with distribution `p` the children `x_1, x_2, ...` are tried in node order: `x_i` is accepted with
    probability `min(1, p_i(x_i) / q_i(x_i))`. On rejection `p_{i+1} = norm(max(0, p_i - q_i))` and, when the
    children were sampled from `q` without replacement, `q_{i+1} = q_i` with `x_i` removed and renormalised. When
    every child is rejected the recovered token is sampled from the last `p_i`; after an accepted leaf the bonus
    token is sampled from the leaf's `p`. With `draft_probs=None` each child is a fixed proposal (`q_i` one-hot on
    `x_i`, e.g. prompt-lookup children), which is exact too: each rejection removes `x_i` from `p`. Either way the
    emitted tokens follow `p` exactly.
    """
    batch, nodes = tree.tokens.shape
    rows = torch.arange(batch, device=tree.tokens.device)
    uniform = torch.rand((batch, nodes - 1), device=target_probs.device, generator=generator)  # one per draft node
    children = tree.children()  # [batch, nodes, max_children]
    current = torch.zeros(batch, dtype=torch.long, device=tree.tokens.device)  # node each row stands at
    descending = torch.ones(batch, dtype=torch.bool, device=tree.tokens.device)
    distribution = torch.zeros_like(target_probs[:, 0])  # [batch, vocab] where each row samples its next token
    stops_early = tree.depth_bound is None  # a tree with host-known bounds walks them all: the device is never read
    for _ in range(tree.depth_limit + 1):
        p = target_probs[rows, current]  # [batch, vocab]
        q = None if draft_probs is None else draft_probs[rows, current]
        moved_to, moved = current.clone(), torch.zeros_like(descending)
        for rank in range(children.shape[2]):
            child = children[rows, current, rank]  # [batch]
            trying = descending & ~moved & (child >= 0)
            if stops_early and not bool(trying.any()):
                break
            token = tree.tokens.gather(1, child.clamp(min=0).unsqueeze(1))  # [batch, 1]
            q_child = torch.zeros_like(p).scatter_(1, token, 1.0) if q is None else q
            p_token, q_token = p.gather(1, token).squeeze(1), q_child.gather(1, token).squeeze(1)
            accept = trying & (uniform[rows, (child - 1).clamp(min=0)] * q_token < p_token)
            moved_to, moved = torch.where(accept, child, moved_to), moved | accept
            rejected = (trying & ~accept).unsqueeze(1)
            p = torch.where(rejected, _reject_residual(p, q_child), p)
            if q is not None:
                q = torch.where(rejected, _without_token(q, token), q)
        distribution = torch.where((descending & ~moved).unsqueeze(1), p, distribution)
        descending, current = descending & moved, moved_to
        if stops_early and not bool(descending.any()):
            break
    next_tokens = torch.multinomial(distribution, 1, generator=generator).squeeze(1)
    return tree_outcome(tree, current, next_tokens, tree.paths())


def _reject_residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """`norm(max(0, p - q))` (`[batch, vocab]`), computed as `_residual` does; `p` where that is all zero."""
    residual = (p - q).clamp(min=0)
    total = residual.sum(dim=1, keepdim=True)
    return torch.where(total > 0, residual / total.clamp(min=torch.finfo(residual.dtype).tiny), p)


def _without_token(q: torch.Tensor, token: torch.LongTensor) -> torch.Tensor:
    """`q` (`[batch, vocab]`) with `token` (`[batch, 1]`) removed and renormalised: the next draw without replacement."""
    removed = q.scatter(1, token, 0.0)
    total = removed.sum(dim=1, keepdim=True)
    return removed / total.clamp(min=torch.finfo(q.dtype).tiny)


def tree_outcome(
    tree: TokenTree,
    last_node: torch.LongTensor,  # [batch]
    next_tokens: torch.LongTensor,  # [batch]
    paths: torch.LongTensor | None = None,  # [batch, nodes, max_depth + 1] `tree.paths()`, if already computed
) -> TreeVerification:
    """The outcome of stopping at `last_node` with `next_tokens`: accepted path, kept nodes and emitted tokens."""
    paths = tree.paths() if paths is None else paths
    rows = torch.arange(tree.batch_size, device=tree.tokens.device)
    accepted = tree.depths[rows, last_node]  # [batch]
    path = paths[rows, last_node, 1:]  # [batch, max_depth]
    kept = torch.zeros_like(tree.valid)
    kept.scatter_(1, paths[rows, last_node].clamp(min=0), True)  # -1 padding re-marks the root, which is kept anyway
    emitted = torch.where(path >= 0, tree.tokens.gather(1, path.clamp(min=0)), 0)
    emitted = torch.cat([emitted, next_tokens.unsqueeze(1)], dim=1)  # [batch, max_depth + 1]
    emitted.scatter_(1, accepted.unsqueeze(1), next_tokens.unsqueeze(1))
    return TreeVerification(accepted, last_node, path, kept, next_tokens, emitted)
