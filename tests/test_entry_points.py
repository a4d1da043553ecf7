"""The ways in: callable `custom_generate`, `hf_dynspec.generate`, `enable`/`disable`, transformers' own loop."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import left_padded_prompts, perturbed, tiny_model, word_tokenizer
from transformers import StoppingCriteria, StoppingCriteriaList, pipeline
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
from transformers.generation.streamers import BaseStreamer

import hf_dynspec
from hf_dynspec import DynSpecConfig
from hf_dynspec.candidates.draft_model import DraftModelProposer
from hf_dynspec.candidates.prompt_lookup import PromptLookupProposer, lookup_continuation
from hf_dynspec.placement import Placement


@pytest.fixture(scope="module")
def models():
    target = tiny_model("llama", seed=0)
    return target, perturbed(target, scale=0.05)


@pytest.fixture(scope="module")
def inputs():
    ids, mask = left_padded_prompts([5, 9, 3], seed=2)
    return {"input_ids": ids, "attention_mask": mask}


def test_generate_function_matches_callable(models, inputs):
    target, draft = models
    expected = target.generate(**inputs, do_sample=False, max_new_tokens=15)
    direct = hf_dynspec.generate(target, **inputs, assistant_model=draft, do_sample=False, max_new_tokens=15)
    assert torch.equal(direct, expected)


def test_enable_and_disable(inputs):
    target = tiny_model("llama", seed=0)
    draft = perturbed(target, scale=0.05)
    expected = target.generate(**inputs, do_sample=False, max_new_tokens=12)
    with pytest.raises(ValueError, match="batch_size = 1"):
        target.generate(**inputs, assistant_model=draft, do_sample=False, max_new_tokens=12)

    hf_dynspec.enable(target)
    out = target.generate(**inputs, assistant_model=draft, do_sample=False, max_new_tokens=12,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.dynspec_stats.num_steps > 0
    assert torch.equal(target.generate(**inputs, do_sample=False, max_new_tokens=12), expected)  # no proposer: plain

    hf_dynspec.disable(target)
    with pytest.raises(ValueError, match="batch_size = 1"):
        target.generate(**inputs, assistant_model=draft, do_sample=False, max_new_tokens=12)


def test_enable_serves_text_generation_pipelines():
    """A pipeline over an enabled model runs the loop (batched, which transformers' assisted loop refuses) and gives
    plain greedy's text."""
    target = tiny_model("llama", seed=0)
    draft = perturbed(target, scale=0.05)
    prompts = ["w5 w9 w17", "w40 w3 w8 w8 w12 w61", "w7"]
    kwargs = dict(max_new_tokens=10, do_sample=False, batch_size=3)
    generator = pipeline("text-generation", model=target, tokenizer=word_tokenizer())
    expected = generator(prompts, **kwargs)
    with pytest.raises(ValueError, match="batch_size = 1"):
        generator(prompts, assistant_model=draft, **kwargs)
    hf_dynspec.enable(target)
    try:
        assert generator(prompts, assistant_model=draft, **kwargs) == expected
        assert generator(prompts, prompt_lookup_num_tokens=3, **kwargs) == expected
    finally:
        hf_dynspec.disable(target)
    assert all(len(out[0]["generated_text"].split()) > len(prompt.split()) for out, prompt in zip(expected, prompts))


@pytest.mark.parametrize("entry", ["generate", "positional", "enable"])
def test_num_return_sequences_repeat_each_prompt(models, inputs, entry):
    """With sampling, `num_return_sequences=n` gives the rows of the batch with every prompt repeated `n` times, token
    for token under the same seed (each row samples on its own), in plain `generate`'s order."""
    target, draft = models
    copies, kwargs = 3, dict(do_sample=True, temperature=1.5, max_new_tokens=12, assistant_model=draft,
                             dynspec_config=DynSpecConfig(policy="static"))
    repeated = {key: value.repeat_interleave(copies, dim=0) for key, value in inputs.items()}
    torch.manual_seed(0)
    expected = hf_dynspec.generate(target, **repeated, **kwargs)
    torch.manual_seed(0)
    if entry == "generate":
        out = hf_dynspec.generate(target, **inputs, num_return_sequences=copies, **kwargs)
    elif entry == "positional":
        out = hf_dynspec.generate(target, inputs["input_ids"], attention_mask=inputs["attention_mask"],
                                  num_return_sequences=copies, **kwargs)
    else:
        hf_dynspec.enable(target)
        try:
            out = target.generate(**inputs, num_return_sequences=copies, **kwargs)
        finally:
            hf_dynspec.disable(target)
    assert torch.equal(out, expected)
    prompt_width = inputs["input_ids"].shape[1]
    assert torch.equal(out[:, :prompt_width], repeated["input_ids"])
    samples = out[:, prompt_width:].reshape(len(inputs["input_ids"]), copies, -1)  # [prompts, copies, new]
    assert any(len({tuple(row.tolist()) for row in prompt}) > 1 for prompt in samples)  # copies sample apart


def test_pipelines_return_several_samples_per_prompt():
    """`num_return_sequences` through a text-generation pipeline over an enabled model: n texts per prompt."""
    target = tiny_model("llama", seed=0)
    generator = pipeline("text-generation", model=hf_dynspec.enable(target), tokenizer=word_tokenizer())
    prompts = ["w5 w9 w17", "w40 w3 w8 w8 w12 w61"]
    try:
        outputs = generator(prompts, assistant_model=perturbed(target, scale=0.05), do_sample=True,
                            num_return_sequences=3, max_new_tokens=8, batch_size=2)
    finally:
        hf_dynspec.disable(target)
    assert [len(texts) for texts in outputs] == [3, 3]
    for prompt, texts in zip(prompts, outputs):
        assert all(text["generated_text"].startswith(prompt) for text in texts)
        assert all(len(text["generated_text"].split()) > len(prompt.split()) for text in texts)


def test_proposers_inside_transformers_batch_one_loop(models):
    """As `CandidateGenerator`s, both proposers drive transformers' own assisted loop at batch size 1."""
    target, draft = models
    ids, mask = left_padded_prompts([9], seed=4)
    ids = ids % 5 + 3
    expected = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=20)
    placement = Placement.of(ids.device, target, draft)
    proposers = [
        DraftModelProposer(draft, [], target.generation_config, placement, DynSpecConfig(num_speculative_tokens=3)),
        PromptLookupProposer(max_ngram=2, num_output_tokens=3),
    ]
    for proposer in proposers:
        target._get_candidate_generator = lambda proposer=proposer, **kwargs: proposer
        try:
            out = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=20,
                                  assistant_model=draft)
        finally:
            del target._get_candidate_generator
        assert torch.equal(out, expected), type(proposer).__name__


def test_prompt_lookup_continuation():
    tokens = torch.tensor([5, 6, 7, 8, 9, 5, 6, 7, 1, 5, 6, 7])
    assert lookup_continuation(tokens, max_ngram=3, min_ngram=1, length=2).tolist() == [1, 5]  # latest match
    assert lookup_continuation(torch.tensor([1, 2, 3]), 3, 1, 4).tolist() == []


class Recorder(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.reshape(-1))

    def end(self):
        self.ended = True


def test_streamer_receives_every_token(models):
    target, draft = models
    ids, mask = left_padded_prompts([6], seed=3)
    streamer = Recorder()
    out = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=14, streamer=streamer,
                          assistant_model=draft, custom_generate=hf_dynspec.speculative_loop)
    assert streamer.ended
    assert torch.equal(torch.cat(streamer.chunks[1:]), out[0, ids.shape[1] :])  # chunk 0 is the prompt


def test_streamer_needs_batch_size_one(models, inputs):
    target, draft = models
    with pytest.raises(ValueError, match="streams batch size 1 only"):
        hf_dynspec.generate(target, **inputs, assistant_model=draft, max_new_tokens=5, streamer=Recorder())


class StopAfterToken(StoppingCriteria):
    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_user_stopping_criteria_match_plain(models, inputs):
    target, draft = models
    plain = target.generate(**inputs, do_sample=False, max_new_tokens=25)
    token = int(plain[1, inputs["input_ids"].shape[1] + 6])
    criteria = StoppingCriteriaList([StopAfterToken(token)])
    expected = target.generate(**inputs, do_sample=False, max_new_tokens=25, stopping_criteria=criteria)
    out = hf_dynspec.generate(target, **inputs, assistant_model=draft, do_sample=False, max_new_tokens=25,
                              stopping_criteria=criteria)
    assert torch.equal(out, expected)


class StopAtLength(StoppingCriteria):
    """Answers with a Python bool for the whole batch, as some user criteria do."""

    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids.shape[1] >= self.length


@pytest.mark.parametrize("kind", ["eos", "max_length", "python_bool"])
def test_user_criteria_of_the_loop_s_own_kinds_match_plain(models, inputs, kind):
    """A user's own EOS and length criteria, tighter than the generation config's, are honoured, not taken for the
    ones `generate` builds (which the loop applies itself)."""
    target, draft = models
    width = inputs["input_ids"].shape[1]
    plain = target.generate(**inputs, do_sample=False, max_new_tokens=20)
    criterion = {
        "eos": lambda: EosTokenCriteria(plain[:, width + 4].tolist()),
        "max_length": lambda: MaxLengthCriteria(width + 9),
        "python_bool": lambda: StopAtLength(width + 7),
    }[kind]()
    kwargs = dict(do_sample=False, max_new_tokens=20, stopping_criteria=StoppingCriteriaList([criterion]))
    expected = target.generate(**inputs, eos_token_id=None, **kwargs)
    out = hf_dynspec.generate(target, **inputs, assistant_model=draft, eos_token_id=None, **kwargs)
    assert expected.shape[1] < width + 20  # the criterion did stop plain decoding early
    assert torch.equal(out, expected)


def test_int32_input_ids_match_plain(models, inputs):
    target, draft = models
    ids = inputs["input_ids"].to(torch.int32)
    expected = target.generate(input_ids=ids, attention_mask=inputs["attention_mask"], do_sample=False, max_new_tokens=8)
    out = hf_dynspec.generate(target, input_ids=ids, attention_mask=inputs["attention_mask"], assistant_model=draft,
                              do_sample=False, max_new_tokens=8)
    assert torch.equal(out, expected)


def test_draft_in_another_dtype(models, inputs):
    target, draft = models
    expected = target.generate(**inputs, do_sample=False, max_new_tokens=15)
    draft32 = perturbed(target, scale=0.05).to(torch.float32)
    assert torch.equal(hf_dynspec.generate(target, **inputs, assistant_model=draft32, max_new_tokens=15), expected)


def test_stats_record_each_step(models, inputs):
    target, draft = models
    out = hf_dynspec.generate(target, **inputs, assistant_model=draft, max_new_tokens=15,
                              return_dict_in_generate=True,
                              dynspec_config=DynSpecConfig(num_speculative_tokens=3, draft_lookahead=0))
    stats = out.dynspec_stats
    assert stats.num_steps == len(stats.steps) > 0
    for step in stats.steps:
        assert step.batch_size == len(step.row_ids) == len(step.draft_lengths) == len(step.accepted)
        assert all(0 <= a <= k <= 3 for a, k in zip(step.accepted, step.draft_lengths))
        packed, padded = sum(step.draft_lengths) + step.batch_size, step.batch_size * (1 + max(step.draft_lengths))
        assert step.target_tokens in (packed, padded)  # packed where the model can pack its verify forward
        assert step.draft_seconds >= 0 and step.verify_seconds > 0
    generated = (out.sequences[:, inputs["input_ids"].shape[1] :] != 0).sum()
    assert stats.emitted_tokens == int(generated) == 3 * 15
    assert stats.target_forwards == stats.num_steps + 1
    json.dumps(stats.to_dict())
