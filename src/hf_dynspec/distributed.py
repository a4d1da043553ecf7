"""Rank 0 decides, every rank follows: the loop's decisions under a tensor-parallel target.

A target loaded with `tp_plan="auto"` under `torchrun` is sharded over the ranks of its tensor-parallel group, and
every rank runs the same speculative loop with a full copy of the draft. Each target forward is a collective: every
rank must feed the same ids of the same shape, or the collectives hang or mix different batches. Four decisions of
the loop can differ between ranks:

- the draft lengths: policies such as `goodput` learn from wall-clock timings, which differ per rank;
- the proposal: a sampling draft draws from each rank's own random state, and a policy's early stop depends on it;
- the verifier's output: rejection sampling draws from each rank's own random state too;
- coupled sampling's seed, when a call draws it from each rank's own random state.

`DecisionBroadcast` makes rank 0 of the target's tensor-parallel group decide all four and sends the decision to the
other ranks, so every rank emits the same tokens whatever its timings or random state. Everything else (emitting,
finishing rows, cache bookkeeping) follows from these decisions deterministically. Outside a tensor-parallel run it
is a no-op that returns its inputs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers import PreTrainedModel
from transformers.distributed.fsdp import is_fsdp_managed_module
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

from .candidates.base import Proposal
from .candidates.tree import TokenTree
from .devices import multi_process, tensor_parallel_group
from .placement import Placement
from .verification import TreeVerification, tree_outcome


class DecisionBroadcast:
    """Broadcasts the loop's per-step decisions from rank 0 of the target's tensor-parallel group.

    Built once per `generate` call (`for_run`). With `group=None` every method returns its input unchanged.
    Tensors travel on the CPU when the group's backend is gloo (which cannot send accelerator tensors), otherwise
    on the loop device, and come back on the device they were given on.
    """

    def __init__(self, group: dist.ProcessGroup | None, loop_device: torch.device) -> None:
        self.group = group
        self.enabled = group is not None
        self.is_source = not self.enabled or dist.get_rank(group) == 0
        backend = str(dist.get_backend(group)) if self.enabled else ""
        self.transport = torch.device("cpu") if "gloo" in backend else loop_device

    @classmethod
    def for_run(
        cls, target: PreTrainedModel, draft: PreTrainedModel | None, placement: Placement
    ) -> DecisionBroadcast:
        """The broadcaster of one `generate` call; checks that a tensor-parallel target has a usable draft."""
        _check_not_gathered_per_forward(target)
        group = tensor_parallel_group(target)
        if group is not None and draft is not None:
            _check_draft(draft, placement)
        return cls(group, placement.loop_device)

    def lengths(self, lengths: torch.LongTensor) -> torch.LongTensor:
        """Rank 0's per-row counts `[batch]`: draft lengths (tree depths) or tree node budgets, already capped."""
        if not self.enabled:
            return lengths
        return self._broadcast(lengths)

    def seed(self, seed: int) -> int:
        """Rank 0's coupling seed of the call (a seed drawn from each rank's own generator may differ)."""
        if not self.enabled:
            return seed
        return int(self._broadcast(torch.tensor([seed], dtype=torch.long))[0])

    def free_rows(self, free_rows: torch.BoolTensor | None, batch_size: int) -> torch.BoolTensor | None:
        """Rank 0's rows served by a model-free proposal (`[batch]` on the host), or its `None` (its policy gave no
        answer), whatever this rank's policy answered: every rank's proposer offers alike, so every rank calls this."""
        if not self.enabled:
            return free_rows
        code = free_rows.long() if free_rows is not None else torch.full((batch_size,), -1, dtype=torch.long)
        code = self._broadcast(code)  # [batch]; -1: no answer
        return None if bool((code < 0).any()) else code.bool()

    def proposal(self, proposal: Proposal) -> Proposal:
        """Rank 0's draft tokens `[batch, width]`, lengths `[batch]` and, for trees, parent nodes `[batch, width]`.

        The draft probabilities (`[batch, width, vocab]`, sampling only) are not sent: only rank 0's verifier output
        counts (`verdict`), and it is computed with rank 0's own probabilities. The other ranks keep `probs=None`,
        so their (discarded) verification never reads probabilities of tokens they did not propose. Under greedy
        decoding every rank's draft proposes the same tokens anyway. Every rank runs the same proposer, so all of
        them know whether a tree (with parents) is coming.
        """
        if not self.enabled:
            return proposal
        batch = proposal.lengths.shape[0]
        width = int(self._broadcast(torch.tensor([proposal.max_length]))[0])
        parts = [proposal.lengths.unsqueeze(1), proposal.tokens]
        if proposal.parents is not None:
            parts.append(proposal.parents)
        packed = torch.cat(parts, dim=1)  # [batch, 1 + local width (x2 for trees)]
        if not self.is_source:
            packed = proposal.tokens.new_zeros((batch, 1 + width * (len(parts) - 1)))  # filled by the broadcast
        packed = self._broadcast(packed)
        parents = packed[:, 1 + width :] if proposal.parents is not None else None
        probs = proposal.probs if self.is_source else None
        return Proposal(tokens=packed[:, 1 : 1 + width], lengths=packed[:, 0], probs=probs, parents=parents)

    def verdict(self, tree: TokenTree, outcome: TreeVerification) -> TreeVerification:
        """Rank 0's verification outcome: where each row's accepted path ends and the token after it."""
        if not self.enabled:
            return outcome
        both = self._broadcast(torch.stack([outcome.last_node, outcome.next_tokens]))  # [2, batch]
        return tree_outcome(tree, both[0], both[1])

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's value of `tensor` (same shape and dtype on every rank), on `tensor`'s device; never in place."""
        buffer = tensor.to(self.transport, copy=True).contiguous()
        dist.broadcast(buffer, group=self.group, group_src=0)
        return buffer.to(tensor.device)


def _check_not_gathered_per_forward(target: PreTrainedModel) -> None:
    """Refuse DeepSpeed ZeRO-3 / FSDP targets, where transformers would set `synced_gpus` (it does not forward that
    flag to a callable `custom_generate`, so the loop checks the condition itself)."""
    if multi_process() and (is_deepspeed_zero3_enabled() or is_fsdp_managed_module(target)):
        raise ValueError(
            "The target is sharded with DeepSpeed ZeRO-3 or FSDP, which needs synced_gpus=True (every rank runs "
            "forwards until all have finished); that is not supported by the speculative loop. Shard the target with "
            "tensor parallelism (`tp_plan=\"auto\"` under torchrun) instead, or generate with plain `generate`."
        )


def _check_draft(draft: PreTrainedModel, placement: Placement) -> None:
    """A tensor-parallel target needs a full draft copy on each rank's own device."""
    if tensor_parallel_group(draft) is not None:
        raise ValueError(
            "The draft model is sharded (tensor-parallel) like the target. hf_dynspec runs a full copy of the draft on "
            "every rank: load the draft without `tp_plan` / `distributed_config`."
        )
    if placement.draft_device != placement.target_device:
        raise ValueError(
            f"The target is tensor-parallel and this rank's shard is on {placement.target_device}, but the draft is on "
            f"{placement.draft_device}. Every rank needs its own copy of the draft on its own device: call "
            "`draft.to(model.device)` on every rank."
        )
