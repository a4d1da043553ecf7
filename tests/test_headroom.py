"""Greedy disagreements between a draft and its target: the fewest verifies any greedy chain method needs."""

from __future__ import annotations

import pytest
import torch
from conftest import perturbed, tiny_model

import hf_dynspec
from hf_dynspec import DynSpecConfig
from hf_dynspec.evaluation.headroom import greedy_disagreements

PROMPTS = [[5, 9, 13, 2, 7], [3, 3, 8, 41, 17, 60, 2], [11, 4]]


def brute_force(target, draft, prompt: list[int], new_tokens: int) -> tuple[int, int, int]:
    """Decode with the target one token at a time and ask the draft at every prefix."""
    tokens, disagreements, second_right = list(prompt), 0, 0
    with torch.no_grad():
        for position in range(new_tokens):
            ids = torch.tensor([tokens])
            token = int(target(ids).logits[0, -1].argmax())
            first, second = draft(ids).logits[0, -1].topk(2).indices.tolist()
            if 0 < position < new_tokens - 1 and first != token:  # positions a chain drafts
                disagreements += 1
                second_right += int(second == token)
            tokens.append(token)
    return new_tokens, disagreements, second_right


@pytest.mark.parametrize("scale", [0.0, 0.05, 0.3])
def test_disagreements_match_a_token_by_token_count(scale):
    target = tiny_model("llama", seed=0)
    target.generation_config.eos_token_id = None  # every prompt decodes its 12 tokens
    draft = perturbed(target, scale) if scale else target
    counts = greedy_disagreements(target, draft, PROMPTS, max_new_tokens=12, progress=False)
    found = [(c.new_tokens, c.disagreements, c.second_right) for c in counts]
    assert found == [brute_force(target, draft, p, 12) for p in PROMPTS]
    if scale == 0.0:
        assert all(c.disagreements == 0 and c.fewest_verifies == 1 for c in counts)
    if scale == 0.3:
        assert sum(c.disagreements for c in counts) > 0  # the test can tell a draft that disagrees


def test_no_chain_verifies_fewer_times_than_the_disagreements_allow():
    target = tiny_model("llama", seed=0)
    target.generation_config.eos_token_id = None
    draft = perturbed(target, 0.1)
    counts = greedy_disagreements(target, draft, PROMPTS, max_new_tokens=16, progress=False)
    for prompt, count in zip(PROMPTS, counts):
        ids = torch.tensor([prompt])
        out = target.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
            assistant_model=draft, custom_generate=hf_dynspec.speculative_loop, return_dict_in_generate=True,
            dynspec_config=DynSpecConfig(num_speculative_tokens=15, policy="static", draft_lookahead=0),
        )
        verifies = out.dynspec_stats.num_steps
        assert verifies >= count.fewest_verifies
        assert verifies == count.fewest_verifies  # drafting to the end, a chain verifies exactly at the disagreements


@pytest.mark.parametrize(("prompts", "new", "message"), [(PROMPTS, 0, "max_new_tokens"), ([[4, 5], []], 4, "one token")])
def test_bad_input_is_refused(prompts, new, message):
    target = tiny_model("llama", seed=0)
    with pytest.raises(ValueError, match=message):
        greedy_disagreements(target, target, prompts, max_new_tokens=new, progress=False)
