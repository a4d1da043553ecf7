"""`hf_dynspec.enable(model, draft)`: a draft bound to the model serves every `generate` call that brings no proposer
of its own, PEFT targets included, in train mode and while the weights change."""

from __future__ import annotations

import pytest
import torch
from conftest import left_padded_prompts, perturbed, tiny_model, word_tokenizer
from transformers import GenerationConfig, pipeline

import hf_dynspec
from hf_dynspec import DynSpecConfig
from hf_dynspec.loop import LoopRun

STATIC = DynSpecConfig(policy="static", num_speculative_tokens=3)


@pytest.fixture
def pair():
    target = tiny_model("llama", seed=0)
    yield target, perturbed(target, scale=0.05)
    hf_dynspec.disable(target)


@pytest.fixture
def inputs():
    ids, mask = left_padded_prompts([5, 9, 3, 7], seed=4)
    return {"input_ids": ids, "attention_mask": mask}


class Forwards:
    """Counts forwards of a model (a draft drafts only through its forward)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.count = 0
        self.handle = model.register_forward_hook(self._hook)

    def _hook(self, *args) -> None:
        self.count += 1

    def take(self) -> int:
        count, self.count = self.count, 0
        return count


@pytest.fixture
def loop_runs(monkeypatch):
    """How many `generate` calls the loop served."""
    runs = []
    original = LoopRun.generate

    def counted(self, model_kwargs):
        runs.append(self)
        return original(self, model_kwargs)

    monkeypatch.setattr(LoopRun, "generate", counted)
    return runs


def test_a_bound_draft_serves_calls_without_a_proposer(pair, inputs, loop_runs):
    target, draft = pair
    expected = target.generate(**inputs, do_sample=False, max_new_tokens=12)
    drafts = Forwards(draft)
    hf_dynspec.enable(target, draft, dynspec_config=STATIC)
    out = target.generate(**inputs, generation_config=GenerationConfig(do_sample=False, max_new_tokens=12,
                                                                       pad_token_id=0, eos_token_id=1))
    assert torch.equal(out, expected)
    assert len(loop_runs) == 1 and drafts.take() > 0
    hf_dynspec.disable(target)
    assert torch.equal(target.generate(**inputs, do_sample=False, max_new_tokens=12), expected)
    assert len(loop_runs) == 1 and drafts.take() == 0  # unbound: plain generate


def test_a_call_s_own_proposer_and_config_win(pair, inputs, loop_runs):
    target, draft = pair
    other = perturbed(target, scale=0.05, seed=9)
    bound, own = Forwards(draft), Forwards(other)
    hf_dynspec.enable(target, draft, dynspec_config=STATIC)
    expected = target.generate(**inputs, do_sample=False, max_new_tokens=10, assistant_model=None)
    bound.take()
    out = target.generate(**inputs, do_sample=False, max_new_tokens=10, assistant_model=other,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected) and own.take() > 0 and bound.take() == 0
    out = target.generate(**inputs, do_sample=False, max_new_tokens=10, prompt_lookup_num_tokens=2,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected) and bound.take() == 0 and own.take() == 0
    assert max(max(step.draft_lengths) for step in out.dynspec_stats.steps) <= 2
    out = target.generate(**inputs, do_sample=False, max_new_tokens=10, return_dict_in_generate=True,
                          dynspec_config=DynSpecConfig(policy="static", num_speculative_tokens=1))
    assert torch.equal(out.sequences, expected) and bound.take() > 0
    assert max(max(step.draft_lengths) for step in out.dynspec_stats.steps) == 1  # the call's config, not the bound


def test_calls_the_loop_cannot_serve_run_plain_with_a_bound_draft(pair, inputs, loop_runs):
    target, draft = pair
    expected = target.generate(**inputs, num_beams=2, do_sample=False, max_new_tokens=6)
    hf_dynspec.enable(target, draft)
    assert torch.equal(target.generate(**inputs, num_beams=2, do_sample=False, max_new_tokens=6), expected)
    assert not loop_runs


def test_binding_errors(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="vocabular"):
        hf_dynspec.enable(target, tiny_model("llama", seed=1, vocab=80))
    hf_dynspec.enable(target, draft)
    hf_dynspec.enable(target, draft, dynspec_config=STATIC)  # the same draft again: the config is updated
    assert target._dynspec_binding.dynspec_config is STATIC and target._dynspec_binding.assistant_model is draft
    hf_dynspec.enable(target)  # no draft: the bound one stays
    assert target._dynspec_binding.assistant_model is draft
    with pytest.raises(ValueError, match="already enabled with another draft"):
        hf_dynspec.enable(target, perturbed(target, scale=0.05, seed=5))
    with pytest.raises(ValueError, match="target's tokenizer"):
        hf_dynspec.enable(target, draft, assistant_tokenizer=word_tokenizer())


def test_train_mode_and_changing_weights(pair, inputs):
    """The loop leaves the model in train mode; after an optimizer-like change of the weights, outputs still match
    plain decoding of the changed model (nothing was cached from the old weights)."""
    target, draft = pair
    hf_dynspec.enable(target, draft, dynspec_config=STATIC)
    target.train()
    for _ in range(2):
        with torch.no_grad():
            expected = hf_dynspec.disable(target).generate(**inputs, do_sample=False, max_new_tokens=10)
            hf_dynspec.enable(target, draft, dynspec_config=STATIC)
            assert torch.equal(target.generate(**inputs, do_sample=False, max_new_tokens=10), expected)
            assert target.training and all(module.training for module in target.modules())
            for parameter in target.parameters():
                parameter.add_(0.02 * torch.randn_like(parameter))


def test_a_lora_target_generates_through_peft_with_the_bound_draft(inputs, loop_runs):
    from peft import LoraConfig, get_peft_model

    base = tiny_model("llama", seed=0)
    draft = perturbed(base, scale=0.05)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(base, config)
    expected = model.generate(**inputs, do_sample=False, max_new_tokens=10)
    with model.disable_adapter():
        without_adapter = model.generate(**inputs, do_sample=False, max_new_tokens=10)
    assert not torch.equal(expected, without_adapter)  # the adapter changes what the target generates
    hf_dynspec.enable(model, draft, dynspec_config=STATIC)
    try:
        assert torch.equal(model.generate(**inputs, do_sample=False, max_new_tokens=10), expected)
        assert len(loop_runs) == 1
        direct = hf_dynspec.generate(model, **inputs, assistant_model=draft, do_sample=False, max_new_tokens=10)
        assert torch.equal(direct, expected)
    finally:
        hf_dynspec.disable(model)
    assert model.get_base_model()._dynspec_binding is None


def test_prompt_learning_peft_models_are_refused():
    from peft import PromptTuningConfig, get_peft_model

    model = get_peft_model(tiny_model("llama", seed=0), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2))
    with pytest.raises(ValueError, match="prompt-learning adapter"):
        hf_dynspec.enable(model)


def test_a_pipeline_of_four_rows_speculates_with_the_draft_and_matches_plain(pair, loop_runs):
    target, draft = pair
    prompts = ["w5 w9 w17", "w40 w3 w8 w8 w12 w61", "w7", "w22 w23 w11 w11"]
    kwargs = dict(max_new_tokens=10, do_sample=False, batch_size=4)
    generator = pipeline("text-generation", model=target, tokenizer=word_tokenizer())
    expected = generator(prompts, **kwargs)
    hf_dynspec.enable(target)
    assert generator(prompts, assistant_model=draft, **kwargs) == expected
    assert len(loop_runs) == 1 and loop_runs[0].input_ids.shape[0] == 4
    hf_dynspec.disable(target)
    hf_dynspec.enable(target, draft)
    assert generator(prompts, **kwargs) == expected
    assert len(loop_runs) == 2


def test_a_deep_copy_of_an_enabled_model_generates_with_the_copy(pair, inputs):
    """Trainers copy models (a reference model); the copy's `generate` must run the copy, not the original."""
    import copy

    target, draft = pair
    hf_dynspec.enable(target, draft, dynspec_config=STATIC)
    twin = copy.deepcopy(target)
    with torch.no_grad():
        for parameter in twin.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    expected = hf_dynspec.disable(copy.deepcopy(twin)).generate(**inputs, do_sample=False, max_new_tokens=10)
    assert torch.equal(twin.generate(**inputs, do_sample=False, max_new_tokens=10), expected)
    assert not torch.equal(target.generate(**inputs, do_sample=False, max_new_tokens=10), expected)
