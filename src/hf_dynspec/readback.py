"""A step's one read of the device: what verification decided, copied to the host in a single transfer.

On an accelerator every value the host reads from the device makes it wait for the queued work. The loop reads each
step's verification result once, right after the target's forward, and takes every later decision of the step
(cache trimming, the policy's feedback, emitting, finishing rows) and of the next step's policy from this copy and
from the host copies it keeps in step with it (`sequences.HostRows`, `cache.RaggedCache.host_valid`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .verification import TreeVerification


@dataclass
class HostOutcome:
    """A step's verification result on the host."""

    accepted: torch.LongTensor  # [batch] draft tokens accepted
    counts: torch.LongTensor  # [batch] tokens each row emits, cut at EOS and at its length budget
    finished: torch.BoolTensor  # [batch] rows that end with this step (EOS or length budget)
    kept: torch.BoolTensor  # [batch, nodes] the root and the accepted path
    emitted: torch.LongTensor  # [batch, width] the emitted tokens (the first `counts[b]` of row `b`)
    deepest: torch.LongTensor  # [batch] depth of each row's deepest draft node (a chain's: its length)

    @classmethod
    def read(
        cls, outcome: TreeVerification, counts: torch.LongTensor, finished: torch.BoolTensor, deepest: torch.LongTensor
    ) -> HostOutcome:
        """`outcome` with each row's emitted `counts`, `finished` and `deepest` (`[batch]` each, on the device), in one
        copy."""
        nodes = outcome.kept.shape[1]
        rows = [outcome.accepted, counts, finished.long(), deepest]
        parts = [row.unsqueeze(1) for row in rows] + [outcome.kept.long(), outcome.emitted]
        host = torch.cat([part.to(outcome.emitted.device) for part in parts], dim=1).to("cpu", copy=True)  # the one read
        return cls(host[:, 0], host[:, 1], host[:, 2].bool(), host[:, 4 : 4 + nodes].bool(), host[:, 4 + nodes :],
                   host[:, 3])
