"""What the loop records about each step, returned as `dynspec_stats`.

Vocabulary (used the same way in code, docs and these fields):

- *draft tokens*: tokens a proposer suggests for a row in one step; their count is the row's *draft length*.
- *accepted tokens*: the leading draft tokens the verifier keeps (in a token tree: the draft tokens on the accepted
  path from the root).
- *recovered token*: the token the verifier samples (or picks greedily) at the first rejected position.
- *bonus token*: the token the verifier samples after the last draft token when every draft token was accepted.
- *emitted tokens*: what a row gains in a step: its accepted tokens plus one recovered or bonus token, cut short when
  the row stops (EOS, stop strings, length limits).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepRecord:
    """One step of the loop over the active rows (lists are aligned with `row_ids`)."""

    batch_size: int
    row_ids: list[int]
    requested_lengths: list[int]
    draft_lengths: list[int]
    accepted: list[int]
    emitted: list[int]
    draft_seconds: float
    verify_seconds: float
    target_tokens: int
    """Tokens the target processed in the verify forward, padding included (`batch_size * (1 + max draft length)`;
    for trees, `batch_size * (1 + most draft nodes in a row)`)."""
    catchup_seconds: float = 0.0
    """Draft time spent catching up on a backlog (the draft's prompt prefill), excluded from `draft_seconds`."""
    catchup_tokens: int = 0
    """Tokens the draft processed in that catch-up forward, padding included."""
    overhead_seconds: float = 0.0
    """Loop time of the step outside drafting, catch-up and verification (policy, acceptance, bookkeeping)."""
    free_rows: list[bool] | None = None
    """Hybrid proposer: True where the row's draft tokens came from prompt lookup (no draft forward)."""
    draft_depths: list[int] | None = None
    """Token trees: depth of each row's tree (its longest path). `draft_lengths` then counts the tree's draft nodes,
    `accepted` the length of the accepted path; `None` for chains, whose depth is their draft length."""


@dataclass
class DynSpecStats:
    """Totals and per-step records of one `generate` call."""

    batch_size: int
    prompt_length: int
    steps: list[StepRecord] = field(default_factory=list)
    num_steps: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0
    compactions: int = 0
    prefill_seconds: float = 0.0
    catchup_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    overhead_seconds: float = 0.0
    """`total_seconds` minus prefill, draft, catch-up and verify seconds: the loop's own work."""
    total_seconds: float = 0.0
    narrow_rows: dict[str, int] = field(default_factory=dict)
    """Per model (`target`, `draft`): the most rows of a forward whose linear layers were computed weight-first
    (`DynSpecConfig.narrow_linear`; 0: none)."""
    draft_lookahead: int | None = None
    """The most lookahead guess tokens a draft forward carried (`draft_lookahead`, cut to what
    `draft_lookahead_max_cost` allows); None when no draft model drafted."""
    rollout_rows: int = 0
    """Rollout reuse (`DynSpecConfig.reuse_rollouts`): rows whose stream had an earlier response in the cache."""
    copied_tokens: int = 0
    """Accepted draft tokens that a model-free source proposed (a copy from the context: prompt lookup, suffix trees,
    the rollout cache) rather than the draft model; the rest of `accepted_tokens` is the draft model's."""
    reused_tokens: int = 0
    """Rollout reuse: accepted draft tokens that the rollout cache proposed (tokens an earlier sample gave again)."""

    @property
    def accounted_seconds(self) -> float:
        """Prefill, draft, catch-up and verify seconds together (everything but the loop's own work)."""
        return self.prefill_seconds + self.draft_seconds + self.catchup_seconds + self.verify_seconds

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over proposed draft tokens (0 when nothing was proposed)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted(self) -> float:
        """Mean accepted draft tokens per row-step that proposed at least one draft token."""
        counts = [a for s in self.steps for a, k in zip(s.accepted, s.draft_lengths) if k > 0]
        return sum(counts) / len(counts) if counts else 0.0

    def to_dict(self) -> dict:
        """JSON-friendly dict, per-step records included."""
        from dataclasses import asdict

        out = asdict(self)
        out["acceptance_rate"] = self.acceptance_rate
        out["mean_accepted"] = self.mean_accepted
        return out
