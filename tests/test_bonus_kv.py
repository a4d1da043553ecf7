"""Bonus-token KV: when a row accepts every draft token, the draft catches up inside its next forward."""

from __future__ import annotations

import pytest
import torch
from conftest import left_padded_prompts, tiny_model

import hf_dynspec
from hf_dynspec import DynSpecConfig


@pytest.mark.parametrize("k", [1, 2, 4])
def test_forward_schedule_when_everything_is_accepted(k):
    target = tiny_model("llama", seed=0)
    draft = tiny_model("llama", seed=0)  # identical weights: every draft token is accepted
    widths = []
    hook = draft.register_forward_pre_hook(lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]),
                                           with_kwargs=True)
    ids, mask = left_padded_prompts([4, 7], seed=1)
    steps = 5
    new_tokens = 1 + steps * (k + 1)  # the prefill's token, then k accepted + 1 bonus per step
    expected = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens)
    out = target.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens, assistant_model=draft,
        custom_generate=hf_dynspec.speculative_loop, return_dict_in_generate=True,
        dynspec_config=DynSpecConfig(policy="static", num_speculative_tokens=k, draft_lookahead=0, proposer="draft"),
    )
    hook.remove()
    assert torch.equal(out.sequences, expected)
    stats = out.dynspec_stats
    assert stats.num_steps == steps and stats.target_forwards == steps + 1
    # One catch-up forward over the prompt (the draft's prefill), then exactly k forwards per step: the bonus token's
    # KV never costs an extra pass.
    assert stats.draft_forwards == 1 + steps * k
    assert widths[0] == ids.shape[1]
    first_of_step = widths[1::k]
    assert first_of_step == [1] + [2] * (steps - 1)  # later steps open with the last draft token and the bonus
    assert all(width == 1 for i, width in enumerate(widths[1:]) if i % k)
    assert stats.steps[0].catchup_seconds > 0 and all(step.catchup_seconds == 0 for step in stats.steps[1:])


def test_draft_catches_up_after_steps_without_speculation():
    target = tiny_model("llama", seed=0)
    draft = tiny_model("llama", seed=0)
    widths = []
    hook = draft.register_forward_pre_hook(lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]),
                                           with_kwargs=True)

    class Alternate(hf_dynspec.DraftLengthPolicy):
        def draft_lengths(self, request):
            k = 2 if request.step % 4 == 3 else 0  # speculate every fourth step only
            return torch.full((request.batch_size,), k)

    ids, mask = left_padded_prompts([5], seed=3)
    expected = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=20)
    out = hf_dynspec.generate(target, input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=20,
                              assistant_model=draft, dynspec_policy=Alternate(), return_dict_in_generate=True,
                              dynspec_config=DynSpecConfig(policy="static", draft_lookahead=0))
    hook.remove()
    assert torch.equal(out.sequences, expected)
    # Step 3 is the first to draft: the prompt and the tokens of the prefill and three plain steps are caught up in one
    # forward (all but the newest token), then drafting starts from the newest token.
    assert widths[:2] == [ids.shape[1] + 3, 1]
    assert out.dynspec_stats.draft_forwards == len(widths)
    catchups = [step.catchup_seconds > 0 for step in out.dynspec_stats.steps]
    assert catchups[3] and sum(catchups) == len(range(3, out.dynspec_stats.num_steps, 4))
