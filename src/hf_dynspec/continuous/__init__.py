"""Speculation under transformers' continuous batching: `generate_batch` and `init_continuous_batching`.

transformers' continuous batching (`model.generate_batch`, `model.init_continuous_batching()` and its
`ContinuousBatchingManager`, `transformers serve --continuous-batching`) schedules requests step by step: each step's
forward holds the decoding requests' newest tokens and chunks of other requests' prompts, packed into one sequence,
over a paged KV cache. Speculation enters at three seams of that engine, and nowhere else:

- before the scheduler builds a step, every decoding request gets `k_i` draft tokens from its proposer (a draft
  model decoding the same requests in a paged cache of its own, prompt lookup, suffix trees over every request's
  prompt and output, or per request one of these and the draft model), `k_i` chosen by the policy
  (`DynSpecConfig.policy`, goodput by default) from the decoding requests, their acceptance and the measured step
  costs. The request's query becomes its newest token and its draft: the scheduler (transformers' own, subclassed
  through its `SCHEDULER_MAPPING` registry) books them as tokens of the step and pages of the cache, and cuts a draft
  rather than splitting a request when the step's token budget or the cache runs short;
- the step's forward keeps the logits of every query position of a drafting request; verification
  (`hf_dynspec.verification`: greedy matching, or rejection sampling of a deterministic proposal) accepts `a_i`
  draft tokens and adds one more, all appended to the request at once;
- the request's position then moves back over its rejected positions, which the next step overwrites in the paged
  cache. Blocks registered for prefix sharing are counted over the accepted positions only.

Proposals may be token trees (suffix trees, prompt-lookup tries, a draft model's chain with its runner-up tokens): a
tree's nodes are the request's query (parents first), its block of the step's attention mask is rewritten so that each
node sees its ancestors alone, at its depth's position, and the accepted nodes' keys and values are copied to their
path's positions after verification.

Requests without a draft go through transformers' own update, unchanged, so a step in which no request drafts is
exactly a plain continuous-batching step.

The package's modules name the seams of transformers' engine they use:

- `engine`: every import of transformers' continuous-batching internals (no other module imports them);
- `proposers`: the interface the speculator drives (`RequestProposer`), model-free sources of `candidates/` driven
  per request (`ModelFreeRequests`);
- `paged_draft`: the draft model in a paged cache of its own (`PagedDraftRequests`), where the engine shows through;
- `hybrid`: a model-free source beside the draft model, per request and step (`HybridRequests`);
- `speculator`: each step's drafts and what the policy learns from them (`Speculator`);
- `scheduling`: transformers' scheduler, booking drafts as tokens of the step;
- `batch_processor`: the step's forward and verification (`SpeculativeBatchProcessor`);
- `manager`: transformers' manager with the above (`SpeculativeManager`);
- `entry_points`: `init_continuous_batching` and `generate_batch`.
"""

from .batch_processor import SpeculativeBatchProcessor
from .entry_points import generate_batch, init_continuous_batching
from .hybrid import HybridRequests
from .manager import SpeculativeManager, held_blocks
from .paged_draft import PagedDraftRequests, chain_and_alternatives
from .proposers import DraftRequest, ModelFreeRequests, RequestProposer
from .scheduling import DraftAwareScheduling, draft_aware_scheduler
from .speculator import SpeculationStats, Speculator

__all__ = [
    "DraftAwareScheduling",
    "DraftRequest",
    "HybridRequests",
    "ModelFreeRequests",
    "PagedDraftRequests",
    "RequestProposer",
    "SpeculationStats",
    "SpeculativeBatchProcessor",
    "SpeculativeManager",
    "Speculator",
    "chain_and_alternatives",
    "draft_aware_scheduler",
    "generate_batch",
    "held_blocks",
    "init_continuous_batching",
]
