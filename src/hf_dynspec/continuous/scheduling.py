"""transformers' scheduler, made to book a decoding request's draft tokens as tokens of its step.

Registered in transformers' `SCHEDULER_MAPPING` as `dynspec_<name>` for each scheduler a manager names
(`draft_aware_scheduler`): a step's query of a decoding request is its newest token and its draft, which the
scheduler cuts (never splits) when the step's token budget or the cache runs short.
"""

from __future__ import annotations

from .engine import SCHEDULER_MAPPING, RequestState, RequestStatus, Scheduler


class DraftAwareScheduling:
    """Mixed into a transformers scheduler: a decoding request's query is its newest token and its draft tokens.
    When the cache cannot store them all, the draft is dropped; when the step's token budget cannot take them all,
    the draft is cut. A decoding request is never split as a prompt would be."""

    def _infer_request_tokens(self, state: RequestState, request_ids_to_remove_from_waiting: set[str]) -> list[int]:
        tokens = super()._infer_request_tokens(state, request_ids_to_remove_from_waiting)
        drafted = state.status == RequestStatus.DECODING and len(tokens) > 1
        if drafted and not self.cache.can_store_request_tokens(state, len(tokens), dry_run=True):
            state.tokens_to_process = tokens = tokens[:1]
        return tokens

    def _schedule_request(
        self, state: RequestState, request_tokens: list[int], token_budget: int, request_ids_to_remove: set[str]
    ) -> None:
        if state.status == RequestStatus.DECODING and len(request_tokens) > token_budget:
            state.tokens_to_process = request_tokens[:token_budget]
            return
        super()._schedule_request(state, request_tokens, token_budget, request_ids_to_remove)


def draft_aware_scheduler(name: str) -> str:
    """Register the draft-aware version of transformers' scheduler `name` in its `SCHEDULER_MAPPING`; its name."""
    if name.startswith("dynspec_"):
        return name
    if name not in SCHEDULER_MAPPING:
        raise ValueError(f"Unknown scheduler {name!r}; transformers has {sorted(SCHEDULER_MAPPING)}.")
    base: type[Scheduler] = SCHEDULER_MAPPING[name]
    speculative = f"dynspec_{name}"
    if speculative not in SCHEDULER_MAPPING:
        SCHEDULER_MAPPING[speculative] = type(f"DraftAware{base.__name__}", (DraftAwareScheduling, base), {})
    return speculative
