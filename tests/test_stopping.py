"""Stopping criteria are called as plain `generate` calls them: once per generated position, with the whole batch in
the caller's row order, even when rows accept several tokens in one step and run ahead of each other."""

from __future__ import annotations

import pytest
import torch
from conftest import EOS, left_padded_prompts, perturbed, tiny_model
from transformers import StoppingCriteria, StoppingCriteriaList

import hf_dynspec
from hf_dynspec import DynSpecConfig
from hf_dynspec.stopping import LockstepCriteria, answers_row_by_row


class CountingStop(StoppingCriteria):
    """Stateful and per row: stops row `i` once it has generated `token` `limits[i]` times, counting one new token per
    call (so it answers right only if it is called at every position with the whole batch). Records every call."""

    def __init__(self, token: int, limits: list[int]) -> None:
        self.token, self.limits = token, torch.tensor(limits)
        self.counts: torch.Tensor | None = None
        self.calls: list[torch.Tensor] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.calls.append(input_ids.clone())
        if self.counts is None:
            self.counts = torch.zeros(input_ids.shape[0], dtype=torch.long)
        self.counts += input_ids[:, -1] == self.token
        return self.counts >= self.limits


class AllRowsSawToken(StoppingCriteria):
    """lm-evaluation-harness's `MultiTokenEOSCriteria` in miniature: a done flag per row of the batch it was built
    for, set when that row's new tokens contain `token`; it reads `input_ids[i]` for every row and stops the whole
    batch when every flag is set."""

    def __init__(self, token: int, batch_size: int, prompt_width: int) -> None:
        self.token, self.prompt_width = token, prompt_width
        self.done = [False] * batch_size

    def __call__(self, input_ids, scores, **kwargs):
        for i, done in enumerate(self.done):
            if not done:
                self.done[i] = bool((input_ids[i, self.prompt_width :] == self.token).any())
        return False not in self.done


def _pair(seed: int):
    target = tiny_model("llama", seed=seed)
    return target, perturbed(target, scale=0.02, seed=seed + 7)


def _common_token(output: torch.Tensor, width: int) -> int:
    generated = output[:, width:].flatten()
    generated = generated[generated > EOS]
    return int(generated.mode().values)


CASES = [(seed, lengths) for seed, lengths in enumerate([[5, 9, 3], [7], [4, 4, 4, 4], [12, 2, 6, 8, 3], [3, 11]])]


def _case(seed: int, lengths: list[int]):
    """The pair, the prompts (`input_ids`, `attention_mask`) and a token plain greedy decoding generates often."""
    target, draft = _pair(seed)
    ids, mask = left_padded_prompts(lengths, seed=seed)
    plain = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=30)
    return target, draft, ids, mask, _common_token(plain, ids.shape[1])


@pytest.mark.parametrize(("seed", "lengths"), CASES)
def test_a_stateful_per_row_criterion_sees_plain_generate_s_calls(seed, lengths):
    target, draft, ids, mask, token = _case(seed, lengths)
    limits = [1 + (row + seed) % 3 for row in range(len(lengths))]
    expected_stop, our_stop = CountingStop(token, limits), CountingStop(token, limits)
    expected = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=30,
                               stopping_criteria=StoppingCriteriaList([expected_stop]))
    out = hf_dynspec.generate(
        target, input_ids=ids, attention_mask=mask, assistant_model=draft, do_sample=False, max_new_tokens=30,
        stopping_criteria=StoppingCriteriaList([our_stop]), return_dict_in_generate=True,
        dynspec_config=DynSpecConfig(policy="static", num_speculative_tokens=4),
    )
    assert torch.equal(out.sequences, expected)
    assert len(our_stop.calls) == len(expected_stop.calls)
    assert all(torch.equal(a, b) for a, b in zip(our_stop.calls, expected_stop.calls))
    assert max(out.dynspec_stats.steps[0].accepted) > 0  # rows did accept several tokens in a step


@pytest.mark.parametrize(("seed", "lengths"), CASES)
def test_a_whole_batch_criterion_with_per_row_state_matches_plain(seed, lengths):
    """Rows the criterion counts as done go on, as in plain `generate`, until every row is done."""
    target, draft, ids, mask, token = _case(seed, lengths)
    criteria = lambda: StoppingCriteriaList([AllRowsSawToken(token, len(lengths), ids.shape[1])])  # noqa: E731
    expected = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=30,
                               stopping_criteria=criteria())
    out = hf_dynspec.generate(target, input_ids=ids, attention_mask=mask, assistant_model=draft, do_sample=False,
                              max_new_tokens=30, stopping_criteria=criteria())
    assert torch.equal(out, expected)


def test_rows_that_left_the_batch_are_padding_for_later_calls():
    """A row that ends at EOS early leaves the loop's batch; later calls still see it, padded, at its place."""
    target, draft = _pair(3)
    ids, mask = left_padded_prompts([6, 4, 9], seed=3)
    plain = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=25)
    width = ids.shape[1]
    eos = int(plain[0, width + 2])  # row 0 ends after 3 tokens
    never = CountingStop(token=10_000, limits=[1, 1, 1])
    kwargs = dict(do_sample=False, max_new_tokens=25, eos_token_id=eos, stopping_criteria=StoppingCriteriaList([never]))
    expected = target.generate(input_ids=ids, attention_mask=mask, **kwargs)
    calls = never.calls
    never.calls, never.counts = [], None
    out = hf_dynspec.generate(target, input_ids=ids, attention_mask=mask, assistant_model=draft, **kwargs,
                              dynspec_config=DynSpecConfig(policy="static", num_speculative_tokens=4))
    assert torch.equal(out, expected)
    assert [c.shape for c in never.calls] == [c.shape for c in calls]
    assert all(torch.equal(a, b) for a, b in zip(never.calls, calls))
    assert bool((calls[-1][0, width + 3 :] == target.generation_config.pad_token_id).all())


def test_output_scores_are_cut_with_the_rows():
    target, draft = _pair(1)
    ids, mask = left_padded_prompts([5, 8], seed=1)
    plain = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=20)
    token = _common_token(plain, ids.shape[1])
    kwargs = dict(do_sample=False, max_new_tokens=20, output_scores=True, return_dict_in_generate=True)
    expected = target.generate(input_ids=ids, attention_mask=mask, **kwargs,
                               stopping_criteria=StoppingCriteriaList([CountingStop(token, [1, 2])]))
    out = hf_dynspec.generate(target, input_ids=ids, attention_mask=mask, assistant_model=draft, **kwargs,
                              stopping_criteria=StoppingCriteriaList([CountingStop(token, [1, 2])]),
                              dynspec_config=DynSpecConfig(policy="static", num_speculative_tokens=4))
    assert torch.equal(out.sequences, expected.sequences)
    assert len(out.scores) == len(expected.scores)
    real = 0
    for ours, theirs in zip(out.scores, expected.scores):  # [rows, vocab] each
        emitted = torch.isfinite(ours).sum(-1) > 1  # rows past their end have only the pad's score
        real += int(emitted.sum())
        assert torch.allclose(ours[emitted], theirs[emitted], atol=1e-6)
    generated = expected.sequences.shape[1] - ids.shape[1]
    cut = [generated - int((row[ids.shape[1] :] == 0).flip(0).cumprod(0).sum()) for row in expected.sequences]
    assert real == sum(cut) and min(cut) < generated  # the criterion cut a row short, and its scores with it


def test_lockstep_waits_for_the_slowest_running_row():
    """Unit level: positions are called only once every running row has them; a row that ended does not hold the
    calls back, and a stop cuts a row that ran ahead back to the stopped position."""
    ids = torch.tensor([[5, 6], [7, 8]])
    stop = CountingStop(token=9, limits=[1, 5])
    lockstep = LockstepCriteria([stop], ids, pad_id=0)
    scores = torch.zeros(2, 3, 12)
    lockstep.record(torch.tensor([0, 1]), torch.tensor([[3, 9, 4], [3, 0, 0]]), torch.tensor([3, 1]),
                    torch.tensor([False, False]), scores)
    assert lockstep.stops() == {} and len(stop.calls) == 1  # row 1 has one token: position 1 only
    assert lockstep.record(torch.tensor([1]), torch.tensor([[4, 4]]), torch.tensor([2]), torch.tensor([False]),
                           scores[:1, :2]) is None
    assert lockstep.stops() == {0: 2}  # row 0's token 9 at position 2 stops it; its third token is dropped
    assert torch.equal(stop.calls[1], torch.tensor([[5, 6, 3, 9], [7, 8, 3, 4]]))
    assert torch.equal(lockstep.tokens[0, :5], torch.tensor([5, 6, 3, 9, 0]))
    assert len(stop.calls) == 3  # position 3: row 1 alone generated it, row 0 is padding
    assert torch.equal(stop.calls[2], torch.tensor([[5, 6, 3, 9, 0], [7, 8, 3, 4, 4]]))


def test_which_criteria_are_asked_row_by_row():
    from transformers.generation.stopping_criteria import MaxLengthCriteria, MaxTimeCriteria

    from hf_dynspec.evaluation.runner import RowBudgets

    assert answers_row_by_row(MaxLengthCriteria(10))
    assert answers_row_by_row(RowBudgets(torch.ones(2, 3, dtype=torch.long), [1, 2]))
    assert not answers_row_by_row(MaxTimeCriteria(10.0))
    assert not answers_row_by_row(CountingStop(3, [1]))
