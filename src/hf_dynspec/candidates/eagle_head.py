"""A draft head (an EAGLE-3 head, `hf_dynspec.eagle3`; the target's MTP layers, `hf_dynspec.mtp`) proposes chains and
token trees from the target's own hidden states.

The head is driven as a draft model (`DraftModelProposer`: its ragged cache, catch-up, sampling, coupled sampling and
early stops; `DraftTreeProposer` for trees), with three differences:
- after every target forward, the target's states at the head's tap points (an EAGLE-3 head's auxiliary layers, an
  MTP layer's final norm) are fused and kept per row and position (`TargetTap`, hooks on those modules: only they are
  read, no `output_hidden_states`);
- a draft token's cache entry was computed from the head's own state, not the target's, so it never stays: accepted
  draft tokens are fed again, with the target's states, in the next proposal's first forward, which carries the
  whole step's backlog (a step's accepted tokens and bonus token) instead of catching it up apart;
- no lookahead guesses: a guess at a drafted position would need the head's state at the position before it, which
  the same forward computes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel

from ..config import DynSpecConfig
from ..eagle3 import HeadInputs, StateHead
from ..placement import Placement
from ..sequences import TokenBatch
from .base import EarlyStop, Proposal
from .draft_model import DraftModelProposer
from .draft_tree import DraftTreeProposer

INITIAL_POSITIONS = 256
"""Positions `HeadInputs` holds at first beyond the prompt (it doubles as rows grow)."""


Columns = Callable[[int, int], "torch.LongTensor | None"]
"""`(batch, width)` of a target forward -> the `HeadInputs` slot of each of its columns (`[batch, width]`, -1 for
columns of no slot), or `None` when the forward is not one of the engine's steps (a measurement)."""


class TargetTap:
    """Forward pre-hooks on the target's auxiliary layers: each target forward's states there, fused by the head,
    are written into `HeadInputs.target` at the forward's positions, in the slots `columns` names."""

    def __init__(self, target: PreTrainedModel, head: StateHead, inputs: HeadInputs, columns: Columns) -> None:
        self.head, self.inputs, self.columns = head, inputs, columns
        self.points = head.tap_points(target)
        self.states: dict[int, torch.Tensor] = {}
        self.positions: torch.LongTensor | None = None
        decoder = target.get_decoder()
        self.handles = [decoder.register_forward_pre_hook(self._positions, with_kwargs=True)]
        for index, (module, where) in enumerate(self.points):
            if any(module is other for other, _ in self.points[:index]):
                continue  # a module read twice (the same layer id) is hooked once
            if where == "input":
                self.handles.append(module.register_forward_pre_hook(self._before(module), with_kwargs=True))
            else:
                self.handles.append(module.register_forward_hook(self._after(module), with_kwargs=True))

    def _positions(self, module, args, kwargs) -> None:
        self.positions = kwargs.get("position_ids")

    def _before(self, module: torch.nn.Module):
        def hook(_, args, kwargs):
            self._keep(module, args[0] if args else kwargs["hidden_states"])

        return hook

    def _after(self, module: torch.nn.Module):
        def hook(_, args, kwargs, output):
            self._keep(module, output[0] if isinstance(output, tuple) else output)

        return hook

    def _keep(self, module: torch.nn.Module, hidden: torch.Tensor) -> None:
        """Keep one tap point's states (`[batch, width, target_hidden]`); once every point has given its, fuse them
        and write them at the forward's positions."""
        self.states[id(module)] = hidden
        if len(self.states) < len({id(m) for m, _ in self.points}):
            return
        states, self.states = self.states, {}
        slots = self.columns(*hidden.shape[:2])
        if slots is None or self.positions is None:
            return
        device = self.head.device
        with torch.no_grad():
            fused = self.head.fuse([states[id(m)].to(device) for m, _ in self.points])  # [batch, width, hidden]
        positions = self.positions.to(device).expand(hidden.shape[0], -1)
        previous, self.inputs.columns = self.inputs.columns, slots.to(device)
        try:
            self.inputs.write("target", positions, fused)
        finally:
            self.inputs.columns = previous

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


class HeadProposer(DraftModelProposer):
    """Draft chains with a head over the target's hidden states (an EAGLE-3 head, the target's MTP layers)."""

    reads_target_states = True

    def __init__(
        self,
        head: StateHead,
        target: PreTrainedModel,
        logits_processor: LogitsProcessorList,
        generation_config: GenerationConfig,
        placement: Placement,
        dynspec_config: DynSpecConfig | None = None,
    ) -> None:
        super().__init__(head, logits_processor, generation_config, placement, dynspec_config)
        head.bind(target)
        self.target = target
        self.inputs: HeadInputs | None = None
        self.tap: TargetTap | None = None

    def start(self, batch: TokenBatch) -> None:
        super().start(batch)
        head = self.draft_model
        width = batch.prompt_width + INITIAL_POSITIONS
        self.inputs = HeadInputs(batch.batch_size, width, head.config.hidden_size, head.dtype, head.device)
        head.inputs = self.inputs
        if self.tap is not None:
            self.tap.remove()
        self.tap = TargetTap(self.target, head, self.inputs, self._rows)

    def _rows(self, batch: int, width: int) -> torch.LongTensor | None:
        """Row `b` of a target forward over the call's rows is slot `b`."""
        rows = self.inputs.committed.shape[0]
        return torch.arange(rows).unsqueeze(1).expand(rows, width) if batch == rows else None

    def inline_tail(self) -> int:
        """The whole backlog of a step (its accepted draft tokens and bonus token) rides in the first forward."""
        return self.config.num_speculative_tokens + 2

    def lookahead_tokens(self, base: int = 1) -> int:
        return 0

    def propose(
        self,
        batch: TokenBatch,
        lengths: torch.LongTensor,
        early_stop: EarlyStop | None = None,
        free_rows: torch.BoolTensor | None = None,
        node_budgets: torch.LongTensor | None = None,
    ) -> Proposal:
        self.inputs.committed = batch.num_real.to(self.inputs.committed.device)  # the target's states end before
        return super().propose(batch, lengths, early_stop, free_rows, node_budgets)

    def commit(self, batch: TokenBatch, proposal: Proposal, kept: torch.BoolTensor) -> None:
        """Only the backlog's cache entries stay: accepted draft tokens are fed again with the target's states."""
        root_only = torch.zeros_like(kept)
        root_only[:, 0] = kept[:, 0]
        super().commit(batch, proposal, root_only)

    def select_rows(self, keep: torch.LongTensor) -> None:
        super().select_rows(keep)
        self.inputs.select_rows(keep.to(self.inputs.target.device))

    def release(self) -> None:
        super().release()
        if self.tap is not None:
            self.tap.remove()
        self.tap, self.inputs = None, None
        self.draft_model.inputs = None


class HeadTreeProposer(HeadProposer, DraftTreeProposer):
    """EAGLE-2 dynamic trees from a head (`DraftTreeProposer`'s growth, best nodes first, one forward per depth):
    siblings share a position, so each frontier node is given the state its parent's forward computed (the root's:
    the output at the row's newest token) instead of the state at the position before it."""

    def __init__(self, *args, branching: int = 2, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if branching < 1:
            raise ValueError(f"`branching` must be >= 1; got {branching}.")
        self.branching = branching
        self._root_state: torch.Tensor | None = None  # [batch, hidden]
        self._node_states: torch.Tensor | None = None  # [batch, created, hidden] each fed candidate's output state

    def _grow_root(self, batch: TokenBatch, tail: tuple[torch.LongTensor, ...], reach: torch.LongTensor, lookahead: int):
        self._node_states = None
        growth = super()._grow_root(batch, tail, reach, lookahead)
        self._root_state = self.inputs.last[:, -1]  # the newest token's column (no guesses: lookahead is off)
        return growth

    def _expand(self, batch: TokenBatch, growth, frontier: torch.LongTensor, active: torch.BoolTensor, guess,
                context_length: int, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.arange(batch.batch_size, device=frontier.device).unsqueeze(1)  # [batch, 1]
        states = self._states(growth.candidates.count)  # [batch, created, hidden]
        parents = growth.candidates.parents[rows, frontier]  # [batch, width]
        given = states[rows, parents.clamp(min=0)]  # [batch, width, hidden]
        self.inputs.given = torch.where((parents >= 0).unsqueeze(-1), given, self._root_state.unsqueeze(1))
        try:
            scores, guess_logits = super()._expand(batch, growth, frontier, active, guess, context_length, depth)
        finally:
            self.inputs.given = None
        states[rows, frontier] = self.inputs.last[:, : frontier.shape[1]]
        return scores, guess_logits

    def _states(self, created: int) -> torch.Tensor:
        """`[batch, created, hidden]` the candidates' output states, grown to `created` candidates."""
        if self._node_states is None:
            self._node_states = self._root_state.new_zeros((self._root_state.shape[0], created, self._root_state.shape[1]))
        elif self._node_states.shape[1] < created:
            grown = created - self._node_states.shape[1]
            self._node_states = torch.nn.functional.pad(self._node_states, (0, 0, 0, grown))
        return self._node_states
