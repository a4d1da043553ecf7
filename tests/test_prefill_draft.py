"""Draft tokens verified in the prefill's own forward (`DynSpecConfig.prefill_draft_confidence`): output unchanged."""

from __future__ import annotations

import pytest
import torch
from conftest import left_padded_prompts, perturbed, tiny_model

import hf_dynspec
from hf_dynspec import DynSpecConfig
from hf_dynspec.candidates.tree import TokenTree, prefix_visibility


def run(target, draft, ids, mask, config: DynSpecConfig, **kwargs):
    return target.generate(
        input_ids=ids, attention_mask=mask, assistant_model=draft, custom_generate=hf_dynspec.speculative_loop,
        dynspec_config=config, return_dict_in_generate=True, **kwargs,
    )


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request):
    target = tiny_model(request.param, seed=0)
    return target, perturbed(target, scale=0.05)


@pytest.mark.parametrize("batch_size", [1, 3, 6])
@pytest.mark.parametrize(
    "options",
    [
        {"policy": "static", "num_speculative_tokens": 4},
        {"policy": "goodput", "num_speculative_tokens": 6},
        {"policy": "static", "num_speculative_tokens": 3, "tree_node_budget": 8},
        {"policy": "goodput", "num_speculative_tokens": 4, "proposer": "hybrid", "prompt_lookup_max_tokens": 5},
    ],
    ids=["chain", "goodput", "tree", "hybrid"],
)
@pytest.mark.parametrize("confidence", [0.0, 0.4])
def test_prefill_draft_matches_plain_greedy(pair, batch_size, options, confidence):
    target, draft = pair
    lengths = [2 + (7 * row) % 13 for row in range(batch_size)]
    ids, mask = left_padded_prompts(lengths, seed=batch_size + 10)
    expected = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=20)
    config = DynSpecConfig(prefill_draft_confidence=confidence, **options)
    out = run(target, draft, ids, mask, config, do_sample=False, max_new_tokens=20)
    assert torch.equal(out.sequences, expected)
    stats = out.dynspec_stats
    if confidence == 0.0:  # every row drafted up to the cap before the prefill, and the prefill verified it
        assert stats.draft_tokens >= stats.accepted_tokens > 0
        assert stats.target_forwards == stats.num_steps + 1  # the prefill is the only forward that is not a step


def test_prefill_draft_saves_a_target_forward_when_the_draft_is_the_target():
    target = tiny_model("llama", seed=0)
    target.generation_config.eos_token_id = None
    ids, mask = left_padded_prompts([6, 9], seed=1)
    config = dict(policy="static", num_speculative_tokens=4, draft_lookahead=0)
    before = run(target, target, ids, mask, DynSpecConfig(**config), do_sample=False, max_new_tokens=10)
    after = run(target, target, ids, mask, DynSpecConfig(prefill_draft_confidence=0.0, **config),
                do_sample=False, max_new_tokens=10)
    assert torch.equal(before.sequences, after.sequences)
    # 10 tokens: the prefill's 1, then steps of 5 and 4; now the prefill emits 5 (4 drafted and its own) and one step 5
    assert before.dynspec_stats.target_forwards == 3
    assert after.dynspec_stats.target_forwards == 2
    assert after.dynspec_stats.prefill_seconds > 0 and after.dynspec_stats.draft_seconds > 0


@pytest.mark.parametrize("lengths", [[1], [1, 1, 1], [1, 6]])
def test_prefill_draft_with_one_token_prompts(pair, lengths):
    target, draft = pair
    ids, mask = left_padded_prompts(lengths, seed=4)
    expected = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=12)
    config = DynSpecConfig(policy="static", num_speculative_tokens=4, prefill_draft_confidence=0.0)
    assert torch.equal(run(target, draft, ids, mask, config, do_sample=False, max_new_tokens=12).sequences, expected)


def test_prefill_draft_confidence_is_checked():
    with pytest.raises(ValueError, match="prefill_draft_confidence"):
        DynSpecConfig(prefill_draft_confidence=1.5)


def test_prefix_visibility_by_hand():
    mask = torch.tensor([[0, 1, 1]])  # a padded row: its prefix is 2 real tokens after one pad
    tree = TokenTree.from_parents(torch.tensor([[5, 6, 7]]), torch.tensor([[-1, 0, 0]]), torch.tensor([[True] * 3]))
    seen = prefix_visibility(mask, tree).long()
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],  # the pad sees only itself
            [0, 1, 0, 0, 0, 0],
            [0, 1, 1, 0, 0, 0],
            [0, 1, 1, 1, 0, 0],  # the root sees the real prefix and itself
            [0, 1, 1, 1, 1, 0],  # its children see the root, not each other
            [0, 1, 1, 1, 0, 1],
        ]
    )
    assert torch.equal(seen[0], expected)
