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

With `DynSpecConfig.draft_lookahead`, each forward also feeds a prompt-lookup guess of the path below the row's best
node being expanded (the root, in the first forward), as a chain's forwards do. Where the guess's next token is one of
that node's children, the guess column's logits already give that child's own children, and so on along the guess.
A depth whose best node lookahead has expanded this way costs no forward: only the nodes lookahead expanded grow
there, the others stay leaves. Output does not change (the target decides every token); only the tree's shape does.
A deeper forward feeds `branching` frontier nodes, so its guesses are measured against a forward over those
(`lookahead_tokens(branching)`): where a few more tokens cross a step of the matrix kernels (float32 on a CPU without
AMX), they carry fewer guesses than the root's forward, or none.

Draft-cache columns of fed frontier nodes and guesses stay only if the verifier accepts them (`commit`), as in a
chain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..devices import upload
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


@dataclass
class _Growth:
    """A tree being grown: its candidates, which of them have children, the draft-cache columns fed after the tail
    and, when sampling, the distributions children were drawn from."""

    candidates: _Candidates
    expanded: torch.BoolTensor  # [batch, created] True once the node's children exist
    fed: list[torch.LongTensor]  # per forward, [batch, columns] candidate index of each fed column, -1 for none
    q_store: list[torch.Tensor]  # sampling only: [batch, n, vocab] per expansion; `stored` counts them all
    stored: int

    def grow(
        self,
        frontier: torch.LongTensor,  # [batch, width] candidate index of each expanded node
        active: torch.BoolTensor,  # [batch, width] whether it really expands
        children: tuple[torch.LongTensor, torch.Tensor],  # tokens and log q, [batch, width, branching] each
        q: torch.Tensor | None,  # [batch, width, vocab] the distributions they were drawn from, when sampling
    ) -> None:
        """Append the frontier's children and mark the frontier expanded."""
        created = self.candidates.count
        self.candidates = _grow(self.candidates, frontier, active, *children, self.stored)
        marks = torch.zeros_like(self.expanded, dtype=torch.long).scatter_add_(1, frontier, active.long()) > 0
        new = self.candidates.count - created
        self.expanded = torch.cat([self.expanded | marks, marks.new_zeros((marks.shape[0], new))], dim=1)
        if q is not None:
            self.q_store.append(q)
        self.stored += frontier.shape[1]


class DraftTreeProposer(DraftModelProposer):
    """Proposes a token tree per row with a draft model; `lengths` cap each row's depth, `node_budgets` its size.

    Without `node_budgets` a row gets as many nodes as its depth cap (the size of a chain of that length). In greedy
    decoding a policy's early stop (`continue_drafting`) also ends a row's tree: at each depth it judges either the
    chain of the row's most valuable nodes or the whole tree (`DynSpecConfig.tree_stop_judges`), and the row grows no
    deeper once it says stop. Sampled trees keep their depth caps.
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
        # `lengths` and `node_budgets` come on the host; the tree grows on the device (reading it to choose frontiers)
        host_lengths, device = lengths.to("cpu", copy=True), batch.tokens.device
        budgets = upload(host_lengths if node_budgets is None else node_budgets.to("cpu", copy=True), device)  # depth 0: none
        ids, mask, positions, host_mask = self._unseen_tail(batch)
        self._fed_nodes = torch.zeros((batch.batch_size, 0), dtype=torch.long)
        if int(host_lengths.max()) == 0:
            empty = torch.zeros_like(host_lengths)
            return Proposal(batch.tokens.new_zeros((batch.batch_size, 0)), upload(empty, device), None, host_lengths=empty)
        lengths = upload(host_lengths, device)
        begun = self.placement.instant()
        lookahead = self.lookahead = self.lookahead_tokens()  # measured on the first call of a process
        # a deeper forward feeds the frontier: its guesses must be cheap beside `branching` nodes, not beside one
        frontier_lookahead = min(lookahead, self.lookahead_tokens(self.branching)) if lookahead else 0
        self.setup_seconds = self.placement.since(begun)
        reach = lengths.clone()  # [batch] depth each row may still grow to (cut where `early_stop` ends it)
        growth, context_length = self._grow_root(batch, (ids, mask, positions, host_mask), reach, lookahead)
        for depth in range(1, int(host_lengths.max())):
            if early_stop is not None and not self.do_sample:
                reach = self._stop_growing(early_stop, growth.candidates, depth, reach, budgets)
                if not bool((reach > depth).any()):
                    break
            frontier, active = self._frontier(growth, depth, reach)  # [batch, width] each
            if frontier is None:  # lookahead already expanded every row's best node here: no forward
                continue
            anchor = frontier[:, 0]  # [batch] each row's best node to expand: guesses follow it
            guess = self._tree_guesses(batch, growth.candidates, anchor, active[:, 0], reach, frontier_lookahead)
            scores, guess_logits = self._expand(batch, growth, frontier, active, guess, context_length, depth)
            growth.fed.append(torch.where(active, frontier, -1))
            drawn = torch.full_like(frontier, depth)  # [batch, width] the frontier's depth: its children's index
            path = growth.candidates.paths[rows_of(batch).unsqueeze(1), frontier.clamp(min=0)]  # [batch, width, depth]
            growth.grow(frontier, active, self._draw(self.perturbed(scores, batch, rows_of(batch), path, drawn)),
                        scores.softmax(dim=-1) if self.do_sample else None)
            self._adopt_guesses(batch, growth, torch.where(active[:, 0], anchor, -2), guess, guess_logits, reach)
        candidates = growth.candidates
        too_deep = candidates.depths > reach.unsqueeze(1)  # lookahead may have grown past where the stop ended a row
        candidates.values = candidates.values.masked_fill(too_deep, float("-inf"))
        fed_columns = torch.cat(growth.fed, dim=1)
        q_all = torch.cat(growth.q_store, dim=1) if growth.q_store else None
        return self._select(candidates, budgets, fed_columns, q_all, batch)

    def _grow_root(
        self,
        batch: TokenBatch,
        tail: tuple[torch.LongTensor, ...],  # ids, mask, positions and the mask on the host, [batch, width] each
        reach: torch.LongTensor,  # [batch] depth caps
        lookahead: int,
    ) -> tuple[_Growth, int]:
        """The first draft forward: over each row's unseen tail and a guess below the root. Returns the tree with the
        root's children (and whatever the guess grew below them) and the draft cache's length before the tree."""
        ids, mask, positions, host_mask = tail
        root = torch.full_like(reach, -1)  # the root's children have parent -1
        guess = self._tree_guesses(batch, None, root, reach > 0, reach, lookahead)  # [batch, g] tokens and mask
        offsets = torch.arange(1, guess[0].shape[1] + 1, device=positions.device)
        logits = self._forward(
            torch.cat([ids, guess[0]], 1), torch.cat([mask, guess[1]], 1),
            torch.cat([positions, positions[:, -1:] + offsets], 1), keep=1 + guess[0].shape[1],
            host_mask=torch.cat([host_mask, self._host_guessed], 1),
        )  # [batch, 1 + g, vocab]: the root, then each guess
        rows = torch.arange(batch.batch_size, device=reach.device)
        root_scores = process_path_logits(
            self.logits_processor, batch, rows, ids.new_zeros((batch.batch_size, 0)), torch.zeros_like(reach),
            logits[:, 0],
        )  # [batch, vocab]
        perturbed = self.perturbed(root_scores, batch, rows, ids.new_zeros((batch.batch_size, 0)), torch.zeros_like(reach))
        candidates = self._root_children(perturbed, reach > 0)
        growth = _Growth(
            candidates, torch.zeros_like(candidates.tokens, dtype=torch.bool), [],
            [root_scores.softmax(dim=-1).unsqueeze(1)] if self.do_sample else [], 1,
        )
        self._adopt_guesses(batch, growth, root, guess, logits[:, 1:], reach)
        return growth, self.ragged.length - guess[0].shape[1]

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

    def _stop_growing(
        self, early_stop: EarlyStop, candidates: _Candidates, depth: int, reach: torch.LongTensor,
        budgets: torch.LongTensor,
    ) -> torch.LongTensor:
        """`reach` (`[batch]`) cut to `depth` where `early_stop` ends the row after `depth`, judged by the draft's
        probability of reaching `depth` given `depth - 1` (`position = depth - 1`), per `DynSpecConfig.tree_stop_judges`:

        - 'best': of the depth's most valuable node given its parent: the tree judged as the chain of its best nodes;
          the other branches ride along (they cost no extra draft forward);
        - 'tree': of any node of the depth, over any of the previous depth, among the row's `budgets` most valuable
          candidates so far (the nodes it would propose): where the draft hesitates between siblings, the tree
          still covers the target's likely choices, and keeps growing.
        """
        rows = (reach > depth).nonzero().squeeze(1)  # [n] rows that could grow deeper
        if rows.numel() == 0:
            return reach
        if self.config.tree_stop_judges == "tree":
            own = _reach_probability(candidates, rows, depth, budgets[rows])
        else:
            own = _best_node_probability(candidates, rows, depth)
        positions = torch.full_like(rows, depth - 1)
        keep = early_stop(rows.to("cpu", copy=True), positions.to("cpu", copy=True), own)  # a policy takes rows on the host
        if keep is None:
            return reach
        stopped = rows[~keep.to(rows.device)]
        return reach.index_fill(0, stopped, depth)

    def _frontier(
        self, growth: _Growth, depth: int, reach: torch.LongTensor
    ) -> tuple[torch.LongTensor | None, torch.BoolTensor | None]:
        """The `branching` most valuable candidates at `depth` that have no children yet (`[batch, width]`), active
        where the row's depth cap allows going deeper; `(None, None)` when no row needs a forward at `depth`: each
        row's best node there already has children (grown by lookahead), or the row may not grow deeper."""
        candidates = growth.candidates
        at_depth = torch.where(candidates.depths == depth, candidates.values, float("-inf"))  # [batch, created]
        best = at_depth.max(dim=1)
        needs = torch.isfinite(best.values) & (reach > depth) & ~growth.expanded.gather(1, best.indices[:, None])[:, 0]
        if not bool(needs.any()):
            return None, None
        open_nodes = at_depth.masked_fill(growth.expanded, float("-inf"))
        top = open_nodes.topk(min(self.branching, candidates.count), dim=1)
        return top.indices, torch.isfinite(top.values) & (reach > depth).unsqueeze(1)

    def _expand(
        self,
        batch: TokenBatch,
        growth: _Growth,
        frontier: torch.LongTensor,  # [batch, width] candidate indices
        active: torch.BoolTensor,  # [batch, width]
        guess: tuple[torch.LongTensor, torch.LongTensor],  # [batch, g] tokens and mask below each row's frontier[:, 0]
        context_length: int,
        depth: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft forward over the frontier and the guesses: the frontier's processed scores `[batch, width,
        vocab]` and the guesses' raw logits `[batch, g, vocab]`."""
        candidates = growth.candidates
        rows = torch.arange(batch.batch_size, device=frontier.device).unsqueeze(1)  # [batch, 1]
        width, guesses, guessed = frontier.shape[1], guess[0], guess[1].bool()
        fed_columns = torch.cat(growth.fed, dim=1)  # [batch, fed]
        sees_fed = candidates.ancestors[rows.unsqueeze(2), frontier.unsqueeze(2), fed_columns.clamp(min=0).unsqueeze(1)]
        sees_fed = sees_fed & (fed_columns >= 0).unsqueeze(1)  # [batch, width, fed] a node sees its fed ancestors
        queries = torch.cat([active, guessed], dim=1)  # [batch, width + g]
        block = torch.eye(width + guesses.shape[1], dtype=torch.bool, device=frontier.device).repeat(batch.batch_size, 1, 1)
        block[:, width:, width:] |= torch.ones_like(block[:, width:, width:]).tril() & guessed.unsqueeze(1)
        block[:, width:, 0] = guessed  # a guess follows frontier node 0 and the guesses before it
        visibility = torch.cat(
            [
                queries.unsqueeze(2).expand(-1, -1, context_length),  # the row's context before the tree
                torch.cat([sees_fed, sees_fed[:, :1].expand(-1, guesses.shape[1], -1)], dim=1) & queries.unsqueeze(2),
                block,
            ],
            dim=2,
        )  # [batch, width + g, cache length + width + g]
        offsets = torch.cat([frontier.new_zeros(width), torch.arange(1, guesses.shape[1] + 1, device=frontier.device)])
        positions = (batch.num_real - 1 + depth).unsqueeze(1) + offsets
        self.forwards += 1
        logits = self.placement.forward(
            self.draft_model, self.ragged, torch.cat([candidates.tokens[rows, frontier], guesses], dim=1),
            queries.long(), positions, width + guesses.shape[1], visibility, head=self.head,
        )  # [batch, width + g, vocab]
        scores = process_path_logits(
            self.logits_processor,
            batch,
            rows.expand(-1, width).reshape(-1),
            candidates.paths[rows, frontier].flatten(0, 1),
            candidates.depths[rows, frontier].flatten(),
            logits[:, :width].flatten(0, 1),
        )
        return scores.view(batch.batch_size, width, -1), logits[:, width:]

    # ---- lookahead -------------------------------------------------------------------------------------------------
    def _tree_guesses(
        self,
        batch: TokenBatch,
        candidates: _Candidates | None,
        anchor: torch.LongTensor,  # [batch] candidate whose path the guesses continue, -1 for the root
        wanted: torch.BoolTensor,  # [batch] rows that expand `anchor`
        reach: torch.LongTensor,  # [batch]
        lookahead: int,
    ) -> tuple[torch.LongTensor, torch.LongTensor]:
        """`[batch, g]` prompt-lookup guesses of the path below each row's `anchor`, and their mask: only as deep as
        the row may grow (a guess's node is useful when its children are allowed). Reads the paths once, when some
        row looks up."""
        if not lookahead:
            self._host_guessed = torch.zeros((batch.batch_size, 0), dtype=torch.long)
            return batch.tokens.new_zeros(self._host_guessed.shape), batch.tokens.new_zeros(self._host_guessed.shape)
        if candidates is None:
            depth, paths = torch.zeros_like(anchor), anchor.new_zeros((anchor.shape[0], 0))
        else:
            index = anchor.clamp(min=0).unsqueeze(1)  # [batch, 1]
            depth = candidates.depths.gather(1, index)[:, 0]
            paths = candidates.paths.gather(1, index.unsqueeze(2).expand(-1, -1, candidates.paths.shape[2]))[:, 0]
        room = torch.where(wanted, reach - depth - 1, 0).clamp(min=0)  # [batch]
        host = torch.cat([room.unsqueeze(1), depth.unsqueeze(1), paths], dim=1).to("cpu", copy=True)  # the one read
        drafted = [host[row, 2 : 2 + int(host[row, 1])] for row in range(batch.batch_size)]
        tokens, guessed, (_, self._host_guessed) = self._lookups(batch, drafted, host[:, 0], lookahead)
        return tokens, guessed

    def _adopt_guesses(
        self,
        batch: TokenBatch,
        growth: _Growth,
        anchor: torch.LongTensor,  # [batch] node the guesses follow: -1 the root, -2 none
        guess: tuple[torch.LongTensor, torch.LongTensor],  # [batch, g] tokens and mask
        logits: torch.Tensor,  # [batch, g, vocab] the draft's logits after each guess
        reach: torch.LongTensor,  # [batch]
    ) -> None:
        """Walk each row's guess from `anchor`: while the next guess token is a child of the current node (and that
        child may grow), the child takes its children from the guess column's logits. Records the node of each guess
        column (-1 past the walk) as fed."""
        guesses, guessed = guess
        nodes = torch.full_like(guesses, -1)  # [batch, g]
        walking, current = guessed.any(dim=1), anchor
        rows = torch.arange(batch.batch_size, device=anchor.device)
        for j in range(guesses.shape[1]):
            candidates = growth.candidates
            match = (candidates.parents == current.unsqueeze(1)) & (candidates.tokens == guesses[:, j : j + 1])
            match &= torch.isfinite(candidates.values)  # [batch, created]
            child = match.long().argmax(dim=1)  # [batch]
            depth = candidates.depths.gather(1, child.unsqueeze(1))[:, 0]
            walking = walking & guessed[:, j].bool() & match.any(dim=1) & (reach > depth)
            if not bool(walking.any()):
                break
            nodes[:, j] = torch.where(walking, child, -1)
            scores = process_path_logits(
                self.logits_processor, batch, rows, candidates.paths[rows, child], depth, logits[:, j]
            ).unsqueeze(1)  # [batch, 1, vocab]
            path = candidates.paths[rows, child].unsqueeze(1)  # [batch, 1, depth]
            drawn = self.perturbed(scores, batch, rows, path, depth.unsqueeze(1))  # the child's children follow `depth`
            growth.grow(child.unsqueeze(1), walking.unsqueeze(1), self._draw(drawn),
                        scores.softmax(dim=-1) if self.do_sample else None)
            current = child
        growth.fed.append(nodes)

    # ---- the proposal ----------------------------------------------------------------------------------------------
    def _select(
        self,
        candidates: _Candidates,
        budgets: torch.LongTensor,  # [batch]
        fed_columns: torch.LongTensor,  # [batch, fed] candidate index per fed draft-cache column
        q_store: torch.Tensor | None,  # [batch, stored, vocab] when sampling
        batch: TokenBatch,
    ) -> Proposal:
        """Keep `budgets[b]` candidates of each row as its tree, nodes in creation order (parents first); in greedy
        decoding, without those whose path probability is below `DynSpecConfig.tree_min_node_probability`."""
        created = torch.isfinite(candidates.values)  # [batch, created]
        if self.do_sample:  # the first ones created: never depends on a node's own token
            rank = created.long().cumsum(dim=1) - 1
        else:  # the most valuable; the stable sort ranks a parent before an equally valued child
            keys = torch.where(created, candidates.values, float("-inf"))
            order = torch.sort(keys, dim=1, descending=True, stable=True).indices
            rank = torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1], device=order.device)
                                                    .expand_as(order).contiguous())
        chosen = created & (rank < budgets.unsqueeze(1))  # [batch, created]
        floor = self.config.tree_min_node_probability
        if floor > 0 and not self.do_sample:  # a child is never worth more than its parent: what is kept is a tree
            chosen &= (candidates.values >= math.log(floor)) | (rank == 0)
        node_of = torch.where(chosen, chosen.long().cumsum(dim=1), -1)  # [batch, created] tree node, -1 if dropped
        host_lengths = chosen.sum(dim=1).to("cpu", copy=True)  # [batch] nodes per row, read once
        width = int(host_lengths.max())
        slot = torch.where(chosen, node_of - 1, width)  # dropped candidates land in an extra slot, cut below

        def place(values: torch.LongTensor, fill: int) -> torch.LongTensor:
            return values.new_full((batch.batch_size, width + 1), fill).scatter_(1, slot, values)[:, :width]

        parent_nodes = torch.where(candidates.parents >= 0, node_of.gather(1, candidates.parents.clamp(min=0)), 0)
        # [batch, fed] tree node per fed column, -1 if dropped or of no node
        self._fed_nodes = torch.where(fed_columns >= 0, node_of.gather(1, fed_columns.clamp(min=0)), -1)
        probs = None
        if self.do_sample:
            index = place(candidates.q_index, 0)  # [batch, width]
            probs = q_store.gather(1, index.unsqueeze(2).expand(-1, -1, q_store.shape[2]))
        return Proposal(place(candidates.tokens, batch.pad_id), chosen.sum(dim=1), probs, place(parent_nodes, 0),
                        host_lengths=host_lengths)


def rows_of(batch: TokenBatch) -> torch.LongTensor:
    """`[batch]` every row of `batch`, by index."""
    return torch.arange(batch.batch_size, device=batch.tokens.device)


def _best_node_probability(candidates: _Candidates, rows: torch.LongTensor, depth: int) -> torch.Tensor:
    """`[n]` the draft's probability of each row's most valuable node at `depth` given its parent."""
    values = candidates.values[rows]  # [n, created]
    at_depth = torch.where(candidates.depths[rows] == depth, values, float("-inf"))  # [n, created]
    best = at_depth.argmax(dim=1, keepdim=True)  # [n, 1]
    parents = candidates.parents[rows].gather(1, best)  # [n, 1], -1 at depth 1
    parent_values = values.gather(1, parents.clamp(min=0))  # [n, 1]
    return (at_depth.gather(1, best) - torch.where(parents >= 0, parent_values, 0.0)).squeeze(1).exp()


def _reach_probability(
    candidates: _Candidates, rows: torch.LongTensor, depth: int, budgets: torch.LongTensor
) -> torch.Tensor:
    """`[n]` the draft's probability that a path reaches `depth` given that it reached `depth - 1`, over each row's
    `budgets` (`[n]`) most valuable candidates: their path probabilities at `depth` over those at `depth - 1`."""
    values = candidates.values[rows]  # [n, created] log path probabilities
    ranked = values.sort(dim=1, descending=True).values
    floor = ranked.gather(1, (budgets.clamp(min=1) - 1).clamp(max=values.shape[1] - 1).unsqueeze(1))  # [n, 1]
    kept = values.exp() * (values >= floor)  # [n, created] zero for candidates the row would not propose
    depths = candidates.depths[rows]
    reached = (kept * (depths == depth)).sum(dim=1)
    before = (kept * (depths == depth - 1)).sum(dim=1) if depth > 1 else torch.ones_like(reached)
    return (reached / before.clamp(min=1e-30)).clamp(max=1.0)


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
