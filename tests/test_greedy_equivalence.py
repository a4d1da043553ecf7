"""Greedy speculative output must be token-identical to plain greedy `generate`, row by row."""

from __future__ import annotations

import pytest
import torch
from conftest import EOS, left_padded_prompts, perturbed, tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hf_dynspec
from hf_dynspec import DynSpecConfig


def plain(model, ids, mask, **kwargs):
    return model.generate(input_ids=ids, attention_mask=mask, do_sample=False, **kwargs)


def speculative(model, ids, mask, draft, k, proposer="auto", **kwargs):
    return model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        assistant_model=draft,
        custom_generate=hf_dynspec.speculative_loop,
        dynspec_config=DynSpecConfig(policy="static", num_speculative_tokens=k, proposer=proposer),
        return_dict_in_generate=True,
        **kwargs,
    )


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request):
    target = tiny_model(request.param, seed=0)
    return request.param, target, {
        "same": target,
        "random": tiny_model(request.param, seed=7),
        "mixed": perturbed(target, scale=0.05),
    }


@pytest.mark.parametrize("draft_kind", ["same", "random", "mixed"])
@pytest.mark.parametrize("batch_size", [1, 2, 5, 8])
def test_matches_plain_greedy(pair, draft_kind, batch_size):
    family, target, drafts = pair
    lengths = [3 + (5 * row) % 11 for row in range(batch_size)]
    ids, mask = left_padded_prompts(lengths, seed=batch_size)
    expected = plain(target, ids, mask, max_new_tokens=24)
    for k, proposer in ((1, "auto"), (4, "auto"), (1, "draft"), (4, "draft")):  # copies beside the draft, and without
        out = speculative(target, ids, mask, drafts[draft_kind], k, proposer, max_new_tokens=24)
        assert torch.equal(out.sequences, expected), f"{family}/{draft_kind}/bs={batch_size}/k={k}/{proposer}"
    stats = out.dynspec_stats  # the draft model's alone
    if draft_kind == "same":
        assert stats.acceptance_rate == 1.0
    if draft_kind == "random":
        assert stats.acceptance_rate < 0.5


def test_mixed_draft_accepts_partially(pair):
    _, target, drafts = pair
    ids, mask = left_padded_prompts([5, 9, 12, 7], seed=3)
    stats = speculative(target, ids, mask, drafts["mixed"], 4, max_new_tokens=32).dynspec_stats
    assert 0.05 < stats.acceptance_rate < 0.98
    accepted = {a for step in stats.steps for a in step.accepted}
    assert len(accepted) > 2, "rows should accept different numbers of tokens within steps"


def _eos_from_plain_output(target, ids, mask) -> int:
    """A token that plain decoding emits mid-sequence in some rows, to serve as EOS."""
    generated = plain(target, ids, mask, max_new_tokens=20)[:, ids.shape[1] :]
    counts = torch.bincount(generated[:, 3:12].reshape(-1), minlength=target.config.vocab_size)
    return int(counts.argmax())


@pytest.mark.parametrize("draft_kind", ["same", "mixed"])
def test_eos_inside_drafts_and_rows_finishing_at_different_steps(pair, draft_kind):
    _, target, drafts = pair
    ids, mask = left_padded_prompts([4, 9, 6, 11, 3, 8], seed=11)
    eos = _eos_from_plain_output(target, ids, mask)
    expected = plain(target, ids, mask, max_new_tokens=30, eos_token_id=eos)
    out = speculative(target, ids, mask, drafts[draft_kind], 5, max_new_tokens=30, eos_token_id=eos)
    assert torch.equal(out.sequences, expected)
    finished_early = (expected[:, ids.shape[1] :] == eos).any(dim=1)
    assert finished_early.any() and not finished_early.all(), "the case needs rows finishing at different steps"
    batch_sizes = [step.batch_size for step in out.dynspec_stats.steps]
    assert batch_sizes[-1] < batch_sizes[0], "finished rows must leave the batch"


def test_prompt_lookup_matches_plain(pair):
    _, target, _ = pair
    ids, mask = left_padded_prompts([6, 10, 14], seed=5)
    ids = torch.where(mask.bool(), ids % 7 + 3, ids)  # a small alphabet makes n-gram matches frequent
    expected = plain(target, ids, mask, max_new_tokens=30)
    out = target.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        prompt_lookup_num_tokens=4,
        custom_generate=hf_dynspec.speculative_loop,
        return_dict_in_generate=True,
        max_new_tokens=30,
    )
    assert torch.equal(out.sequences, expected)
    assert out.dynspec_stats.draft_tokens > 0
    assert out.dynspec_stats.draft_forwards == 0


def test_processors_match_plain(pair):
    """Prefix-dependent processors (repetition penalty, minimum new tokens, no-repeat n-grams) see plain prefixes."""
    _, target, drafts = pair
    ids, mask = left_padded_prompts([5, 12, 8], seed=9)
    options = dict(max_new_tokens=20, repetition_penalty=1.3, min_new_tokens=6, no_repeat_ngram_size=3, eos_token_id=EOS)
    expected = plain(target, ids, mask, **options)
    out = speculative(target, ids, mask, drafts["mixed"], 3, **options)
    assert torch.equal(out.sequences, expected)


def allowed_after(batch_id: int, prefix: torch.LongTensor) -> list[int]:
    """`prefix_allowed_tokens_fn` that depends on the row and on the prefix's last token."""
    odd = (batch_id + int(prefix[-1])) % 2
    return list(range(3, 60)) if odd else list(range(30, 96))


GENERATE_PROCESSORS = {
    "bad_words_ids": dict(bad_words_ids=[[62], [23, 23], [89, 77, 21]]),
    "sequence_bias": dict(sequence_bias={(23,): -5.0, (89, 77): 3.0, (23, 23, 62): 4.0}),
    "prefix_allowed_tokens_fn": dict(prefix_allowed_tokens_fn=allowed_after),
    "suppress_tokens": dict(suppress_tokens=[23, 89], begin_suppress_tokens=[21, 84]),
    "forced_eos_token_id": dict(forced_eos_token_id=EOS, max_new_tokens=9),
    "exponential_decay_length_penalty": dict(exponential_decay_length_penalty=(3, 1.5), eos_token_id=EOS),
    "min_length": dict(min_length=14, eos_token_id=23),  # 23: a token these rows generate early
    "renormalize_logits": dict(renormalize_logits=True, repetition_penalty=1.4),
}


@pytest.mark.parametrize("name", GENERATE_PROCESSORS)
def test_every_generate_processor_matches_plain(name):
    """Each of `generate`'s prefix- and length-dependent processors, through a chain, a tree and prompt lookup."""
    target = tiny_model("llama", seed=0)
    draft = perturbed(target, scale=0.05)
    ids, mask = left_padded_prompts([5, 9, 3, 7], seed=2)
    options = {"max_new_tokens": 20, **GENERATE_PROCESSORS[name]}
    expected = plain(target, ids, mask, **options)
    unprocessed = plain(target, ids, mask, max_new_tokens=options["max_new_tokens"])
    assert not torch.equal(expected, unprocessed), "the processor changes nothing here: the test would prove nothing"
    chain = DynSpecConfig(policy="static", num_speculative_tokens=4)
    tree = DynSpecConfig(policy="static", num_speculative_tokens=4, tree_node_budget=8)
    for config, proposer in ((chain, dict(assistant_model=draft)), (tree, dict(assistant_model=draft)),
                             (chain, dict(prompt_lookup_num_tokens=3))):
        out = hf_dynspec.generate(
            target, input_ids=ids, attention_mask=mask, do_sample=False, dynspec_config=config, **proposer, **options
        )
        assert torch.equal(out, expected), (name, config.tree_node_budget, list(proposer))


OUTPUT_PROPOSERS = {
    "chain": (DynSpecConfig(policy="static", num_speculative_tokens=4), "draft"),
    "tree": (DynSpecConfig(policy="static", num_speculative_tokens=4, tree_node_budget=8), "draft"),
    "prefill verifies drafts": (DynSpecConfig(policy="static", prefill_draft_confidence=0.1), "draft"),
    "lookup": (DynSpecConfig(policy="static", num_speculative_tokens=4), "lookup"),
}


@pytest.mark.parametrize("proposer", OUTPUT_PROPOSERS)
def test_output_scores_and_logits_match_plain(pair, proposer):
    """`output_scores` / `output_logits`: at every token a row generated, the processed scores and the raw logits of
    plain greedy `generate`; after a row's EOS, the pad token is certain (plain's values there come from feeding
    padding, which the loop never does)."""
    _, target, drafts = pair
    ids, mask = left_padded_prompts([4, 9, 6, 11, 3], seed=11)
    eos = _eos_from_plain_output(target, ids, mask)
    options = dict(max_new_tokens=24, eos_token_id=eos, repetition_penalty=1.3, return_dict_in_generate=True,
                   output_scores=True, output_logits=True)
    expected = plain(target, ids, mask, **options)
    config, kind = OUTPUT_PROPOSERS[proposer]
    source = dict(assistant_model=drafts["mixed"]) if kind == "draft" else dict(prompt_lookup_num_tokens=3)
    out = hf_dynspec.generate(target, input_ids=ids, attention_mask=mask, do_sample=False, dynspec_config=config,
                              **source, **options)
    assert torch.equal(out.sequences, expected.sequences)
    generated = out.sequences[:, ids.shape[1] :]
    lengths = torch.where((generated == eos).any(1), (generated == eos).long().argmax(1) + 1, generated.shape[1])
    assert lengths.min() < lengths.max(), "the case needs rows that end before others"
    pad = target.generation_config.pad_token_id
    for name in ("scores", "logits"):
        ours, theirs = torch.stack(getattr(out, name), 1), torch.stack(getattr(expected, name), 1)  # [rows, new, vocab]
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype, name
        for row, length in enumerate(lengths.tolist()):
            torch.testing.assert_close(ours[row, :length], theirs[row, :length], rtol=1e-5, atol=1e-5)
            after = ours[row, length:]  # [new - length, vocab]
            assert (after[:, pad] == 0).all() and after[:, torch.arange(after.shape[1]) != pad].isneginf().all()
    assert not torch.equal(torch.stack(out.scores), torch.stack(out.logits))  # the penalty processed the scores


def test_float32_models_match_plain():
    target = tiny_model("llama", seed=3, dtype=torch.float32)
    draft = perturbed(target, scale=0.05)
    ids, mask = left_padded_prompts([7, 3, 10, 5], seed=2)
    expected = plain(target, ids, mask, max_new_tokens=20)
    assert torch.equal(speculative(target, ids, mask, draft, 3, max_new_tokens=20).sequences, expected)


def test_compaction_keeps_output_identical(pair):
    _, target, drafts = pair
    ids, mask = left_padded_prompts([5, 9, 2, 7], seed=4)
    expected = plain(target, ids, mask, max_new_tokens=40)
    out = target.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        assistant_model=drafts["mixed"],
        custom_generate=hf_dynspec.speculative_loop,
        dynspec_config=DynSpecConfig(policy="static", num_speculative_tokens=6, compact_min_holes=1, compact_hole_fraction=0.05),
        return_dict_in_generate=True,
        max_new_tokens=40,
    )
    assert torch.equal(out.sequences, expected)
    assert out.dynspec_stats.compactions > 0


_TARGET = tiny_model("llama", seed=21)
_DRAFT = perturbed(_TARGET, scale=0.05, seed=5)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(min_value=1, max_value=12), min_size=1, max_size=6),
    k=st.integers(min_value=0, max_value=6),
    max_new_tokens=st.integers(min_value=1, max_value=25),
    seed=st.integers(min_value=0, max_value=10_000),
    use_eos=st.booleans(),
)
def test_property_random_shapes(lengths, k, max_new_tokens, seed, use_eos):
    ids, mask = left_padded_prompts(lengths, seed=seed)
    eos = int(ids[0, -1]) if use_eos else EOS
    expected = plain(_TARGET, ids, mask, max_new_tokens=max_new_tokens, eos_token_id=eos)
    out = speculative(_TARGET, ids, mask, _DRAFT, k, max_new_tokens=max_new_tokens, eos_token_id=eos)
    assert torch.equal(out.sequences, expected)


@pytest.mark.parametrize("proposer", ["chain", "tree", "lookup"])
def test_token_buffers_that_grow_every_step_keep_output_identical(pair, monkeypatch, proposer):
    """The loop's token buffers start at one generated token per row and double as rows need more; rows finishing at
    different steps (EOS), prefix-dependent processors and every proposer see the same tokens as plain."""
    from hf_dynspec import loop

    monkeypatch.setattr(loop, "INITIAL_CAPACITY", 1)
    _, target, drafts = pair
    ids, mask = left_padded_prompts([4, 9, 6, 11, 3, 8], seed=11)
    ids = torch.where(mask.bool(), ids % 7 + 3, ids) if proposer == "lookup" else ids
    eos = _eos_from_plain_output(target, ids, mask)
    options = dict(max_new_tokens=30, eos_token_id=eos, repetition_penalty=1.2)
    expected = plain(target, ids, mask, **options)
    kwargs = {"lookup": dict(prompt_lookup_num_tokens=4), "chain": dict(assistant_model=drafts["mixed"]),
              "tree": dict(assistant_model=drafts["mixed"], dynspec_config=DynSpecConfig(tree_node_budget=8))}[proposer]
    out = hf_dynspec.generate(target, input_ids=ids, attention_mask=mask, do_sample=False, **kwargs, **options)
    assert torch.equal(out, expected)


def test_max_new_tokens_far_beyond_eos(pair):
    """A `max_new_tokens` no buffer could hold, with every row ending at EOS early, decodes as plain does."""
    _, target, drafts = pair
    ids, mask = left_padded_prompts([5, 8], seed=3)
    eos = [int(t) for t in plain(target, ids, mask, max_new_tokens=6)[:, ids.shape[1] + 5]]  # each row's sixth token
    expected = plain(target, ids, mask, max_new_tokens=10**12, eos_token_id=eos)
    out = speculative(target, ids, mask, drafts["mixed"], 3, max_new_tokens=10**12, eos_token_id=eos)
    assert expected.shape[1] <= ids.shape[1] + 6
    assert torch.equal(out.sequences, expected)
