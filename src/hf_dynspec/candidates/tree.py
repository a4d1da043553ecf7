"""Token trees: several candidate continuations per row, checked by the target in one forward.

Node 0 of every row is the *root*: the row's newest committed token, whose KV the target has not computed yet. The
loop already feeds that token first in its verification forward (`[newest token, draft tokens]`), so with the root
as node 0 the tree's nodes are exactly the forward's input block, and the target's scores `[batch, nodes, vocab]`
line up with the nodes: the scores at node `j` are the target's distribution over `j`'s children (at a leaf: over
the bonus token). A chain of `k` draft tokens is the tree of `k + 1` nodes where node `j` is the parent of node
`j + 1`, and its scores are the chain verifier's `[batch, k + 1, vocab]`.

Nodes are stored in topological order (every parent before its children); siblings carry distinct tokens and their
order is the order in which they were proposed. Rows with fewer nodes than the widest row are padded with
*placeholder* slots (`valid` False), which are never accepted and attend only to themselves.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import InitVar, dataclass, field

import torch

from ..cache import SlidingWindows

CHECK_ENV = "HF_DYNSPEC_CHECK_TREES"
"""Set to `1` to check the structure of every tree the loop builds from its proposers' proposals (the test suite does).
The checks read the tree on the host, a device synchronisation each, so the loop skips them otherwise."""


def checks_loop_trees() -> bool:
    """Whether the loop checks the trees of its proposals (`CHECK_ENV`)."""
    return os.environ.get(CHECK_ENV, "0") == "1"


@dataclass
class TokenTree:
    """Per-row trees of candidate tokens, padded to a common node count.

    Use `from_chain` or `from_parent_lists`, or `from_parents` on tensors; the constructor checks the structure
    (unless `check=False`: the checks read the tree on the host).
    """

    tokens: torch.LongTensor  # [batch, nodes] node 0 = root (newest committed token); placeholders at padded slots
    parents: torch.LongTensor  # [batch, nodes] parent node index, -1 for the root and for placeholder slots
    depths: torch.LongTensor  # [batch, nodes] 0 for the root (and placeholder slots), parent's depth + 1 otherwise
    valid: torch.BoolTensor  # [batch, nodes] False on placeholder slots
    depth_bound: int | None = field(default=None, compare=False)
    """At least `max_depth`, known without reading `depths` (the trees of the loop's proposals: their draft slots);
    walks along paths use it (`depth_limit`). `None`: `max_depth`."""
    children_bound: int | None = field(default=None, compare=False)
    """At least the most children of any node, known without reading the tree (a chain: 1); `children` is that wide.
    `None`: read from the tree."""
    check: InitVar[bool] = True
    chain: bool = field(default=False, compare=False)
    """Each row's nodes `0 .. lengths[b]` form a chain in slot order, node `j` the parent of node `j + 1`, and its
    other slots are placeholders (`from_chain`): `paths` is then known without walking the parents."""
    _paths: torch.LongTensor | None = field(default=None, init=False, repr=False, compare=False)
    """`paths()`, once computed (a step asks for it to build the mask, to verify and to process scores)."""

    def __post_init__(self, check: bool) -> None:
        _check_shapes(self.tokens, self.parents, self.depths, self.valid)
        if check:
            _check_structure(self.tokens, self.parents, self.depths, self.valid)

    # ---- constructors ----------------------------------------------------------------------------------------------
    @classmethod
    def from_parents(
        cls,
        tokens: torch.LongTensor,  # [batch, nodes]
        parents: torch.LongTensor,  # [batch, nodes]
        valid: torch.BoolTensor | None = None,  # [batch, nodes]; None = every slot is a node
        check: bool = True,
    ) -> TokenTree:
        """A tree from parent indices (node 0 is the root, parent -1); depths are derived. `check=False` skips the
        structure checks (and gives the tree its draft slots as `depth_bound`): for trees known to be well formed."""
        valid = torch.ones_like(tokens, dtype=torch.bool) if valid is None else valid.bool()
        _check_shapes(tokens, parents, parents, valid)
        if check:
            _check_order(parents, valid)
        parents = torch.where(valid, parents, -1)
        bound = None if check else tokens.shape[1] - 1
        return cls(tokens, parents, _depths_from_parents(parents), valid, bound, check=check)

    @classmethod
    def from_parent_lists(
        cls, tokens: Sequence[Sequence[int]], parents: Sequence[Sequence[int]], placeholder: int = 0
    ) -> TokenTree:
        """A tree from per-row Python lists: `tokens[b][0]` is row `b`'s root, `parents[b][j]` node `j`'s parent."""
        if len(tokens) != len(parents) or any(len(t) != len(p) for t, p in zip(tokens, parents)):
            raise ValueError("`tokens` and `parents` need one list per row and one entry per node in each list.")
        if any(len(t) == 0 for t in tokens):
            raise ValueError("Every row needs at least its root (node 0, parent -1).")
        width = max(len(t) for t in tokens)
        token_tensor = torch.full((len(tokens), width), placeholder, dtype=torch.long)
        parent_tensor = torch.full((len(tokens), width), -1, dtype=torch.long)
        valid = torch.zeros((len(tokens), width), dtype=torch.bool)
        for row, (row_tokens, row_parents) in enumerate(zip(tokens, parents)):
            token_tensor[row, : len(row_tokens)] = torch.tensor(row_tokens, dtype=torch.long)
            parent_tensor[row, : len(row_parents)] = torch.tensor(row_parents, dtype=torch.long)
            valid[row, : len(row_tokens)] = True
        return cls.from_parents(token_tensor, parent_tensor, valid)

    @classmethod
    def from_chain(
        cls,
        tokens: torch.LongTensor,  # [batch, k] draft tokens, placeholder-padded
        lengths: torch.LongTensor,  # [batch] draft length per row
        root: torch.LongTensor | None = None,  # [batch] newest committed token; None = placeholder 0
        check: bool = True,
    ) -> TokenTree:
        """The chain `root -> tokens[b, 0] -> ... -> tokens[b, lengths[b] - 1]` as a tree of `k + 1` nodes, with `k` as
        its `depth_bound`. `check=False` skips the checks of `lengths` (which read them on the host)."""
        batch, width = tokens.shape
        if lengths.shape != (batch,):
            raise ValueError(f"`lengths` must hold {batch} values in [0, {width}]; got shape {tuple(lengths.shape)}.")
        if check and (bool((lengths < 0).any()) or bool((lengths > width).any())):
            raise ValueError(f"`lengths` must hold {batch} values in [0, {width}]; got {lengths.tolist()}.")
        root = tokens.new_zeros(batch) if root is None else root.to(tokens.device)
        nodes = torch.arange(width + 1, device=tokens.device)
        valid = nodes.unsqueeze(0) <= lengths.unsqueeze(1)  # [batch, k + 1]
        parents = torch.where(valid, (nodes - 1).unsqueeze(0), -1)
        depths = torch.where(valid, nodes.unsqueeze(0), 0)
        all_tokens = torch.cat([root.unsqueeze(1), tokens], dim=1)  # [batch, k + 1]
        return cls(all_tokens, parents, depths, valid, width, min(width, 1), check=check, chain=True)

    # ---- sizes -----------------------------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_nodes(self) -> int:
        """Node slots per row, the root and placeholder slots included."""
        return int(self.tokens.shape[1])

    @property
    def max_depth(self) -> int:
        """Depth of the deepest node: the most draft tokens any row can accept."""
        return int(self.depths.max()) if self.depths.numel() else 0

    @property
    def depth_limit(self) -> int:
        """`depth_bound` when known, else `max_depth`: how deep walks along paths go (`paths`)."""
        return self.max_depth if self.depth_bound is None else self.depth_bound

    @property
    def num_draft(self) -> torch.LongTensor:
        """`[batch]` draft nodes per row (valid nodes other than the root)."""
        return self.valid.sum(dim=1) - 1

    # ---- structure -------------------------------------------------------------------------------------------------
    def paths(self) -> torch.LongTensor:
        """`[batch, nodes, depth_limit + 1]`: entry `[b, j, d]` is the ancestor of node `j` at depth `d`.

        Column 0 is the root (node 0), column `depths[b, j]` is `j` itself, deeper columns are -1. Placeholder slots
        hold only themselves in column 0. Computed once per tree; do not write into the result.
        """
        if self._paths is None:
            self._paths = self._chain_paths() if self.chain else self._walked_paths()
        return self._paths

    def _chain_paths(self) -> torch.LongTensor:
        """`paths` of a chain (`chain`): node `j`'s ancestors are the nodes `0 .. j`, each at its own depth."""
        nodes = self.tokens.shape[1]
        depth = torch.arange(self.depth_limit + 1, device=self.tokens.device)  # [depth + 1]
        node = torch.arange(nodes, device=self.tokens.device).unsqueeze(1)  # [nodes, 1]
        on_chain = torch.where(depth <= node, depth, -1)  # [nodes, depth + 1] a valid node's path
        alone = torch.where(depth == 0, node, -1)  # [nodes, depth + 1] a placeholder slot's
        return torch.where(self.valid.unsqueeze(2), on_chain, alone)  # [batch, nodes, depth + 1]

    def _walked_paths(self) -> torch.LongTensor:
        """`paths` of any tree, by walking every node's parents up to the root."""
        batch, nodes = self.tokens.shape
        current = torch.arange(nodes, device=self.tokens.device).expand(batch, nodes)  # [batch, nodes]
        level = self.depths.clone()
        depth = self.depth_limit
        paths = torch.full((batch, nodes, depth + 1), -1, dtype=torch.long, device=self.tokens.device)
        for _ in range(depth + 1):
            on_path = level >= 0
            paths.scatter_(2, level.clamp(min=0).unsqueeze(2), torch.where(on_path, current, paths[..., 0]).unsqueeze(2))
            current = torch.where(on_path, self._parent_of(current), current)
            level = level - 1
        return paths

    def ancestor_mask(self) -> torch.BoolTensor:
        """`[batch, nodes, nodes]` True where node `j` (column) is node `i` (row) or one of its ancestors."""
        batch, nodes = self.tokens.shape
        paths = self.paths()  # [batch, nodes, max_depth + 1]
        mask = torch.zeros((batch, nodes, nodes + 1), dtype=torch.bool, device=self.tokens.device)
        mask.scatter_(2, torch.where(paths >= 0, paths, nodes), True)  # -1 entries land in the extra column
        return mask[..., :nodes]

    def children(self) -> torch.LongTensor:
        """`[batch, nodes, max_children]` each node's children in node order, padded with -1 (`children_bound` wide
        when known)."""
        batch, nodes = self.tokens.shape
        is_child = self.valid & (self.parents >= 0)  # [batch, nodes]
        earlier = torch.ones((nodes, nodes), dtype=torch.bool, device=self.tokens.device).tril(-1)
        siblings = (self.parents.unsqueeze(2) == self.parents.unsqueeze(1)) & is_child.unsqueeze(1) & earlier
        rank = siblings.sum(dim=2)  # [batch, nodes] number of earlier siblings
        if self.children_bound is not None:
            width = self.children_bound
        else:
            width = int(rank[is_child].max()) + 1 if bool(is_child.any()) else 0
        children = torch.full((batch, nodes + 1, max(width, 1)), -1, dtype=torch.long, device=self.tokens.device)
        slot = torch.where(is_child, self.parents, nodes)  # non-children write into an extra row, dropped below
        index = slot * children.shape[2] + torch.where(is_child, rank, 0)
        source = torch.arange(nodes, device=self.tokens.device).expand(batch, nodes)
        children.view(batch, -1).scatter_(1, index, torch.where(is_child, source, -1))
        return children[:, :nodes, :width]

    # ---- what the target forward needs -----------------------------------------------------------------------------
    def position_ids(self, prefix_lengths: torch.LongTensor) -> torch.LongTensor:
        """`[batch, nodes]` position ids: the number of the row's tokens before the root (`[batch]`) plus the depth."""
        return prefix_lengths.to(self.depths.device).unsqueeze(1) + self.depths

    def visibility(self, cache_length: int) -> torch.BoolTensor:
        """`[batch, nodes, cache_length + nodes]` what each node may see, before cache validity is applied.

        Every valid node may see every cache column (holes and padding are hidden by the cache's validity, see
        `attention_mask`) and, among the nodes, its ancestors and itself; a placeholder slot sees only itself.
        """
        sees_cache = self.valid.unsqueeze(2).expand(-1, -1, cache_length)  # [batch, nodes, cache_length]
        return torch.cat([sees_cache, self.ancestor_mask()], dim=2)

    def attention_mask(self, cache_valid: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """4D additive mask `[batch, 1, nodes, length + nodes]` for a forward over the nodes on top of a KV cache.

        Each node sees the row's valid cache columns (`cache_valid` `[batch, length]`, 1 where the column is part of
        the row: left padding and holes are 0) and its own ancestors and itself among the nodes. Visible entries are
        0, hidden ones `finfo(dtype).min`. Transformers models take such a mask as is, together with a
        `DynamicCache`; additive float works for every attention implementation (a boolean mask works with SDPA but
        eager attention would add it as numbers), so pass the model's dtype.
        """
        cache_valid = cache_valid.to(self.tokens.device)
        return block_attention_mask(cache_valid, self.visibility(cache_valid.shape[1]), dtype)

    def _parent_of(self, nodes: torch.LongTensor) -> torch.LongTensor:
        """`[batch, n]` parent of each given node index (-1 stays -1)."""
        return torch.where(nodes >= 0, self.parents.gather(1, nodes.clamp(min=0)), -1)


def block_attention_mask(
    cache_valid: torch.Tensor,  # [batch, length] 1 where a cache column is part of the row
    visibility: torch.BoolTensor,  # [batch, width, length + width] what each new token may see
    dtype: torch.dtype,
) -> torch.Tensor:
    """4D additive mask `[batch, 1, width, length + width]` of a forward over a block of new tokens on a KV cache.

    A new token sees a cache column when `visibility` allows it and the column is valid, and a new token (itself
    included) when `visibility` allows it. Visible entries are 0, hidden ones `finfo(dtype).min`.
    """
    width = visibility.shape[1]
    columns = torch.cat([cache_valid.bool(), cache_valid.new_ones((cache_valid.shape[0], width)).bool()], dim=1)
    visible = visibility & columns.unsqueeze(1)  # [batch, width, length + width]
    hidden = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return hidden.masked_fill_(~visible, torch.finfo(dtype).min).unsqueeze(1)


def causal_visibility(length: int, query_mask: torch.LongTensor) -> torch.BoolTensor:
    """`[batch, width, length + width]` what each token of a causal block of new tokens may see on a cache of `length`
    columns: every cache column (their validity decides) and the block's real tokens up to itself."""
    batch, width = query_mask.shape
    causal = torch.ones(width, width, dtype=torch.bool, device=query_mask.device).tril()  # [width, width]
    itself = torch.eye(width, dtype=torch.bool, device=query_mask.device)
    block = (causal & query_mask.bool().unsqueeze(1)) | itself  # [batch, width, width]
    return torch.cat([block.new_ones((batch, width, length)), block], dim=2)


def windowed_attention_masks(
    cache_valid: torch.Tensor,  # [batch, length] 1 where a cache column is part of the row
    visibility: torch.BoolTensor,  # [batch, width, length + width] what each new token may see
    positions: torch.LongTensor,  # [batch, width] position ids of the new tokens
    windows: SlidingWindows,
    dtype: torch.dtype,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The 4D masks (`block_attention_mask`) of a forward of a model with sliding-window layers: in a sliding layer a
    token also hides every key `windows.window` or more positions behind it. A hybrid model gets a mask per layer
    type, a model whose every layer slides one mask.

    A row's valid cache columns hold its tokens in order (holes and padding are invalid), so the `i`-th valid column
    of a row is at position `i - 1`; new tokens are at `positions`.
    """
    keys = torch.cat([cache_valid.long().cumsum(dim=1) - 1, positions.to(cache_valid.device)], dim=1)  # [b, l + w]
    behind = positions.to(cache_valid.device).unsqueeze(2) - keys.unsqueeze(1)  # [batch, width, length + width]
    sliding = block_attention_mask(cache_valid, visibility & (behind < windows.window), dtype)
    if not windows.hybrid:
        return sliding
    return {"full_attention": block_attention_mask(cache_valid, visibility, dtype), "sliding_attention": sliding}


def prefix_visibility(prefix_mask: torch.LongTensor, tree: TokenTree) -> torch.BoolTensor:
    """`[batch, width, width]` what each token of a forward over a prompt prefix and then a token tree may see, on an
    empty cache (`width = prefix + nodes`): a prefix token sees the row's real prefix tokens up to itself, a node the
    row's whole real prefix and its ancestors and itself. Padding sees only itself (no row of the mask is empty).

    Args:
        prefix_mask: `[batch, prefix]` 1 on the prompt's tokens before the tree's root, 0 on padding.
    """
    real = prefix_mask.bool().to(tree.tokens.device)  # [batch, prefix]
    prefix = real.shape[1]
    causal = torch.ones(prefix, prefix, dtype=torch.bool, device=real.device).tril()  # [prefix, prefix]
    itself = torch.eye(prefix, dtype=torch.bool, device=real.device)
    top = (causal & real.unsqueeze(1)) | itself  # [batch, prefix, prefix]
    top = torch.cat([top, top.new_zeros((real.shape[0], prefix, tree.num_nodes))], dim=2)  # nodes come later
    bottom = tree.visibility(prefix)  # [batch, nodes, prefix + nodes]
    bottom = torch.cat([bottom[:, :, :prefix] & real.unsqueeze(1), bottom[:, :, prefix:]], dim=2)
    return torch.cat([top, bottom], dim=1)


# ---- validation ------------------------------------------------------------------------------------------------------
def _check_shapes(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, valid: torch.Tensor) -> None:
    if tokens.ndim != 2 or tokens.shape[1] == 0:
        raise ValueError(f"`tokens` must be [batch, nodes] with at least the root; got shape {tuple(tokens.shape)}.")
    for name, tensor in (("parents", parents), ("depths", depths), ("valid", valid)):
        if tensor.shape != tokens.shape:
            raise ValueError(
                f"`{name}` has shape {tuple(tensor.shape)} but `tokens` has {tuple(tokens.shape)}; every per-node "
                "tensor needs one entry per node slot."
            )


def _check_order(parents: torch.LongTensor, valid: torch.BoolTensor) -> None:
    """Root at node 0 and every valid node's parent a valid earlier node; names the first offending node."""
    if not bool(valid[:, 0].all()) or bool((parents[:, 0] != -1).any()):
        raise ValueError("Node 0 of every row must be the root: a valid node with parent -1.")
    nodes = torch.arange(parents.shape[1], device=parents.device)
    child = valid & (nodes > 0)
    if bool((child & (parents < 0)).any()):
        row, node = (child & (parents < 0)).nonzero()[0].tolist()
        raise ValueError(f"Row {row}: node {node} has parent {int(parents[row, node])}; only the root (node 0) "
                         "has no parent: attach the root's children to node 0.")
    late = child & (parents >= nodes)
    if bool(late.any()):
        row, node = late.nonzero()[0].tolist()
        kind = "a cycle through" if _on_cycle(parents[row], valid[row], node) else "parent after child at"
        raise ValueError(
            f"Row {row}: {kind} node {node} (parent {int(parents[row, node])}). Nodes must be in topological "
            "order, every parent before its children, which also rules out cycles."
        )
    parent_valid = valid.gather(1, parents.clamp(min=0))
    if bool((child & ~parent_valid).any()):
        row, node = (child & ~parent_valid).nonzero()[0].tolist()
        raise ValueError(f"Row {row}: node {node}'s parent {int(parents[row, node])} is a placeholder slot.")


def _on_cycle(parents: torch.LongTensor, valid: torch.BoolTensor, node: int) -> bool:
    """Whether following parents from `node` (one row, `[nodes]`) comes back to a node already visited."""
    seen = set()
    while node >= 0 and node not in seen and node < parents.shape[0] and bool(valid[node]):
        seen.add(node)
        node = int(parents[node])
    return node in seen


def _check_structure(
    tokens: torch.LongTensor, parents: torch.LongTensor, depths: torch.LongTensor, valid: torch.BoolTensor
) -> None:
    _check_order(parents, valid)
    if bool((~valid & (parents != -1)).any()):
        raise ValueError("Placeholder slots (valid False) must have parent -1.")
    expected = torch.where(valid & (parents >= 0), depths.gather(1, parents.clamp(min=0)) + 1, 0)
    if not torch.equal(depths, expected):
        row, node = (depths != expected).nonzero()[0].tolist()
        raise ValueError(
            f"Row {row}: node {node} has depth {int(depths[row, node])} but its parent {int(parents[row, node])} "
            f"implies {int(expected[row, node])}; depths must be 0 at the root and placeholders, parent's + 1 "
            "elsewhere (`TokenTree.from_parents` derives them)."
        )
    same = (parents.unsqueeze(2) == parents.unsqueeze(1)) & (tokens.unsqueeze(2) == tokens.unsqueeze(1))
    same = same & (valid & (parents >= 0)).unsqueeze(2) & (valid & (parents >= 0)).unsqueeze(1)
    same = same & ~torch.eye(tokens.shape[1], dtype=torch.bool, device=tokens.device)
    if bool(same.any()):
        row, first, second = same.nonzero()[0].tolist()
        raise ValueError(
            f"Row {row}: sibling nodes {first} and {second} both carry token {int(tokens[row, first])}; siblings "
            "must carry distinct tokens (merge them into one node)."
        )


def _depths_from_parents(parents: torch.LongTensor) -> torch.LongTensor:
    """`[batch, nodes]` depths of a tree (-1 parents have depth 0), by pointer jumping: after round `i` each node knows
    its ancestor `2 ** i` levels up and how far that is, so `ceil(log2(nodes))` rounds reach every root, with no
    read of the tree on the host."""
    jump = parents.clone()  # [batch, nodes] an ancestor of each node, -1 once past its root
    depths = (parents >= 0).long()  # [batch, nodes] levels from each node up to `jump` (to its root once -1)
    for _ in range(math.ceil(math.log2(max(parents.shape[-1], 2)))):
        up = jump.clamp(min=0)
        depths = depths + torch.where(jump >= 0, depths.gather(1, up), 0)
        jump = torch.where(jump >= 0, jump.gather(1, up), -1)
    return depths
