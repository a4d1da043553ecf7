"""A synthetic decoding environment for testing draft-length policies without models.

An `Environment` prices steps the way the loop's forwards cost on real hardware: a target forward over `N` new
tokens costs `v0 * (1 + N / flat_tokens)`, a memory-bound part (reading the weights) plus a compute-bound part that
equals it at `flat_tokens` tokens (on this CPU in bfloat16, about 40: 8 tokens cost 1.2x one, batch 16 with 3 tokens
per row 1.6x one per row), times `multi_token_factor` when `N > 1` (1 on AMX; about 2.2 in float32 on a CPU with
AVX2 only, where one token is a matrix-vector product and two are a much slower matrix product); a draft forward costs `draft_ratio` times a target forward over the same tokens; the
target's prefill and the draft's catch-ups are priced the same way. Rows accept each draft token with their own probability, independently; other processes on the machine show as
bursts during which every forward is `factor` times slower.

`simulate(policy, environment)` runs a policy through the loop's protocol (`reset`, `observe_prefill`, then per step
`draft_lengths` and `observe`, rows leaving as they finish), keeping each row's draft backlog as the draft-model
proposer does, and returns the wall time and tokens of the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..candidates.draft_model import MAX_INLINE_TAIL
from ..policies.base import DraftLengthPolicy, PolicyInput, PrefillFeedback, StepFeedback


@dataclass(frozen=True)
class Burst:
    """Between `start` and `start + duration` seconds of a run, every forward takes `factor` times longer."""

    start: float
    duration: float
    factor: float


@dataclass(frozen=True)
class Environment:
    """One synthetic workload: a batch, its acceptance per row, the machine's costs and its noise."""

    acceptance: tuple[float, ...]  # per row
    budgets: tuple[int, ...]  # tokens each row generates
    prompt_tokens: int = 200
    v0: float = 0.2  # seconds of a memory-bound target forward
    flat_tokens: int = 40  # new tokens per forward at which the compute-bound part equals the memory-bound one
    draft_ratio: float = 0.3  # draft forward / target forward over the same tokens
    max_draft_tokens: int = 8
    bursts: tuple[Burst, ...] = field(default_factory=tuple)
    multi_token_factor: float = 1.0
    """Forwards over more than one token cost this much more (a CPU whose matrix-vector product reads the weights
    at full bandwidth but whose small matrix products do not: float32 on an AVX2 CPU is about 2.2)."""

    @property
    def batch_size(self) -> int:
        return len(self.acceptance)

    def target_seconds(self, tokens: int) -> float:
        cliff = self.multi_token_factor if tokens > 1 else 1.0
        return self.v0 * cliff * (1.0 + tokens / self.flat_tokens)

    def noise(self, now: float) -> float:
        return max([b.factor for b in self.bursts if b.start <= now < b.start + b.duration], default=1.0)


@dataclass
class Result:
    """Wall seconds and tokens of one simulated run.

    `clean_seconds` prices the same steps without the bursts: a burst late in a run slows whichever run is still
    going, so comparisons of decisions between policies use `clean_seconds`.
    """

    seconds: float
    tokens: int
    clean_seconds: float = 0.0
    drafting_steps: int = 0
    steps: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


def simulate(policy: DraftLengthPolicy, env: Environment, seed: int = 0) -> Result:
    """Run `policy` on `env` (see the module docstring); the same seed gives every policy the same random draws."""
    rng = np.random.default_rng(seed)
    draws = rng.random((env.batch_size, max(env.budgets) + 1, env.max_draft_tokens))  # [rows, steps, depth]
    remaining = np.array(env.budgets, dtype=np.int64) - 1  # the prefill emits each row's first token
    backlog = np.full(env.batch_size, env.prompt_tokens + 1)
    steps_of_row = np.zeros(env.batch_size, dtype=np.int64)
    policy.reset(env.batch_size)
    clean = env.target_seconds(env.batch_size * env.prompt_tokens)
    now = clean * env.noise(0.0)
    policy.observe_prefill(PrefillFeedback(env.batch_size, env.batch_size * env.prompt_tokens, now, env.draft_ratio))
    result = Result(seconds=0.0, tokens=env.batch_size)
    step = 0
    while (active := np.nonzero(remaining > 0)[0]).size:
        rows = torch.from_numpy(active)
        request = PolicyInput(step, rows, torch.from_numpy(remaining[active]), env.max_draft_tokens,
                              torch.from_numpy(backlog[active]))
        lengths = policy.draft_lengths(request).clamp(min=0, max=env.max_draft_tokens)
        lengths = torch.minimum(lengths, request.remaining_tokens - 1).clamp(min=0).numpy()
        accepted = _accepted(env, draws, active, steps_of_row, lengths)
        *seconds, catchup_tokens = _step_seconds(env, active, backlog, lengths, now)
        clean += sum(seconds) / env.noise(now)
        now += sum(seconds)
        emitted = np.minimum(accepted + 1, remaining[active])
        remaining[active] -= emitted
        result.tokens += int(emitted.sum())
        result.steps += 1
        result.drafting_steps += int(lengths.max() > 0)
        backlog[active] = np.where(lengths.max() > 0, 1 + (accepted == lengths) * (lengths > 0), backlog[active] + 1)
        steps_of_row[active] += 1
        batch = len(active)
        policy.observe(StepFeedback(
            rows, torch.from_numpy(lengths), torch.from_numpy(lengths), torch.from_numpy(accepted),
            seconds[1], seconds[2], batch * (1 + int(lengths.max())), seconds[0], catchup_tokens,
        ))
        step += 1
    result.seconds, result.clean_seconds = now, clean
    return result


def _accepted(env: Environment, draws, active, steps_of_row, lengths: np.ndarray) -> np.ndarray:
    """`[active]` leading draft tokens accepted: each with the row's probability, independently."""
    accept = np.array(env.acceptance)[active, None]  # [active, 1]
    hits = draws[active, steps_of_row[active]] < accept  # [active, depth]
    hits &= np.arange(env.max_draft_tokens)[None, :] < lengths[:, None]
    return np.cumprod(hits, axis=1).sum(axis=1)


def _step_seconds(env: Environment, active, backlog, lengths: np.ndarray, now: float) -> tuple[float, float, float, int]:
    """`(catch-up, draft, verify)` seconds of a step with `lengths` (`[active]`) under the noise at `now`, and the
    tokens of its catch-up forward."""
    batch, longest = len(active), int(lengths.max())
    noise = env.noise(now)
    catchup, catchup_tokens = 0.0, 0
    width = int(backlog[active].max())
    if longest > 0 and width > MAX_INLINE_TAIL:
        catchup_tokens = batch * (width - 1)
        catchup = env.draft_ratio * env.target_seconds(catchup_tokens) * noise
    draft = longest * env.draft_ratio * env.target_seconds(batch) * noise
    verify = env.target_seconds(batch * (1 + longest)) * noise
    return catchup, draft, verify, catchup_tokens
