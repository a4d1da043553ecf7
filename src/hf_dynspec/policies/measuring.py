"""When the `goodput` policy measures an option its estimates do not favour: the expected improvement of knowing.

A step's option is its draft lengths and the rows served by model-free proposals. The search at mean acceptance
picks one; the search at optimistic acceptance may name another. Measuring the other for one step pays when

    T * E[max(0, 1 / r_chosen(a) - 1 / r_other(a))]  >  the step's cost against the chosen option,

with `r(a)` each option's expected tokens per second at its steady price, where the draft model's acceptance and the
model-free sources' lie independent numbers of pooled standard deviations from their means (a five-point
Gauss-Hermite quadrature over each),
and `T` the tokens the measurement informs (`informed_tokens`). See docs/policies.md, "Measuring what is uncertain".
"""

from __future__ import annotations

from collections.abc import Callable

import torch

QUADRATURE = ((-2.857, 0.0113), (-1.356, 0.2221), (0.0, 0.5333), (1.356, 0.2221), (2.857, 0.0113))
"""Gauss-Hermite nodes (standard deviations from the mean) and weights of a normal posterior."""
MAX_MEMORY_STEPS = 1000.0
"""The steps an estimate that never decays (`acceptance_decay=1`) is counted to inform past the current call."""

Option = tuple[torch.LongTensor, "torch.BoolTensor | None"]
"""A step's choice: draft lengths `[batch]` and the rows served by model-free proposals (`None`: the draft's only)."""


def same_option(one: Option, other: Option) -> bool:
    """Whether two options draft the same lengths from the same sources."""
    if not torch.equal(one[0], other[0]):
        return False
    free = [torch.zeros_like(option[0], dtype=torch.bool) if option[1] is None else option[1] for option in (one, other)]
    return torch.equal(free[0] & (one[0] > 0), free[1] & (other[0] > 0))


def expected_improvement(steady: tuple[float, float], chosen: torch.Tensor, other: torch.Tensor) -> float:
    """`E[max(0, 1 / r_chosen(a) - 1 / r_other(a))]`: the seconds per token the other option is expected to save once
    known to be better. `steady`: both options' step seconds without catch-up; `chosen`, `other`: `[nodes, nodes]`
    their expected tokens with the draft model's acceptance at each node of `QUADRATURE` (rows) and the model-free
    sources' at each node (columns). The two are independent: what is known of one says nothing of the other
    (moved together, copies that might be better hide a draft that might be better)."""
    weights = torch.tensor([weight for _, weight in QUADRATURE], dtype=torch.float64)
    saved = (steady[0] / chosen - steady[1] / other).clamp(min=0.0)  # [nodes, nodes]
    return float((weights.unsqueeze(1) * weights.unsqueeze(0) * saved).sum())


def node_acceptances(shifted: Callable[[float], torch.Tensor]) -> torch.Tensor:
    """`[nodes, batch]`: `shifted(z)` (`[batch]` acceptance `z` pooled deviations off) at each node of `QUADRATURE`."""
    return torch.stack([shifted(z) for z, _ in QUADRATURE])


def informed_tokens(remaining: float, emitted: float, decay: float) -> float:
    """Tokens whose decisions a measurement emitting `emitted` tokens now informs: the rest of the call's `remaining`
    (an option found better is taken, and measured, to its end) and, past it, the estimate's memory
    (`1 / (1 - decay)` steps of `emitted` tokens: the pooled estimate carries into the calls that follow)."""
    memory = 1.0 / (1.0 - decay) if decay < 1.0 else MAX_MEMORY_STEPS
    return max(0.0, remaining - emitted) + emitted * min(memory, MAX_MEMORY_STEPS)
