"""The default proposer with a draft model: copies from the context beside the draft model, per row and step."""

from __future__ import annotations

import pytest
import torch
from conftest import perturbed, tiny_model
from test_hybrid import AlternatingSources, repetitive_prompts
from transformers import GenerationConfig, LogitsProcessorList

import hf_dynspec
from hf_dynspec import DynSpecConfig
from hf_dynspec.candidates.choice import LoopChoice, loop_proposer
from hf_dynspec.candidates.draft_model import DraftModelProposer
from hf_dynspec.candidates.draft_tree import DraftTreeProposer
from hf_dynspec.candidates.hybrid import HybridProposer
from hf_dynspec.candidates.prompt_lookup import LookupSource
from hf_dynspec.candidates.sources import source_name, suffix_installed
from hf_dynspec.candidates.suffix import SuffixSource, suffix_cache_for
from hf_dynspec.placement import Placement


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", seed=0)
    return target, perturbed(target, scale=0.05)


def choose(target, draft, **config) -> object:
    placement = Placement.of(torch.device("cpu"), target, draft)
    choice = LoopChoice(target, draft, DynSpecConfig(**config), GenerationConfig(), LogitsProcessorList(), placement,
                        None, None, False)
    return loop_proposer(choice)


def test_the_default_drafts_copies_beside_the_draft_model(pair):
    target, draft = pair
    proposer = choose(target, draft)
    assert isinstance(proposer, HybridProposer) and isinstance(proposer.draft, DraftModelProposer)
    expected = SuffixSource if suffix_installed() else LookupSource
    assert isinstance(proposer.free.source, expected)
    if suffix_installed():  # the call's own suffix trees, not the model's cache kept across calls
        assert proposer.free.source.cache is not suffix_cache_for(target)
    assert type(choose(target, draft, proposer="draft")) is DraftModelProposer
    assert isinstance(choose(target, draft, proposer="hybrid").free.source, LookupSource)
    assert type(choose(target, draft, num_speculative_tokens=0)) is DraftModelProposer
    assert isinstance(choose(target, draft, tree_node_budget=6), DraftTreeProposer)  # trees: the draft model alone


def test_source_names():
    assert source_name(DynSpecConfig(proposer="hybrid")) == "lookup"
    assert source_name(DynSpecConfig(proposer="suffix")) == "suffix"
    assert source_name(DynSpecConfig()) == ("call_suffix" if suffix_installed() else "lookup")


def test_proposer_draft_needs_a_draft_model(pair):
    target, _ = pair
    ids, mask = repetitive_prompts([7], seed=0)
    with pytest.raises(ValueError, match="proposer='draft'.*assistant_model"):
        hf_dynspec.generate(target, input_ids=ids, attention_mask=mask, max_new_tokens=4, prompt_lookup_num_tokens=2,
                            dynspec_config=DynSpecConfig(proposer="draft"))


def answered_twice(target, lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts `P + G + P`, where `G` is the target's greedy continuation of `P`: the answer to the final
    `P` is already in the context, as a tool's output or an earlier answer is in an agent's."""
    ids, mask = repetitive_prompts(lengths, seed=seed)
    answers = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=20)
    prompts = [ids[row][mask[row].bool()] for row in range(len(lengths))]
    rows = [torch.cat([prompt, answers[row, ids.shape[1] :], prompt]) for row, prompt in enumerate(prompts)]
    width = max(row.shape[0] for row in rows)
    padded = torch.stack([torch.nn.functional.pad(row, (width - row.shape[0], 0)) for row in rows])
    return padded, torch.stack([torch.arange(width) >= width - row.shape[0] for row in rows]).long()


@pytest.mark.parametrize("batch_lengths", [[6, 13, 8], [5, 9, 7, 11]])
@pytest.mark.parametrize("proposer", ["auto", "hybrid"])
def test_the_default_matches_plain_and_counts_what_each_source_drafted(pair, batch_lengths, proposer):
    target, draft = pair
    ids, mask = answered_twice(target, batch_lengths, seed=len(batch_lengths))
    expected = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=30)
    out = hf_dynspec.generate(target, input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=30,
                              assistant_model=draft, return_dict_in_generate=True, dynspec_policy=AlternatingSources(3),
                              dynspec_config=DynSpecConfig(num_speculative_tokens=3, proposer=proposer))
    assert torch.equal(out.sequences, expected)
    stats = out.dynspec_stats
    by_steps = sum(a for step in stats.steps for a, free in zip(step.accepted, step.free_rows or []) if free)
    assert stats.copied_tokens == by_steps > 0  # the answer in the context was copied
    assert stats.accepted_tokens - stats.copied_tokens > 0 and stats.draft_forwards > 0  # the draft model's tokens


def test_a_seed_gives_the_same_samples_whatever_ran_before(pair):
    """The default's suffix trees hold the call's own rows only: an earlier call's outputs change no proposal, so no
    random draw either."""
    target, draft = pair
    ids, mask = repetitive_prompts([6, 10], seed=3)
    runs = []
    for _ in range(3):
        torch.manual_seed(0)
        runs.append(hf_dynspec.generate(target, input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=16,
                                         assistant_model=draft, dynspec_config=DynSpecConfig(policy="static")))
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[1], runs[2])
