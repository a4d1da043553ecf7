"""Every unsupported input raises a clear error naming the problem."""

from __future__ import annotations

import pytest
import torch
from conftest import left_padded_prompts, tiny_model, word_tokenizer
from test_prefix_cache import prefix_cache
from transformers import (
    GenerationConfig,
    GPT2Config,
    GPT2LMHeadModel,
    StaticCache,
)

import hf_dynspec
from hf_dynspec import DraftLengthPolicy, DynSpecConfig
from hf_dynspec.cache import cache_kwarg


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=0)


@pytest.fixture(scope="module")
def inputs():
    ids, mask = left_padded_prompts([4, 6], seed=0)
    return {"input_ids": ids, "attention_mask": mask}


def run(model, inputs, **kwargs):
    kwargs.setdefault("max_new_tokens", 5)
    return model.generate(**inputs, custom_generate=hf_dynspec.speculative_loop, **kwargs)


def test_vocabulary_mismatch(target, inputs):
    other = tiny_model("llama", seed=1, vocab=80)
    with pytest.raises(ValueError, match="vocabulary .* differs .*`tokenizer=<target tokenizer>` and "
                                         "`assistant_tokenizer=<draft tokenizer>`"):
        hf_dynspec.generate(target, **inputs, assistant_model=other, max_new_tokens=5)
    enabled = hf_dynspec.enable(tiny_model("llama", seed=0))
    with pytest.raises(ValueError, match="A draft with another tokenizer needs both tokenizers"):
        enabled.generate(**inputs, assistant_model=other, max_new_tokens=5)


def test_draft_tokenizer_without_the_targets(target, inputs):
    words = word_tokenizer(80)
    with pytest.raises(ValueError, match="`assistant_tokenizer` drafts .* the target's tokenizer as `tokenizer` too"):
        hf_dynspec.generate(target, **inputs, assistant_model=tiny_model("llama", seed=1, vocab=80),
                            assistant_tokenizer=words, max_new_tokens=5)


def test_draft_with_another_tokenizer_in_a_tree(target, inputs):
    with pytest.raises(ValueError, match="another tokenizer proposes chains only: set `tree_node_budget=0`"):
        hf_dynspec.generate(target, **inputs, assistant_model=tiny_model("llama", seed=1, vocab=80),
                            tokenizer=word_tokenizer(), assistant_tokenizer=word_tokenizer(80), max_new_tokens=5,
                            dynspec_config=DynSpecConfig(tree_node_budget=8))


def test_beam_search(target, inputs):
    with pytest.raises(ValueError, match="Beam search"):
        hf_dynspec.generate(target, **inputs, assistant_model=target, num_beams=2, max_new_tokens=5)


def test_num_return_sequences_greedy(target, inputs):
    """Greedy copies would all be the same: refused, as plain `generate` refuses them (sampling ones run, see
    test_entry_points)."""
    with pytest.raises(ValueError, match="num_return_sequences"):
        hf_dynspec.generate(target, **inputs, prompt_lookup_num_tokens=3, num_return_sequences=2, do_sample=False)


def test_num_return_sequences_reaching_the_loop_itself(target, inputs):
    """Called directly, the loop cannot repeat prompts (that happens in `hf_dynspec.generate`); it says where to go."""
    config = GenerationConfig(max_length=20, do_sample=True, num_return_sequences=2)
    with pytest.raises(ValueError, match="num_return_sequences=2 cannot reach the speculative loop.*hf_dynspec.generate"):
        hf_dynspec.speculative_loop(target, inputs["input_ids"], [], [], config, assistant_model=target)


def test_static_cache(target, inputs):
    with pytest.raises(ValueError, match="StaticCache.*dynamic KV cache"):
        run(target, inputs, assistant_model=target, cache_implementation="static")
    cache = StaticCache(config=target.config, max_cache_len=64)
    with pytest.raises(ValueError, match="StaticCache"):
        run(target, inputs, assistant_model=target, **{cache_kwarg(target.forward): cache})  # as generate takes it


def test_use_cache_false(target, inputs):
    with pytest.raises(ValueError, match="use_cache=False"):
        run(target, inputs, assistant_model=target, use_cache=False)


def test_model_without_dynamic_cache_support(target, inputs):
    class NoCacheModel(type(target)):
        _supports_default_dynamic_cache = classmethod(lambda cls: False)

    model = NoCacheModel(target.config).to(torch.float64).eval()
    with pytest.raises(ValueError, match="does not support transformers' dynamic KV cache"):
        hf_dynspec.speculative_loop(
            model, inputs["input_ids"], [], [], GenerationConfig(max_length=20), assistant_model=target
        )


def test_right_padding(target):
    ids = torch.tensor([[5, 6, 7, 0], [5, 6, 7, 8]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    with pytest.raises(ValueError, match="Right padding.*padding_side='left'"):
        run(target, {"input_ids": ids, "attention_mask": mask}, assistant_model=target)


def test_negative_lengths(target, inputs):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        DynSpecConfig(num_speculative_tokens=-1)
    with pytest.raises(ValueError, match="`prompt_lookup_max_tokens` must be an integer >= 1"):
        DynSpecConfig(prompt_lookup_max_tokens=0)

    class Negative(DraftLengthPolicy):
        def draft_lengths(self, request):
            return torch.full((request.batch_size,), -2)

    with pytest.raises(ValueError, match="returned draft lengths .* non-negative"):
        run(target, inputs, assistant_model=target, dynspec_policy=Negative())


def test_stateful_draft(target, inputs):
    class Stateful(type(target)):
        _is_stateful = True

    stateful = Stateful(target.config).to(torch.float64).eval()
    with pytest.raises(ValueError, match="stateful"):
        hf_dynspec.speculative_loop(
            target, inputs["input_ids"], [], [], GenerationConfig(max_length=20), assistant_model=stateful
        )


def test_no_proposer(target, inputs):
    with pytest.raises(ValueError, match="needs a proposer"):
        hf_dynspec.speculative_loop(target, inputs["input_ids"], [], [], GenerationConfig(max_length=20))


def test_both_proposers(target, inputs):
    with pytest.raises(ValueError, match="choose one proposer"):
        hf_dynspec.generate(target, **inputs, assistant_model=target, prompt_lookup_num_tokens=3, max_new_tokens=4)


def test_unsupported_outputs(target, inputs):
    with pytest.raises(ValueError, match="output_attentions"):
        run(target, inputs, assistant_model=target, output_attentions=True, return_dict_in_generate=True)


def test_encoder_decoder_and_custom_generate_conflict(target, inputs):
    with pytest.raises(ValueError, match="custom_generate"):
        hf_dynspec.generate(target, **inputs, assistant_model=target, custom_generate=lambda *a, **k: None)


def test_bad_config_values(target, inputs):
    with pytest.raises(ValueError, match="Unknown DynSpecConfig key"):
        run(target, inputs, assistant_model=target, dynspec_config={"num_speculative_token": 3})
    with pytest.raises(ValueError, match="Unknown policy 'nope'"):
        run(target, inputs, assistant_model=target, dynspec_config=DynSpecConfig(policy="nope"))
    with pytest.raises(ValueError, match="dynspec_config"):
        run(target, inputs, assistant_model=target, dynspec_config=3)


def test_gpt2_draft_with_other_vocab(target, inputs):
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2)).eval()
    with pytest.raises(ValueError, match="vocabulary"):
        hf_dynspec.generate(target, **inputs, assistant_model=gpt2, max_new_tokens=4)


def test_config_errors_at_construction():
    with pytest.raises(ValueError, match="compact_hole_fraction"):
        DynSpecConfig(compact_hole_fraction=True)


def test_policy_name_given_as_config(target, inputs):
    with pytest.raises(ValueError, match="'static'.* path of a JSON file.*DynSpecConfig[(]policy=...[)]"):
        run(target, inputs, assistant_model=target, dynspec_config="static")


def test_assistant_model_not_a_model(target, inputs):
    with pytest.raises(ValueError, match="`assistant_model` must be a loaded transformers model, got str"):
        run(target, inputs, assistant_model="a-draft-id")


def test_prefilled_cache_for_another_batch(target, inputs):
    cache = prefix_cache(target, inputs["input_ids"][:1], inputs["attention_mask"][:1], 3)
    with pytest.raises(ValueError, match=r"prefix for 1 row\(s\), but the prompt has 2.*batch_repeat_interleave"):
        run(target, inputs, assistant_model=target, **{cache_kwarg(target.forward): cache})


def test_prefilled_cache_holding_the_whole_prompt(target, inputs):
    cache = prefix_cache(target, inputs["input_ids"], inputs["attention_mask"], 6)
    with pytest.raises(ValueError, match="already holds 6 tokens, but the prompt has 6.*at least one token after"):
        run(target, inputs, assistant_model=target, **{cache_kwarg(target.forward): cache})


def test_prefilled_cache_of_a_sliding_window_target(inputs):
    model = tiny_model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0)  # every layer slides
    cache = prefix_cache(model, inputs["input_ids"], inputs["attention_mask"], 3)
    with pytest.raises(ValueError, match="already holds 3 tokens, and the target has sliding-window attention"):
        run(model, inputs, assistant_model=model, **{cache_kwarg(model.forward): cache})


def test_pad_token_outside_the_vocabulary(target, inputs):
    vocab = target.config.vocab_size
    with pytest.raises(ValueError, match=f"pad_token_id={vocab + 5} is not a token .*0 to {vocab - 1}"):
        run(target, inputs, assistant_model=target, pad_token_id=vocab + 5, eos_token_id=None)


def test_classifier_free_guidance(target, inputs):
    with pytest.raises(ValueError, match="UnbatchedClassifierFreeGuidanceLogitsProcessor.*guidance_scale"):
        run(target, inputs, assistant_model=target, guidance_scale=1.5)


def test_assistant_early_exit(target, inputs):
    with pytest.raises(ValueError, match="assistant_early_exit=1 .* pass a separate `assistant_model`"):
        hf_dynspec.generate(target, **inputs, assistant_model=target, assistant_early_exit=1, max_new_tokens=5)


def test_assistant_ensemble_weight(target, inputs):
    with pytest.raises(ValueError, match="assistant_ensemble_weight=0.5 asks for a lossy ensemble"):
        hf_dynspec.generate(
            target, **inputs, assistant_model=target, assistant_ensemble_weight=0.5, do_sample=True, max_new_tokens=5
        )


def test_assisted_draft_length_settings_warn(target, inputs, caplog):
    """transformers' draft-length settings do not apply: a warning names the ones given, the defaults stay silent."""
    with caplog.at_level("WARNING", logger="hf_dynspec.validation"):
        hf_dynspec.generate(target, **inputs, assistant_model=target, max_new_tokens=3)
    assert not [r for r in caplog.records if r.name == "hf_dynspec.validation"]
    with caplog.at_level("WARNING", logger="hf_dynspec.validation"):
        out = hf_dynspec.generate(
            target,
            **inputs,
            assistant_model=target,
            max_new_tokens=3,
            num_assistant_tokens=7,
            num_assistant_tokens_schedule="heuristic",
        )
    messages = [r.getMessage() for r in caplog.records if r.name == "hf_dynspec.validation"]
    assert len(messages) == 1
    assert messages[0].startswith("num_assistant_tokens=7, num_assistant_tokens_schedule='heuristic': transformers'")
    assert "DynSpecConfig.num_speculative_tokens" in messages[0]
    plain = target.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert torch.equal(out, plain)
