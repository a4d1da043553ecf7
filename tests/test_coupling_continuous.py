"""Coupled sampling under continuous batching: the same tokens as `generate` through the loop, whatever proposes,
and the rollout cache across managers."""

from __future__ import annotations

import pytest
import torch
from conftest import left_padded_prompts, perturbed, tiny_model
from test_continuous import cb_config, run, speculating  # `run` checks that no request holds blocks
from transformers import GenerationConfig

import hf_dynspec
from hf_dynspec import DynSpecConfig

NEW = 20


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", seed=0, dtype=torch.float32, initializer_range=0.15)
    return target, perturbed(target, scale=0.2)


@pytest.fixture(scope="module")
def prompts():
    ids, mask = left_padded_prompts([5, 9, 5, 3, 7], seed=1)
    ids[2], mask[2] = ids[0], mask[0]  # one prompt twice: its samples 0 and 1
    return [row[keep.bool()].tolist() for row, keep in zip(ids, mask)]


def sampling(**kwargs) -> GenerationConfig:
    settings = dict(do_sample=True, top_k=None, top_p=None, temperature=0.9, max_new_tokens=NEW, eos_token_id=1,
                    pad_token_id=0)
    return GenerationConfig(**(settings | kwargs))


def coupled(**fields) -> DynSpecConfig:
    return DynSpecConfig(**{"sampling": "coupled", "seed": 3, **fields})


@pytest.fixture(scope="module")
def reference(pair, prompts):
    """The loop without speculation, one batch of every prompt."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    settings = {k: v for k, v in sampling().to_diff_dict().items() if k != "transformers_version"}
    settings.update(top_k=None, top_p=None)  # `generate` would fill unset ones from the model's generation config
    out = hf_dynspec.generate(pair[0], input_ids=ids, attention_mask=mask, prompt_lookup_num_tokens=1,
                              dynspec_config=coupled(num_speculative_tokens=0), **settings)
    rows = [row.tolist() for row in out[:, width:]]
    return [row[: row.index(1) + 1] if 1 in row else row for row in rows]  # cut after the EOS (id 1)


CASES = {
    "no proposer named": ({}, {}),
    "prompt lookup": ({"policy": "static"}, {"prompt_lookup_num_tokens": 3}),
    "lookup trie": ({"policy": "static", "tree_node_budget": 4}, {"prompt_lookup_num_tokens": 3}),
    "draft model": ({"policy": "static"}, {"draft": True}),
    "draft model tree": ({"policy": "static", "tree_node_budget": 4}, {"draft": True}),
    "hybrid": ({"policy": "static", "proposer": "hybrid"}, {"draft": True}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_continuous_batching_samples_what_the_loop_samples(pair, prompts, reference, name):
    target, draft = pair
    fields, kwargs = CASES[name]
    assistant = draft if kwargs.pop("draft", False) else None
    outputs = hf_dynspec.generate_batch(
        target, prompts, assistant_model=assistant, generation_config=sampling(), dynspec_config=coupled(**fields),
        continuous_batching_config=cb_config(page_size=8), progress_bar=False, **kwargs,
    )
    assert [o.generated_tokens for o in outputs.values()] == reference


def test_requests_added_one_by_one_take_the_lowest_free_index(pair, prompts, reference):
    """A manager that serves the same prompt again after its earlier request finished samples the same stream."""
    target, _ = pair
    manager = speculating(target, generation_config=sampling(), dynspec_config=coupled(), prompt_lookup_num_tokens=2)
    try:
        first = run(manager, [prompts[0]], NEW)
        again = run(manager, [prompts[0], prompts[2]], NEW)  # indices 0 and 1 again
    finally:
        manager.stop(block=True)
    assert list(first.values()) == [reference[0]]
    assert list(again.values()) == [reference[0], reference[2]]


def test_the_rollout_cache_serves_continuous_batching(pair, prompts, reference):
    target, draft = pair
    hf_dynspec.clear_rollouts(target)
    for assistant in (None, draft):
        speculations = []
        for _ in range(2):
            config = coupled(reuse_rollouts=True, policy="static")  # what reuse does, not whether timings say it pays
            manager = speculating(target, generation_config=sampling(), dynspec_config=config, assistant_model=assistant)
            try:
                outputs = run(manager, prompts, NEW)
            finally:
                manager.stop(block=True)
            assert list(outputs.values()) == reference
            speculations.append(manager.speculation)
        if assistant is None:
            assert speculations[0].free_tokens == 0  # nothing cached before the first manager
        assert speculations[1].free_tokens > 0 and speculations[1].accepted_tokens > 0.5 * sum(map(len, reference))
        hf_dynspec.clear_rollouts(target)


def test_reuse_refuses_prompt_lookup_and_trees(pair):
    target, _ = pair
    with pytest.raises(ValueError, match="drop `prompt_lookup_num_tokens`"):
        hf_dynspec.init_continuous_batching(target, prompt_lookup_num_tokens=2, generation_config=sampling(),
                                            dynspec_config=coupled(reuse_rollouts=True))
    with pytest.raises(ValueError, match="tree_node_budget=0"):
        hf_dynspec.init_continuous_batching(target, generation_config=sampling(),
                                            dynspec_config=coupled(reuse_rollouts=True, tree_node_budget=3))
