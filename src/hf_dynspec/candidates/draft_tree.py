"""Draft-model token trees, expanded the way EAGLE-2 does: best nodes first, one batched draft forward per depth.

Depth 1: the draft's forward over the row's tail (as for a chain) gives its distribution at the root; the root gets
`branching` children. Each further depth feeds the `branching` best nodes of the previous depth (the *frontier*) in
one forward for the whole batch, each node seeing the row's context and its own ancestors only (a tree mask on the
draft's cache), and gives each frontier node `branching` children. A node's *value* is the draft's probability of its
whole path (the product of the probabilities along it). The tree a row proposes is made of `node_budgets[b]` of these
candidates:

- greedy decoding: the most valuable ones. A child's value never exceeds its parent's and ties keep creation order,
  so they always form a tree;
- sampling: children are drawn from the draft's `q` without replacement (the order the verifier tries them in) and the
  tree is the first candidates in creation order, so whether a node is proposed never depends on its own token, as
  the multi-draft rejection sampler requires for the output to follow the target exactly.

Draft-cache columns of fed frontier nodes stay only if the verifier accepts them (`commit`), as in a chain.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..processors import process_path_logits
from ..sequences import TokenBatch
from .base import EarlyStop, Proposal
from .draft_model import DraftModelProposer


@dataclass
class _Candidates:
    """Every node created so far, per row, in creation order (`[batch, created, ...]`)."""

    tokens: torch.LongTensor  # [batch, created]
    parents: torch.LongTensor  # [batch, created] candidate index of the parent, -1 for children of the root
    values: torch.Tensor  # [batch, created] log draft probability of the path; -inf where nothing was created
    depths: torch.LongTensor  # [batch, created]
    paths: torch.LongTensor  # [batch, created, max depth] draft tokens from depth 1 to the node, 0-padded
    ancestors: torch.BoolTensor  # [batch, created, created] True where the column is the node or an ancestor
    q_index: torch.LongTensor  # [batch, created] which stored draft distribution the node was drawn from

    @property
    def count(self) -> int:
        return int(self.tokens.shape[1])


class DraftTreeProposer(DraftModelProposer):
    """Proposes a token tree per row with a draft model; `lengths` cap each row's depth, `node_budgets` its size.

    Without `node_budgets` a row gets as many nodes as its depth cap (the size of a chain of that length). In greedy
    decoding a policy's early stop (`continue_drafting`) also ends a row's tree: it judges the chain of the row's most
    valuable node at each depth, and the row grows no deeper once it says stop. Sampled trees keep their depth caps.
    """

    def __init__(self, *args, branching: int = 2, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if branching < 1:
            raise ValueError(f"`branching` must be >= 1; got {branching}.")
        self.branching = branching

    def propose(
        self,
        batch: TokenBatch,
        lengths: torch.LongTensor,
        early_stop: EarlyStop | None = None,
        free_rows: torch.BoolTensor | None = None,
        node_budgets: torch.LongTensor | None = None,
    ) -> Proposal:
        budgets = lengths if node_budgets is None else node_budgets.to(lengths.device)  # rows with depth 0 get none
        ids, mask, positions = self._unseen_tail(batch)
        self._fed_nodes = lengths.new_zeros((batch.batch_size, 0))
        if int(lengths.max()) == 0:
            return Proposal(batch.tokens.new_zeros((batch.batch_size, 0)), torch.zeros_like(lengths), None)
        rows = torch.arange(batch.batch_size, device=lengths.device)
        no_drafts = ids.new_zeros((batch.batch_size, 0))
        root_logits = self._forward(ids, mask, positions)[:, -1]  # [batch, vocab]
        root_scores = process_path_logits(
            self.logits_processor, batch, rows, no_drafts, torch.zeros_like(lengths), root_logits
        )  # [batch, vocab]
        # Sampling only: the distributions children are drawn from, [batch, 1, vocab] at the root, then
        # [batch, width, vocab] per depth; `stored` counts them (a candidate's `q_index` points into them).
        q_store = [root_scores.softmax(dim=-1).unsqueeze(1)] if self.do_sample else []
        stored = 1
        candidates = self._root_children(root_scores, lengths > 0)
        fed: list[torch.LongTensor] = []  # per depth, [batch, width] candidate index of each fed draft-cache column
        context_length = self.ragged.length
        reach = lengths.clone()  # [batch] depth each row may still grow to (cut where `early_stop` ends it)
        for depth in range(1, int(lengths.max())):
            if early_stop is not None and not self.do_sample:
                reach = self._stop_growing(early_stop, candidates, depth, reach)
                if not bool((reach > depth).any()):
                    break
            frontier, active = self._frontier(candidates, depth, reach)  # [batch, width] each
            scores = self._expand(batch, candidates, frontier, active, fed, context_length, depth)  # [b, width, v]
            fed.append(frontier)
            tokens, log_q = self._draw(scores)
            candidates = _grow(candidates, frontier, active, tokens, log_q, stored)
            stored += frontier.shape[1]
            if self.do_sample:
                q_store.append(scores.softmax(dim=-1))
        fed_columns = torch.cat(fed, dim=1) if fed else lengths.new_zeros((batch.batch_size, 0))
        q_all = torch.cat(q_store, dim=1) if q_store else None
        return self._select(candidates, budgets, fed_columns, q_all, batch)

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs):
        raise NotImplementedError(
            "Transformers' assisted-generation loop verifies chains only; token trees need hf_dynspec's loop "
            "(`hf_dynspec.generate` or `custom_generate=hf_dynspec.speculative_loop` with `tree_node_budget > 0`)."
        )

    # ---- expansion -------------------------------------------------------------------------------------------------
    def _draw(self, scores: torch.Tensor) -> tuple[torch.LongTensor, torch.Tensor]:
        """`branching` children per node (`scores` `[batch, width, vocab]`): tokens and their log q, both
        `[batch, width, branching]`. Greedy: the most likely tokens. Sampling: draws from `q` without replacement, in
        draw order (Gumbel top-k, which orders tokens as successive draws would). A child with `q = 0` (fewer
        tokens allowed than `branching`, e.g. after top-k) gets log q = -inf and is never proposed."""
        log_q = scores.log_softmax(dim=-1)
        count = min(self.branching, log_q.shape[-1])
        keys = log_q
        if self.do_sample:
            uniform = torch.rand_like(log_q).clamp(min=torch.finfo(log_q.dtype).tiny)
            keys = log_q - torch.log(-torch.log(uniform))  # log q + Gumbel noise
        tokens = keys.topk(count, dim=-1).indices
        return tokens, log_q.gather(2, tokens)

    def _root_children(self, root_scores: torch.Tensor, active: torch.BoolTensor) -> _Candidates:
        """The root's children in rows that draft (`active` `[batch]`) as the first candidates."""
        tokens, log_q = self._draw(root_scores.unsqueeze(1))  # [batch, 1, count]
        tokens, log_q = tokens[:, 0], log_q[:, 0]  # [batch, count]
        batch, count = tokens.shape
        return _Candidates(
            tokens=tokens,
            parents=torch.full_like(tokens, -1),
            values=torch.where(active.unsqueeze(1), log_q, float("-inf")),
            depths=torch.ones_like(tokens),
            paths=tokens.unsqueeze(2),
            ancestors=torch.eye(count, dtype=torch.bool, device=tokens.device).expand(batch, -1, -1),
            q_index=torch.zeros_like(tokens),
        )

    @staticmethod
    def _stop_growing(
        early_stop: EarlyStop, candidates: _Candidates, depth: int, reach: torch.LongTensor
    ) -> torch.LongTensor:
        """`reach` (`[batch]`) cut to `depth` where `early_stop` ends the row after its most valuable node at `depth`:
        the tree is judged as the chain of its best nodes, each by the draft's probability of that node given its
        parent (`position = depth - 1`). The other branches ride along: they cost no extra draft forward."""
        rows = (reach > depth).nonzero().squeeze(1)  # [n] rows that could grow deeper
        if rows.numel() == 0:
            return reach
        at_depth = torch.where(candidates.depths[rows] == depth, candidates.values[rows], float("-inf"))  # [n, c]
        best = at_depth.argmax(dim=1, keepdim=True)  # [n, 1]
        parents = candidates.parents[rows].gather(1, best)  # [n, 1], -1 at depth 1
        parent_values = candidates.values[rows].gather(1, parents.clamp(min=0))  # [n, 1]
        own = at_depth.gather(1, best) - torch.where(parents >= 0, parent_values, 0.0)  # [n, 1] log q given parent
        positions = torch.full_like(rows, depth - 1)
        keep = early_stop(rows, positions, own.squeeze(1).exp())
        if keep is None:
            return reach
        stopped = rows[~keep.to(rows.device)]
        return reach.index_fill(0, stopped, depth)

    def _frontier(
        self, candidates: _Candidates, depth: int, lengths: torch.LongTensor
    ) -> tuple[torch.LongTensor, torch.BoolTensor]:
        """The `branching` most valuable candidates at `depth` (`[batch, width]`), active where the row's depth cap
        allows going deeper."""
        at_depth = torch.where(candidates.depths == depth, candidates.values, float("-inf"))  # [batch, created]
        best = at_depth.topk(min(self.branching, candidates.count), dim=1)
        return best.indices, torch.isfinite(best.values) & (lengths > depth).unsqueeze(1)

    def _expand(
        self,
        batch: TokenBatch,
        candidates: _Candidates,
        frontier: torch.LongTensor,  # [batch, width] candidate indices
        active: torch.BoolTensor,  # [batch, width]
        fed: list[torch.LongTensor],
        context_length: int,
        depth: int,
    ) -> torch.Tensor:
        """One draft forward over the frontier; its processed scores `[batch, width, vocab]`."""
        rows = torch.arange(batch.batch_size, device=frontier.device).unsqueeze(1)  # [batch, 1]
        width = frontier.shape[1]
        fed_columns = torch.cat(fed, dim=1) if fed else frontier[:, :0]  # [batch, fed]
        sees_fed = candidates.ancestors[rows.unsqueeze(2), frontier.unsqueeze(2), fed_columns.unsqueeze(1)]
        visibility = torch.cat(
            [
                active.unsqueeze(2).expand(-1, -1, context_length),  # the row's context before the tree
                sees_fed & active.unsqueeze(2),  # fed tree nodes: its ancestors only
                torch.eye(width, dtype=torch.bool, device=frontier.device).expand(batch.batch_size, -1, -1),
            ],
            dim=2,
        )  # [batch, width, cache length + width]
        positions = (batch.num_real - 1 + depth).unsqueeze(1).expand(-1, width)
        self.forwards += 1
        logits = self.placement.forward(
            self.draft_model, self.ragged, candidates.tokens[rows, frontier], active.long(), positions, width,
            visibility, head=self.head,
        )  # [batch, width, vocab]
        scores = process_path_logits(
            self.logits_processor,
            batch,
            rows.expand(-1, width).reshape(-1),
            candidates.paths[rows, frontier].flatten(0, 1),
            candidates.depths[rows, frontier].flatten(),
            logits.flatten(0, 1),
        )
        return scores.view_as(logits)

    # ---- the proposal ----------------------------------------------------------------------------------------------
    def _select(
        self,
        candidates: _Candidates,
        budgets: torch.LongTensor,  # [batch]
        fed_columns: torch.LongTensor,  # [batch, fed] candidate index per fed draft-cache column
        q_store: torch.Tensor | None,  # [batch, stored, vocab] when sampling
        batch: TokenBatch,
    ) -> Proposal:
        """Keep `budgets[b]` candidates of each row as its tree, nodes in creation order (parents first)."""
        created = torch.isfinite(candidates.values)  # [batch, created]
        if self.do_sample:  # the first ones created: never depends on a node's own token
            rank = created.long().cumsum(dim=1) - 1
        else:  # the most valuable; the stable sort ranks a parent before an equally valued child
            keys = torch.where(created, candidates.values, float("-inf"))
            order = torch.sort(keys, dim=1, descending=True, stable=True).indices
            rank = torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1], device=order.device)
                                                    .expand_as(order).contiguous())
        chosen = created & (rank < budgets.unsqueeze(1))  # [batch, created]
        node_of = torch.where(chosen, chosen.long().cumsum(dim=1), -1)  # [batch, created] tree node, -1 if dropped
        width = int(chosen.sum(dim=1).max())
        slot = torch.where(chosen, node_of - 1, width)  # dropped candidates land in an extra slot, cut below

        def place(values: torch.LongTensor, fill: int) -> torch.LongTensor:
            return values.new_full((batch.batch_size, width + 1), fill).scatter_(1, slot, values)[:, :width]

        parent_nodes = torch.where(candidates.parents >= 0, node_of.gather(1, candidates.parents.clamp(min=0)), 0)
        self._fed_nodes = node_of.gather(1, fed_columns)  # [batch, fed] tree node per fed column, -1 if dropped
        probs = None
        if self.do_sample:
            index = place(candidates.q_index, 0)  # [batch, width]
            probs = q_store.gather(1, index.unsqueeze(2).expand(-1, -1, q_store.shape[2]))
        return Proposal(place(candidates.tokens, batch.pad_id), chosen.sum(dim=1), probs, place(parent_nodes, 0))


def _grow(
    candidates: _Candidates,
    frontier: torch.LongTensor,  # [batch, width] candidate index of each expanded node
    active: torch.BoolTensor,  # [batch, width] whether it really expands
    tokens: torch.LongTensor,  # [batch, width, count] its children
    log_q: torch.Tensor,  # [batch, width, count] their draft log probabilities
    q_offset: int,  # index of the frontier's first distribution among the stored ones
) -> _Candidates:
    """The candidates with the frontier's children appended."""
    batch, width, count = tokens.shape
    rows = torch.arange(batch, device=tokens.device).unsqueeze(1)
    parents = frontier.repeat_interleave(count, dim=1)  # [batch, new]
    new = parents.shape[1]
    live = active.repeat_interleave(count, dim=1)  # [batch, new]
    values = torch.where(live, candidates.values.gather(1, parents) + log_q.reshape(batch, new), float("-inf"))
    depths = candidates.depths.gather(1, parents) + 1
    paths = torch.cat([candidates.paths, candidates.paths.new_zeros((batch, candidates.count, 1))], dim=2)
    new_paths = paths[rows, parents]  # [batch, new, depth + 1]
    new_paths.scatter_(2, (depths - 1).unsqueeze(2), tokens.reshape(batch, new, 1))
    total = candidates.count + new
    ancestors = torch.zeros((batch, total, total), dtype=torch.bool, device=tokens.device)
    ancestors[:, : candidates.count, : candidates.count] = candidates.ancestors
    ancestors[:, candidates.count :, : candidates.count] = candidates.ancestors[rows, parents]
    ancestors[:, candidates.count :, candidates.count :] = torch.eye(new, dtype=torch.bool, device=tokens.device)
    q_index = (q_offset + torch.arange(width, device=tokens.device)).repeat_interleave(count).expand(batch, -1)
    return _Candidates(
        tokens=torch.cat([candidates.tokens, tokens.reshape(batch, new)], dim=1),
        parents=torch.cat([candidates.parents, parents], dim=1),
        values=torch.cat([candidates.values, values], dim=1),
        depths=torch.cat([candidates.depths, depths], dim=1),
        paths=torch.cat([paths, new_paths], dim=1),
        ancestors=ancestors,
        q_index=torch.cat([candidates.q_index, q_index], dim=1),
    )
