"""The batched proposer interface used by the speculative loop."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..devices import upload
from ..sequences import TokenBatch
from .tree import TokenTree, checks_loop_trees

# Called after each draft token with (rows `[n]`: indices into the step's batch of the rows that just drew one,
# positions `[n]`: the token's index in each row's draft, the draft's probability of each token `[n]`); returns `[n]`
# bool, False where a row stops drafting, or None to keep going.
EarlyStop = Callable[[torch.LongTensor, torch.LongTensor, torch.Tensor], "torch.BoolTensor | None"]


@dataclass
class Proposal:
    """Draft tokens for every active row: a chain per row, or a tree when `parents` is given.

    Rows propose different numbers of tokens; `tokens` is padded to the longest row with placeholder tokens (ignored
    by the verifier: only the first `lengths[b]` entries of row `b` are draft tokens). Draft token `i` is node `i + 1`
    of the row's `TokenTree`, whose root (node 0) is the row's newest committed token. In a chain the parent of node
    `i + 1` is node `i`; a tree proposal names each draft token's parent node in `parents`.
    """

    tokens: torch.LongTensor  # [batch, max_length] draft tokens, placeholder-padded
    lengths: torch.LongTensor  # [batch] draft tokens per row (0 allowed)
    probs: torch.Tensor | None  # [batch, max_length, vocab] distribution q each token was sampled from; None = one-hot
    parents: torch.LongTensor | None = None  # [batch, max_length] parent node of each draft token; None = a chain
    host_lengths: torch.LongTensor | None = None  # [batch] `lengths` on the host, when the proposer knows them there

    @property
    def max_length(self) -> int:
        return int(self.tokens.shape[1])

    def lengths_on_host(self) -> torch.LongTensor:
        """`[batch]` `lengths` on the host (`host_lengths`, else copied from the device: a synchronisation)."""
        if self.host_lengths is None:
            self.host_lengths = self.lengths.to("cpu", copy=True)
        return self.host_lengths

    def tree(self, root: torch.LongTensor) -> TokenTree:
        """The proposal as a `TokenTree` of `1 + max_length` nodes under `root` (`[batch]` newest committed tokens).

        Its structure is checked only where `tree.CHECK_ENV` asks for it (the checks read it on the host); its
        `depth_bound` is `max_length`."""
        check = checks_loop_trees()
        if self.parents is None:
            return TokenTree.from_chain(self.tokens, self.lengths, root, check=check)
        valid = torch.arange(self.max_length + 1, device=self.tokens.device).unsqueeze(0) <= self.lengths.unsqueeze(1)
        tokens = torch.cat([root.unsqueeze(1).to(self.tokens.device), self.tokens], dim=1)  # [batch, 1 + max_length]
        parents = torch.cat([torch.full_like(self.lengths, -1).unsqueeze(1), self.parents], dim=1)
        tree = TokenTree.from_parents(tokens, parents, valid, check=check)
        tree.depth_bound = self.max_length
        return tree

    def node_probs(self, tree: TokenTree) -> torch.Tensor | None:
        """`[batch, nodes, vocab]`: at node `j`, the distribution `q` its children were drawn from (`None`: one-hot)."""
        if self.probs is None:
            return None
        batch, _, vocab = self.probs.shape
        probs = self.probs.new_zeros((batch, tree.num_nodes, vocab))
        parents = tree.parents[:, 1:]  # [batch, max_length] parent of each draft token, -1 on placeholders
        into = torch.where(parents >= 0, parents, tree.num_nodes - 1)  # placeholders write into the last slot
        probs.scatter_(1, into.unsqueeze(2).expand(-1, -1, vocab), self.probs)
        return probs


class BatchedProposer(ABC):
    """A proposer the batched loop drives: it proposes per-row draft tokens and tracks what it has seen.

    Lifecycle in one `generate` call: `start` once, then per step `propose` -> `commit`, and `finish_rows` ->
    `select_rows` whenever finished rows leave the batch.
    """

    #: proposer counts its own model forwards here (0 for model-free proposers)
    forwards: int = 0
    #: seconds the last `propose` spent catching the proposer's model up on a backlog (its prefill), not drafting
    catchup_seconds: float = 0.0
    #: tokens (padding included) of that catch-up forward
    catchup_tokens: int = 0
    #: seconds the last `propose` spent on one-off measurements (the draft's lookahead width, once per process):
    #: neither drafting nor catch-up, so the policy does not learn them as a cost of drafting
    setup_seconds: float = 0.0
    #: `[batch]` rows the last `propose` served from a model-free proposal (hybrid proposers; `None` otherwise)
    last_free_rows: torch.BoolTensor | None = None
    #: the proposer's model (`None` for model-free proposers)
    model = None
    #: each row drafts in model forwards of its own, so a step's draft time grows with the rows that draft (policies
    #: price it so, `PrefillFeedback.draft_rows_apart`); False: one forward drafts a token for the whole batch
    rows_apart: bool = False
    #: the proposer reads the target's hidden states per row after each target forward (an EAGLE-3 head), so verify
    #: forwards keep rows apart (no packing) and the prefill verifies nothing
    reads_target_states: bool = False

    def start(self, batch: TokenBatch) -> None:
        """Begin a new `generate` call on `batch` (the prompt plus the first generated token)."""
        self.forwards = 0

    @abstractmethod
    def propose(
        self,
        batch: TokenBatch,
        lengths: torch.LongTensor,
        early_stop: EarlyStop | None = None,
        free_rows: torch.BoolTensor | None = None,
        node_budgets: torch.LongTensor | None = None,
    ) -> Proposal:
        """Propose up to `lengths[b]` (`[batch]`, 0 allowed) draft tokens for each row of `batch`.

        `free_rows` (`[batch]`, hybrid proposers only) marks the rows to serve from the model-free proposal.
        `node_budgets` (`[batch]`, tree proposers only) caps each row's draft nodes; `lengths` then caps its depth.
        """

    def couple(self, streams: torch.LongTensor, keying: str = "context") -> None:
        """Coupled sampling (`hf_dynspec.coupling`) with `streams` (`[rows]`, one per row of the batch `generate`
        received) and keys `keying` (`DynSpecConfig.coupling_keys`): a proposer that draws tokens of its own (a draft
        model) draws each as the perturbed argmax of its scores under the noise the target uses at the same place,
        and proposes it as a fixed token. Model-free proposers propose fixed tokens anyway."""

    def backlog(self, batch: TokenBatch) -> torch.LongTensor | None:
        """`[batch]` tokens the proposer's model must process before it can draft (`None`: no model)."""
        return None

    def free_lengths(self, batch: TokenBatch, max_length: int) -> torch.LongTensor | None:
        """`[batch]` draft tokens a model-free proposal offers each row this step (hybrid proposers; else `None`)."""
        return None

    def free_anchors(self, batch: TokenBatch) -> torch.LongTensor | None:
        """`[batch]` after `free_lengths`: how many of each row's final tokens equal those before the source of its
        model-free proposal (`prompt_lookup.lookup_match`; long while a row copies a span). `None` without one."""
        return None

    def free_confidence(self, batch: TokenBatch) -> torch.Tensor | None:
        """`[batch]` after `free_lengths`: how sure the model-free proposal is of each row's continuation, the
        geometric mean over its tokens of the share of earlier occurrences that continued that way (suffix trees;
        1 without a continuation). `None` when the proposal does not say (prompt lookup)."""
        return None

    def commit(self, batch: TokenBatch, proposal: Proposal, kept: torch.BoolTensor) -> None:
        """After verification; `batch` is already updated.

        Args:
            kept: `[batch, 1 + max_length]` per node of the proposal's tree (node 0 the root, node `i + 1` draft token
                `i`): True on the root and the accepted path.
        """

    def finish_rows(self, batch: TokenBatch, done: torch.LongTensor) -> None:
        """Rows at indices `done` (`[finished]`) of `batch` finished with the tokens they hold; `select_rows` follows
        when any row keeps running."""

    def select_rows(self, keep: torch.LongTensor) -> None:
        """Keep only the rows at indices `keep` (finished rows leave the batch)."""

    def release(self) -> None:
        """Free per-call state (caches) at the end of `generate`."""


def tree_proposal(tree: TokenTree, device: torch.device) -> Proposal:
    """The draft nodes of `tree` (built on the host, e.g. by `TokenTree.from_parent_lists`) as a tree `Proposal` on
    `device`, copied without waiting for it."""
    host_lengths = tree.num_draft
    tokens, lengths, parents = (upload(t, device) for t in (tree.tokens[:, 1:], host_lengths, tree.parents[:, 1:]))
    return Proposal(tokens, lengths, None, parents, host_lengths=host_lengths)
