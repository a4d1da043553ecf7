"""`goodput`: choose the draft lengths that maximise the batch's expected tokens per second (after SmartSpec).

Four principles; every rule of the policy is one of them at work (`docs/policies.md`, "The goodput policy's
principles", maps each rule to its principle):

1. **Price the step, then choose.** Each step takes the length vector with the most expected tokens per second:
   each row's acceptance estimate per source (the draft model, a model-free continuation, a copy) against the cost
   model's price of the whole step (verify width, draft forwards, and the share of a draft catch-up not yet paid).
   Plain decoding is always a candidate (`search.best_draft_lengths`); a model-free offer costs verify width only;
   trees grow while the verify costs nearly nothing more; the marginal stop ends a draft where its next token stops
   paying.
2. **Book what each step did.** Acceptance is learned per row and source from what the verifier kept (decaying Beta
   posteriors, `estimators`); costs from each step's measured time (`cost_models`); the loss budget books every
   step as the plain-decoding work it did against the seconds it took, at measured costs, never optimistic ones.
3. **Never lose more than the budget.** A step that drafts runs only if the call stays within `loss_budget` of plain
   decoding even when it accepts nothing, or if speculation repays twice its extra cost at pessimistic acceptance;
   otherwise its drafts are shortened to what the budget allows (`hf_dynspec.budget.LossBudget`). A one-off cost
   (the draft's catch-up on a prompt) is priced before it is paid, at measured costs.
4. **Measure what is unknown.** An online cost model asks for the lengths it has not timed, when they could pay and
   the budget allows; the option the search prefers at optimistic acceptance is measured when its expected
   improvement over the tokens it informs (the rest of the call, and the estimate's memory past it) exceeds what it
   loses now (catch-up included), so a source whose estimate is low but uncertain (never measured, or measured long
   ago) is tried where it could still pay.
"""
from __future__ import annotations

import numpy as np
import torch

from ..budget import CatchupCost, LossBudget
from ..candidates.draft_model import MAX_INLINE_TAIL
from ..cost_models import (
    OnlineCostModel,
    PaddedCostModel,
    StepCostModel,
    draft_model_forwards,
    measured,
    verify_only,
)
from ..estimators import (
    AcceptanceEstimator,
    ConfidenceScale,
    expected_tokens,
)
from .base import DraftLengthPolicy, PolicyInput, PrefillFeedback, StepFeedback
from .goodput_settings import MARGINAL_STOP, GoodputSettings, build_cost_model, build_stopper
from .measuring import QUADRATURE, Option, expected_improvement, informed_tokens, node_acceptances, same_option
from .search import best_draft_lengths

MARGINAL_HORIZON = 8
"""The marginal stop weighs drafting up to this many more tokens, so a local step in the measured cost curve (a
knot timed fast by chance, a tile boundary of the matrix kernels) does not end drafts that pay over a few tokens."""


class GoodputPolicy(DraftLengthPolicy):
    """Per-step draft lengths that maximise expected tokens per second under a step cost model, within a loss budget.

    Each step: acceptance estimates per row (`AcceptanceEstimator`), caps `min(max, remaining - 1)`, then
    `best_draft_lengths`, with the draft's catch-up forward (when its backlog is too wide to ride in the first draft
    forward) added to the price of every vector that drafts. An online cost model may instead ask for one exploratory
    length (to measure a point it lacks). When the search at optimistic acceptance (`mean + probe_z * std`) prefers
    another option, the step measures it instead if its expected improvement over the tokens the measurement informs
    is worth more than it loses now (`_worth_measuring`), so no source stays unmeasured while it could be the better
    one.
    Whatever the choice, a step that drafts runs only when `LossBudget.allows` it (see `hf_dynspec.budget`).

    With a hybrid proposer (`PolicyInput.free_lengths`), three vectors compete: prompt lookup alone (no draft forward),
    the draft model for every row, and each row's better source; `free_rows` reports the winner's lookup rows. A
    model-free proposer that says what it offers (suffix trees: `free_lengths` without a `backlog`) is sized as
    lookup alone.

    `last_exploration` is the length the cost model asked to measure at the last step (`None`: the step was chosen
    by the search); `last_probe` is true when the step measures the option the optimistic search preferred;
    `last_blocked` is true when the loss budget shortened the step's drafts (to none, at worst).
    """

    name = "goodput"

    def __init__(
        self,
        settings: GoodputSettings | None = None,
        cost_model: StepCostModel | None = None,
        acceptance: AcceptanceEstimator | None = None,
    ) -> None:
        """
        Args:
            settings: policy options; defaults to `GoodputSettings()`.
            cost_model: overrides the cost model named in `settings` (any `StepCostModel`).
            acceptance: overrides the acceptance estimator built from `settings`.
        """
        self.settings = settings or GoodputSettings()
        s = self.settings
        self.cost_model = cost_model if cost_model is not None else build_cost_model(s)
        self.acceptance = acceptance or AcceptanceEstimator(s.prior_acceptance, s.prior_weight, s.acceptance_decay)
        self.lookup_acceptance = AcceptanceEstimator(s.lookup_prior_acceptance, s.prior_weight, s.acceptance_decay)
        self.copy_acceptance = AcceptanceEstimator(s.copy_prior_acceptance, s.prior_weight, s.acceptance_decay)
        self._copying = torch.zeros(0, dtype=torch.bool)  # [batch] the step's rows whose lookup continues a copy
        self.lookup_confidence = ConfidenceScale(s.prior_weight, s.acceptance_decay)
        self.copy_confidence = ConfidenceScale(s.prior_weight, s.acceptance_decay)
        self._confidence: torch.Tensor | None = None  # [batch] how sure the step's free proposals are, if they say
        self.stopper = build_stopper(s.early_stop)
        self.marginal = s.early_stop == MARGINAL_STOP
        # The marginal stop's state of the current step, indexed by original row id (`PolicyInput.row_ids`):
        self._step_rows = torch.zeros(0, dtype=torch.long)  # [batch] the step's rows
        self._drafting = torch.zeros(0, dtype=torch.bool)  # [rows] still drafting
        self._path = torch.zeros(0, dtype=torch.float64)  # [rows] chance that every draft token so far is accepted
        self._expected = torch.zeros(0, dtype=torch.float64)  # [rows] expected emitted tokens of the step so far
        self._told = torch.zeros(0, dtype=torch.bool)  # [rows] `draft_lengths` set the row's state for this step
        self._requested = torch.zeros(0, dtype=torch.long)  # [rows] the step's requested draft lengths
        self.budget = LossBudget(s.loss_budget)
        self.catchup = CatchupCost(s.window)
        self.last_probe = False
        self.last_exploration: int | None = None
        self.last_blocked = False
        self.draft_ratio: float | None = None  # draft/target parameter ratio, from the prefill
        self._free: torch.BoolTensor | None = None

    def reset(self, num_rows: int) -> None:
        self.acceptance.reset(num_rows)
        self.lookup_acceptance.reset(num_rows)
        self.copy_acceptance.reset(num_rows)
        if self.stopper is not None:
            self.stopper.reset(num_rows)
        # The loss budget and the pooled acceptance estimates span every call the policy serves.

    def forget_rows(self, row_ids: torch.LongTensor) -> None:
        for estimator in (self.acceptance, self.lookup_acceptance, self.copy_acceptance):
            estimator.forget(row_ids)

    def observe_prefill(self, feedback: PrefillFeedback) -> None:
        self.draft_ratio = feedback.draft_cost_ratio
        if isinstance(self.cost_model, PaddedCostModel):
            self.cost_model.set_rows_apart(feedback.draft_rows_apart)
            self.cost_model.set_packed(feedback.packed_verify)
        self.cost_model.observe_prefill(feedback.tokens, feedback.seconds)
        if isinstance(self.cost_model, OnlineCostModel):
            self.cost_model.draft_ratio = feedback.draft_cost_ratio
        self.budget.start(feedback.seconds)
        self.catchup.observe_prefill(feedback.seconds, feedback.tokens, feedback.draft_cost_ratio)

    def draft_lengths(self, request: PolicyInput) -> torch.LongTensor:
        lengths = self._choose(request)
        self._start_drafts(request.row_ids.cpu().long(), lengths)  # the marginal stop follows the rows that draft
        return lengths

    def _start_drafts(self, row_ids: torch.LongTensor, lengths: torch.LongTensor) -> None:
        rows = int(row_ids.max()) + 1 if row_ids.numel() else 0
        self._step_rows = row_ids
        self._drafting = torch.zeros(rows, dtype=torch.bool)
        self._drafting[row_ids] = lengths.cpu() > 0
        self._path = torch.ones(rows, dtype=torch.float64)
        self._expected = torch.ones(rows, dtype=torch.float64)
        self._told = torch.zeros(rows, dtype=torch.bool)
        self._told[row_ids] = True
        self._requested = torch.zeros(rows, dtype=torch.long)
        self._requested[row_ids] = lengths.cpu().long()

    def _choose(self, request: PolicyInput) -> torch.LongTensor:
        batch, max_k = request.batch_size, request.max_draft_tokens
        caps = (request.remaining_tokens.cpu() - 1).clamp(min=0, max=max_k)  # [batch]
        self.last_exploration, self.last_blocked, self._free, self.last_probe = None, False, None, False
        self._copying = self._copies(request)
        self._confidence = request.free_confidence.cpu().double() if request.free_confidence is not None else None
        if batch == 0 or max_k == 0:
            return torch.zeros(batch, dtype=torch.long)
        catchup = self._catchup_seconds(request)
        self.last_exploration = self.cost_model.exploration_length(batch, max_k)
        if self.last_exploration and (
            int(caps.max()) < self.last_exploration or catchup > 0 or not self._could_pay(request, caps)
        ):
            # no row can draft that far (the call is ending), the draft would first have to catch up on a backlog
            # (its prompt): a measurement does not pay for that, drafting does, so the search decides; or no cost
            # could make these rows worth drafting
            self.last_exploration = None
        if self.last_exploration is not None:
            wanted = caps.clamp(max=self.last_exploration)
            lengths = self._within_budget(request, wanted, catchup)
            if torch.equal(lengths, wanted) or self.last_exploration == 0:
                return lengths
            # The budget cannot pay for this measurement. A shorter draft would measure another point (and pay the
            # catch-up again at the next attempt): decide as if the measurement were made.
            self.last_exploration, self.last_blocked = None, False
        lengths, self._free = self._search(request, caps, catchup, optimistic=False)
        probe = self._worth_measuring(request, caps, catchup, (lengths, self._free))
        if probe is not None:
            (lengths, self._free), self.last_probe = probe, True
        if self.marginal and request.free_lengths is None and bool((lengths > 0).any()):
            lengths = caps.clone()  # the marginal stop decides where each row's draft ends
        lengths = self._within_budget(request, lengths, catchup)
        if not bool((lengths > 0).any()):
            self._free, self.last_probe = None, False  # a probe the budget stopped is no probe: the next step decides
        return lengths

    def _could_pay(self, request: PolicyInput, caps: torch.LongTensor) -> bool:
        """Whether drafting could beat plain steps at optimistic acceptance if verifying cost no more than a plain
        step (only the draft forwards, or none for lookup rows, on top)."""
        rows, z = request.row_ids, self.settings.probe_z
        acceptance = self.acceptance.upper(rows, z)
        if request.free_lengths is not None:
            acceptance = torch.maximum(acceptance, self._lookup_estimate(rows, z))
        plain = self._plain_seconds(request.batch_size)
        model = self.cost_model if isinstance(self.cost_model, PaddedCostModel) else None
        per_forward = model.draft_forward(model.draft_rows(request.batch_size)) if model is not None else 0.0
        if request.free_lengths is not None:
            per_forward = 0.0
        gains = expected_tokens(acceptance, caps) / (plain + caps.double() * per_forward)  # [batch] per-row rates
        return bool((gains > 1.0 / plain).any())

    def _within_budget(self, request: PolicyInput, lengths: torch.LongTensor, catchup: float) -> torch.LongTensor:
        """`lengths`, shortened where the loss budget requires it (`last_blocked` says whether it did)."""
        if not bool((lengths > 0).any()):
            return lengths
        affordable = self._affordable_lengths(request, lengths, catchup)
        self.last_blocked = self.last_blocked or not torch.equal(affordable, lengths)
        return affordable

    def free_rows(self, request: PolicyInput) -> torch.BoolTensor | None:
        return self._free

    def observe(self, feedback: StepFeedback) -> None:
        free = feedback.free_rows.cpu() if feedback.free_rows is not None else None
        by_draft = ~free if free is not None else torch.ones(feedback.batch_size, dtype=torch.bool)
        rows, proposed, accepted = feedback.row_ids.cpu(), feedback.draft_lengths.cpu(), feedback.accepted.cpu()
        self.acceptance.update(rows[by_draft], proposed[by_draft], accepted[by_draft])
        if free is not None:
            copies = free & self._copying if self._copying.shape == free.shape else torch.zeros_like(free)
            self.copy_acceptance.update(rows[copies], proposed[copies], accepted[copies])
            lookups = free & ~copies
            self.lookup_acceptance.update(rows[lookups], proposed[lookups], accepted[lookups])
            if self._confidence is not None and self._confidence.shape == free.shape:
                tried = torch.where(proposed > 0, accepted + (accepted < proposed).long(), 0)  # [batch] tokens verified
                self.copy_confidence.update(self._confidence[copies], tried[copies])
                self.lookup_confidence.update(self._confidence[lookups], tried[lookups])
        self.cost_model.observe(feedback)
        self.catchup.observe(feedback.catchup_seconds, feedback.catchup_tokens)
        if self.stopper is not None:
            self.stopper.observe(feedback)
        if feedback.batch_size:
            done, spent = self._booked(feedback, proposed, accepted, free)
            self.budget.record(done, spent)

    def _booked(
        self, feedback: StepFeedback, proposed: torch.LongTensor, accepted: torch.LongTensor, free: torch.Tensor | None
    ) -> tuple[float, float]:
        """A step as the loss budget books it, both sides at the booking model's costs: the plain-decoding work it did
        (the same forward without draft tokens, and a plain step for each accepted token per row) and the seconds it
        cost. A step that drafts nothing costs exactly its work, whatever rides along (under continuous batching,
        other requests' prompt chunks): only speculation moves the balance."""
        batch, booked = feedback.batch_size, self._booking_model()
        catchup = self.catchup.seconds(feedback.catchup_tokens) if feedback.catchup_seconds > 0 else 0.0
        spent = self._price(batch, proposed, free, catchup, feedback.target_tokens, booked)
        if not bool((proposed > 0).any()):
            return spent, spent
        zeros = torch.zeros(batch, dtype=torch.long)
        plain = self._price(batch, zeros, None, 0.0, model=booked)
        without = self._price(batch, zeros, None, 0.0, feedback.plain_tokens, booked)
        return without + plain * float(accepted.double().mean()), spent

    def node_budgets(self, request: PolicyInput, lengths: torch.LongTensor) -> torch.LongTensor:
        """Tree nodes for the rows that draft: the most whose verify forward costs at most `1 + tree_slack` times a
        chain of the longest chosen depth, by the cost model (a chain's worth without a verify cost yet). Under load
        the target's cost rises with every token, so trees shrink to chains of that many nodes."""
        depth = int(lengths.max()) if lengths.numel() else 0
        budget = depth
        verify = self.cost_model.verify if isinstance(self.cost_model, PaddedCostModel) else None
        if depth and verify is not None and request.max_tree_nodes > depth:
            nodes = np.arange(depth, request.max_tree_nodes + 1)
            costs = verify(request.batch_size * (1.0 + nodes))  # [candidates]
            limit = (1.0 + self.settings.tree_slack) * costs[0]
            budget = int(nodes[costs <= limit].max())
        return torch.where(lengths > 0, budget, 0)

    @property
    def stops_early(self) -> bool:
        return self.stopper is not None

    def continue_drafting(
        self, row_ids: torch.LongTensor, position: int | torch.LongTensor, draft_probs: torch.Tensor
    ) -> torch.BoolTensor | None:
        """With `early_stop='marginal'`: row `i` drafts one more token when, for some `w` up to `MARGINAL_HORIZON`
        (and the row's requested length), drafting `w` more tokens adds expected tokens per extra second that beat
        the step's expected tokens per second so far,

            P_i * (a_i + a_i^2 + ... + a_i^w) / (C(j + w) - C(j))  >=  sum_r E_r / C(j),

        where `P_i` is the chance that all draft tokens of row `i` so far are accepted (the product of their
        calibrated acceptances given the draft's probabilities, `ConfidenceStopper.acceptance_given`), `a_i` the
        row's acceptance estimate for the next token, `E_r = 1 + sum of the P_r` along the way for every row of the
        step, `j` the longest draft so far among the judged rows and `C(j)` the price of a step with `j` draft
        tokens per row. Greedy stopping on the ratio: when verifying is nearly free (an offloaded target) drafts run
        long wherever the draft is sure; when every verified token costs, they stop early. Rows are judged token by
        token, each at its own position (with draft lookahead one forward may yield several tokens of a row).
        Otherwise the confidence threshold stop, or none."""
        if self.stopper is None:
            return None
        if not self.marginal:
            return self.stopper.continue_drafting(row_ids, position, draft_probs)
        rows = row_ids.cpu().long()
        positions = torch.as_tensor(position).to("cpu", torch.long).expand(rows.shape[0])
        probs = self.stopper.record(rows, positions, draft_probs)  # [n]
        self._cover(rows, positions)
        drafting = self._drafting[rows]
        path = torch.where(drafting, self._path[rows] * self.stopper.acceptance_given(probs), self._path[rows])
        self._path[rows] = path
        self._expected[rows] = torch.where(drafting, self._expected[rows] + path, self._expected[rows])
        batch, drafted = int(self._step_rows.numel()), int(positions.max()) + 1
        horizons = (self._requested[rows] - positions - 1).clamp(min=1, max=MARGINAL_HORIZON)  # [n]
        now, extra = self._extra_seconds(batch, drafted, int(horizons.max()))  # extra: [horizon]
        acceptance = self.acceptance.mean(rows).double()  # [n]
        further = torch.arange(1, extra.shape[0] + 1, dtype=torch.float64)  # [horizon] tokens drafted on
        gains = path.unsqueeze(1) * (acceptance.unsqueeze(1) ** further).cumsum(1)  # [n, horizon] expected tokens
        pays = gains * now >= extra.unsqueeze(0) * float(self._expected[self._step_rows].sum())  # [n, horizon]
        keep = drafting & (pays & (further <= horizons.unsqueeze(1))).any(dim=1)
        self._drafting[rows] = keep
        return keep

    def _extra_seconds(self, batch: int, drafted: int, horizon: int) -> tuple[float, torch.Tensor]:
        """Price `C(j)` of a step whose rows draft `j = drafted` tokens, and `[horizon]` the extra seconds
        `C(j + w) - C(j)` of drafting `w = 1..horizon` more."""
        now = self._chain_seconds(batch, drafted)
        later = [self._chain_seconds(batch, drafted + w) for w in range(1, horizon + 1)]
        return now, (torch.tensor(later, dtype=torch.float64) - now).clamp(min=1e-9)

    def _cover(self, rows: torch.LongTensor, positions: torch.LongTensor) -> None:
        """Make room for rows the step's `draft_lengths` did not cover (`continue_drafting` called on its own), and
        start such a row's draft afresh at its first token: drafting, with an empty path."""
        needed = int(rows.max()) + 1 if rows.numel() else 0
        if needed > self._drafting.shape[0]:
            grow = needed - self._drafting.shape[0]
            self._drafting = torch.cat([self._drafting, torch.ones(grow, dtype=torch.bool)])
            self._path = torch.cat([self._path, torch.ones(grow, dtype=torch.float64)])
            self._expected = torch.cat([self._expected, torch.ones(grow, dtype=torch.float64)])
            self._told = torch.cat([self._told, torch.zeros(grow, dtype=torch.bool)])
            self._requested = torch.cat([self._requested, torch.zeros(grow, dtype=torch.long)])
        first = rows[positions == 0]
        untold = first[~self._told[first]]
        self._drafting[untold], self._path[untold], self._expected[untold] = True, 1.0, 1.0
        self._step_rows = torch.cat([self._step_rows, untold]).unique()
        self._told[first] = False  # a later token at position 0 starts a new draft

    # ---- pricing -----------------------------------------------------------------------------------------------
    def _plain_seconds(self, batch: int) -> float:
        return float(self.cost_model.step_seconds(batch, torch.zeros(batch, dtype=torch.long)))

    def _chain_seconds(self, batch: int, drafted: int) -> float:
        """Price of a step in which every row drafts `drafted` tokens (no catch-up: it is paid before drafting)."""
        return self._price(batch, torch.full((batch,), drafted, dtype=torch.long), None, 0.0)

    def _catchup_seconds(self, request: PolicyInput) -> float:
        """Predicted seconds of the draft's catch-up forward if it drafts this step (0 when the backlog rides inline).

        At least the draft's forward cost scaled by the target's cost curve (`_draft_forward_seconds`): a rate per
        token learned from the draft's prompt prefill undersells a narrow catch-up wherever a forward over a few
        tokens costs far more than over one (float32 on a CPU without AMX: about 2.2x from the second token on).
        """
        if request.backlog is None or request.batch_size == 0:
            return 0.0
        width = int(request.backlog.max())
        if width <= MAX_INLINE_TAIL:
            return 0.0
        tokens = request.batch_size * (width - 1)
        return max(self.catchup.seconds(tokens), self._draft_forward_seconds(request.batch_size, tokens))

    def _draft_forward_seconds(self, batch: int, tokens: int) -> float:
        """A draft forward over `tokens` tokens at `batch` rows: its one-token forward times the target's cost of
        `tokens` tokens over its cost of `batch` (0 while either is unknown); a draft that runs rows apart runs
        `batch` such forwards of one row each over their share of `tokens`. Past the verify curve's last knot the
        target's cost follows the line to the call's prefill (`PiecewiseLinear.far`): carried along the
        last segment to a prompt-wide catch-up, two knots a few tokens apart (one timed slow) can price that
        catch-up several times too high, and then the catch-up's share keeps a whole call from drafting."""
        model = self.cost_model
        if not isinstance(model, PaddedCostModel) or model.draft is None or model.verify is None:
            return 0.0
        rows = model.draft_rows(batch)
        forwards = batch // rows
        one, wide = model.verify(np.array([float(rows), float(tokens) / forwards]))
        return forwards * model.draft_forward(rows) * float(wide) / max(float(one), 1e-12)

    def _price(
        self,
        batch: int,
        lengths: torch.LongTensor,
        free: torch.BoolTensor | None,
        catchup: float,
        target_tokens: int | None = None,
        model: StepCostModel | None = None,
        as_searched: bool = False,
    ) -> float:
        """Seconds of a step with `lengths` (`[batch]`), `free` rows served by prompt lookup, catch-up included.

        `target_tokens` (the verify forward's tokens; token trees verify more than `batch * (1 + max(lengths))`)
        overrides the chain's count; `model` overrides the policy's cost model.

        Before the cost model has timed a draft forward, one is priced at the draft/target parameter ratio times a plain
        step (so a first exploration is not mistaken for free); `as_searched`, at nothing as searched, if timed online.
        """
        model = self.cost_model if model is None else model
        if not isinstance(model, PaddedCostModel):
            forwards = draft_model_forwards(lengths, free)
            return float(model.step_seconds(batch, lengths)) + (catchup if forwards else 0.0)
        forwards = draft_model_forwards(lengths, free, model.rows_apart)
        longest = float(lengths.max()) if lengths.numel() else 0.0
        tokens = batch * (1.0 + longest) if target_tokens is None else float(target_tokens)
        seconds = float(model.verify(np.array([tokens]))[0]) if model.verify is not None else 1.0
        rows = model.draft_rows(batch)
        if model.draft is not None or as_searched and isinstance(self.cost_model, OnlineCostModel):
            per_forward = model.draft_forward(rows)
        else:
            per_forward = (self.draft_ratio or 0.0) * self._plain_seconds(rows)
        return seconds + forwards * per_forward + (catchup if forwards else 0.0)

    def _affordable_lengths(self, request: PolicyInput, lengths: torch.LongTensor, catchup: float) -> torch.LongTensor:
        """`lengths` as they are when the loss budget can pay for them even if they accept nothing; otherwise, when
        speculation repays the step's extra cost twice over even at pessimistic acceptance, capped at the longest
        draft that pays at that acceptance (kept whole under the marginal stop, which ends drafts itself where their
        next token stops paying); otherwise capped at the longest draft the budget allows."""
        batch = request.batch_size
        plain = self._plain_seconds(batch)
        future = plain * float(request.remaining_tokens.max())
        booked = self._booking_model()

        def extra(candidate: torch.LongTensor) -> float:  # seconds over a plain step, at measured costs
            return self._price(batch, candidate, self._free, catchup, model=booked) - plain

        whole = extra(lengths)
        if whole <= 0 or self.budget.allows(-whole, future):
            return lengths
        savings, longest = self._pessimistic_savings(request, future)
        invested = lengths.clamp(max=longest)  # no longer than speculation pays at pessimistic acceptance
        if self.marginal and longest > 0 and savings >= 2.0 * extra(invested):
            # The marginal stop ends each draft where its next token stops paying by the draft's own confidence, so
            # tokens past the pessimistic length are drafted only while each one is expected to pay for itself.
            return lengths
        if self._free is not None:
            invested = torch.where(self._free, lengths, invested)  # lookup rows cost verify width only
        if longest > 0 and savings >= 2.0 * extra(invested):
            return invested
        for longest in range(int(lengths.max()) - 1, 0, -1):  # the whole length was refused above
            capped = lengths.clamp(max=longest)
            if self.budget.allows(-extra(capped), future):
                return capped
        return torch.zeros_like(lengths)

    def _booking_model(self) -> StepCostModel | None:
        """The costs the loss budget books steps at: an online model's measurements without its optimism."""
        return self.cost_model.evidence if isinstance(self.cost_model, OnlineCostModel) else None

    def _pessimistic_savings(self, request: PolicyInput, future: float) -> tuple[float, int]:
        """Seconds speculation saves over the `future` plain seconds of the call, at the lower confidence bound of
        every row's acceptance (draft model only, no catch-up: the catch-up is the cost it is weighed against), and
        the longest draft of that pessimistic choice."""
        z, batch = self.settings.confidence_z, request.batch_size
        if self.acceptance.pooled_successes + self.acceptance.pooled_failures == 0:
            return 0.0, 0  # nothing observed yet: the budget alone decides
        acceptance = self.acceptance.lower(request.row_ids, z)
        caps = (request.remaining_tokens.cpu() - 1).clamp(min=0, max=request.max_draft_tokens)
        booked = self._booking_model()
        lengths = best_draft_lengths(acceptance, caps, request.max_draft_tokens, booked or self.cost_model)
        if not bool((lengths > 0).any()) or not measured(self.cost_model, batch, int(lengths.max())):
            return 0.0, 0
        plain_rate = batch / self._plain_seconds(batch)
        rate = float(expected_tokens(acceptance, lengths).sum()) / self._price(batch, lengths, None, 0.0, model=booked)
        return max(0.0, future * (1.0 - plain_rate / rate)), int(lengths.max())

    # ---- the search ------------------------------------------------------------------------------------------------
    def _search(
        self, request: PolicyInput, caps: torch.LongTensor, catchup: float, optimistic: bool
    ) -> tuple[torch.LongTensor, torch.BoolTensor | None]:
        """The best length vector (and its lookup rows) over the sources the proposer offers."""
        z, rows, max_k = self.settings.probe_z, request.row_ids, request.max_draft_tokens
        by_draft = self.acceptance.upper(rows, z) if optimistic else self.acceptance.mean(rows)
        costs = self.cost_model.optimistic() if optimistic and isinstance(self.cost_model, OnlineCostModel) else None
        # The catch-up is paid once and serves every later step: each candidate carries the share of it that its
        # expected tokens are of the tokens the call has left. A step that emits a tenth of them pays a tenth: over
        # the rest of the call, drafting this way then pays exactly the catch-up (a short draft is not charged for
        # the fewer, longer steps of a long one). Whether it may be paid at all is the loss budget's question.
        share = catchup / max(1.0, float(request.remaining_tokens.sum()))
        model = costs or (self._catchup_model() if catchup > 0 else self.cost_model)
        if request.free_lengths is None:
            return best_draft_lengths(by_draft, caps, max_k, model, self.settings.min_gain, share), None
        by_lookup = self._lookup_estimate(rows, z if optimistic else None)
        # Lookup tokens cost no draft forward, so they are not held to the draft model's cap: only to what the
        # lookup offers (at most `prompt_lookup_max_tokens`) and to the row's remaining tokens.
        room = (request.remaining_tokens.cpu() - 1).clamp(min=0)
        lookup_caps = torch.minimum(room, request.free_lengths.cpu())  # [batch]
        if request.backlog is None:  # a model-free proposer (suffix trees): what it offers is the only source
            longest = int(lookup_caps.max()) if lookup_caps.numel() else 0
            alone = best_draft_lengths(by_lookup, lookup_caps, longest, verify_only(model), self.settings.min_gain)
            return alone, alone > 0
        lengths = best_draft_lengths(by_draft, caps, max_k, model, self.settings.min_gain, share)
        if self.settings.copy_anchor and request.draft_tries_free:
            # Only copies are worth a verify of their own: the draft's lookahead already feeds every other row's
            # continuation along its forward, and keeps what the draft agrees with.
            lookup_caps = torch.where(self._copying, lookup_caps, 0)
        longest = max(max_k, int(lookup_caps.max()) if lookup_caps.numel() else 0)
        lookup_only = best_draft_lengths(by_lookup, lookup_caps, longest, verify_only(self.cost_model))
        better = (lookup_caps > 0) & (expected_tokens(by_lookup, lookup_caps) >= expected_tokens(by_draft, caps))
        mixed = best_draft_lengths(
            torch.where(better, by_lookup, by_draft), torch.where(better, lookup_caps, caps), longest, model, 0.0, share
        )
        options = [(lengths, torch.zeros_like(better)), (lookup_only, lookup_only > 0), (mixed, better & (mixed > 0))]
        return max(
            options, key=lambda option: self._rate(request.batch_size, option, by_draft, by_lookup, share, model)
        )

    def _worth_measuring(
        self, request: PolicyInput, caps: torch.LongTensor, catchup: float, chosen: Option
    ) -> Option | None:
        """The option the search prefers at optimistic acceptance, when measuring it now is expected to repay its
        cost (catch-up included) over the tokens the measurement informs (`hf_dynspec.policies.measuring`)."""
        probe = self._search(request, caps, catchup, optimistic=True)
        if same_option(probe, chosen) or not bool((probe[0] > 0).any()):
            return None
        batch, rows = request.batch_size, request.row_ids
        model = self._catchup_model() if catchup > 0 else self.cost_model

        def seconds(option: Option, due: float) -> float:  # `due`: the catch-up a step running the draft pays
            return self._price(batch, option[0], option[1], due, model=model, as_searched=True)

        nodes = len(QUADRATURE)
        by_draft = node_acceptances(lambda z: self.acceptance.shifted(rows, z))  # [nodes, batch]
        by_free = None if request.free_lengths is None else node_acceptances(
            lambda z: self._lookup_estimate(rows, z, pooled=True))  # [nodes, batch]

        def tokens(option: Option) -> torch.Tensor:  # [nodes, nodes] expected, draft nodes by model-free nodes
            lengths, free = option
            acceptance = by_draft.unsqueeze(1).expand(nodes, nodes, batch)
            if free is not None and by_free is not None:
                acceptance = torch.where(free, by_free.unsqueeze(0), acceptance)
            flat = expected_tokens(acceptance.reshape(-1), lengths.repeat(nodes * nodes))
            return flat.reshape(nodes, nodes, batch).sum(dim=2)

        kept, measured = tokens(chosen), tokens(probe)
        middle = nodes // 2  # the node at the mean
        emitted, expected = float(measured[middle, middle]), float(kept[middle, middle])
        steady = seconds(chosen, 0.0), seconds(probe, 0.0)
        cost = seconds(probe, catchup) - seconds(chosen, catchup) - (emitted - expected) * steady[0] / expected
        gain = expected_improvement(steady, kept, measured)
        informed = informed_tokens(float(request.remaining_tokens.sum()), emitted, self.settings.acceptance_decay)
        return probe if informed * gain > cost else None

    def _catchup_model(self) -> StepCostModel:
        """The costs a step that first pays the draft's catch-up is decided at: the measured ones (the booking
        model) once the draft has been timed, else the policy's.

        An online model prices knots measured once, or long ago, at what the fresh knots predict, so that a length
        timed slow by chance is tried again: optimism that pays for itself by measuring. A catch-up measures
        nothing, and it is the largest single price the policy weighs (at a call's start, the draft's prefill of
        every prompt: the target's prefill times the draft's cost ratio). Decided on optimism, a batch size where
        drafting does not pay would buy that catch-up again at every call whose knots had gone stale since the last
        one (an RL rollout starts every call at its full batch): it would lose the catch-up and the steps that
        measure the loss, and the loss budget it spent would be missing where drafting pays (the rollout's tail).
        Probes stay optimistic: they are the policy's measured way of trying a length again."""
        booked = self._booking_model()
        if not isinstance(booked, PaddedCostModel) or booked.draft is None or booked.verify is None:
            return self.cost_model
        return booked

    def _copies(self, request: PolicyInput) -> torch.BoolTensor:
        """`[batch]` rows whose lookup continuation is a copy: anchored by at least `copy_anchor` tokens."""
        anchors, least = request.free_anchors, self.settings.copy_anchor
        if anchors is None or least == 0:
            return torch.zeros(request.batch_size, dtype=torch.bool)
        return anchors.cpu() >= least

    def _lookup_estimate(self, rows: torch.LongTensor, z: float | None, pooled: bool = False) -> torch.Tensor:
        """`[batch]` acceptance of each row's lookup continuation: the copy estimate for rows that copy, the lookup
        estimate for the others; posterior means, or `z` standard deviations above them (of each row's posterior, or
        with `pooled` of the source's: `AcceptanceEstimator.shifted`)."""
        def estimate(estimator: AcceptanceEstimator) -> torch.Tensor:
            if z is None:
                return estimator.mean(rows)
            return estimator.shifted(rows, z) if pooled else estimator.upper(rows, z)

        copying = self._copying if self._copying.shape == rows.shape else torch.zeros(rows.shape, dtype=torch.bool)
        by_copy, by_lookup = estimate(self.copy_acceptance), estimate(self.lookup_acceptance)
        sure = self._confidence
        if sure is not None and sure.shape == rows.shape:  # proposals that say how sure they are
            by_copy = self.copy_confidence.scale(by_copy, sure)
            by_lookup = self.lookup_confidence.scale(by_lookup, sure)
        return torch.where(copying, by_copy, by_lookup)

    def _rate(
        self,
        batch: int,
        option: tuple[torch.LongTensor, torch.BoolTensor],
        by_draft: torch.Tensor,
        by_lookup: torch.Tensor,
        share: float,
        model: StepCostModel,
    ) -> float:
        """Expected tokens per second of `option` (lengths, lookup rows) at `model`'s costs as the search priced them
        (an untimed draft too: priced otherwise, its length could lose where a shorter one, never an option, pays)."""
        lengths, free = option
        tokens = float(expected_tokens(torch.where(free, by_lookup, by_draft), lengths).sum())
        extra = share * tokens if draft_model_forwards(lengths, free) else 0.0
        return tokens / (self._price(batch, lengths, free, 0.0, model=model, as_searched=True) + extra)
