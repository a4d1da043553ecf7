"""`DynSpecConfig` stored in a transformers `GenerationConfig` survives `save_pretrained` / `from_pretrained`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from hf_dynspec.config import GENERATION_CONFIG_KEY, DynSpecConfig

# A non-default value for every field: the round trip must carry each one.
NON_DEFAULT = {
    "num_speculative_tokens": 7,
    "policy": "custom-policy-name",
    "policy_options": {"alpha": 0.5, "window": 3, "nested": {"flag": True}},
    "proposer": "hybrid",
    "tree_node_budget": 6,
    "tree_branching": 3,
    "tree_stop_judges": "tree",
    "tree_min_node_probability": 0.05,
    "prompt_lookup_max_ngram": 5,
    "prompt_lookup_min_ngram": 2,
    "prompt_lookup_max_tokens": 6,
    "suffix_max_depth": 12,
    "suffix_cache_outputs": 32,
    "suffix_cache_tokens": 4096,
    "suffix_min_token_probability": 0.2,
    "suffix_spec_factor": 2.0,
    "draft_lookahead": 0,
    "draft_lookahead_max_cost": None,
    "prefill_draft_confidence": 0.3,
    "draft_vocab_size": None,
    "sampling": "coupled",
    "seed": 17,
    "coupling_keys": "position",
    "draft_head": "org/eagle3-head",
    "reuse_rollouts": True,
    "rollout_cache_samples": 64,
    "rollout_cache_tokens": 8192,
    "narrow_linear": "off",
    "packed_verify": False,
    "fold_attention": False,
    "compact_min_holes": 9,
    "compact_hole_fraction": 0.5,
    "collect_step_stats": False,
}


def test_non_default_values_cover_every_field() -> None:
    fields = {f.name for f in dataclasses.fields(DynSpecConfig)}
    assert set(NON_DEFAULT) == fields, "add the new DynSpecConfig field to NON_DEFAULT"
    defaults = DynSpecConfig()
    for name, value in NON_DEFAULT.items():
        assert getattr(defaults, name) != value, name


def test_round_trip_through_generation_config_files(tmp_path: Path) -> None:
    config = DynSpecConfig(**NON_DEFAULT)
    generation_config = config.to_generation_config(GenerationConfig(max_new_tokens=12, do_sample=False))
    generation_config.save_pretrained(tmp_path)

    saved = json.loads((tmp_path / "generation_config.json").read_text())
    assert saved[GENERATION_CONFIG_KEY] == NON_DEFAULT
    assert saved["max_new_tokens"] == 12

    loaded = GenerationConfig.from_pretrained(tmp_path)
    assert DynSpecConfig.from_generation_config(loaded) == config
    assert loaded.max_new_tokens == 12


def test_round_trip_through_model_save_pretrained(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    )
    config = DynSpecConfig(**NON_DEFAULT)
    config.to_generation_config(model.generation_config)
    model.save_pretrained(tmp_path)

    reloaded = LlamaForCausalLM.from_pretrained(tmp_path)
    assert DynSpecConfig.from_generation_config(reloaded.generation_config) == config


def test_settings_survive_generate_config_preparation() -> None:
    """`generate` merges the model's generation config into the one it runs with; the settings must come along."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    )
    config = DynSpecConfig(num_speculative_tokens=2)
    config.to_generation_config(model.generation_config)
    prepared, _ = model._prepare_generation_config(GenerationConfig(max_new_tokens=3))
    assert DynSpecConfig.from_generation_config(prepared) == config


def test_partial_settings_take_defaults() -> None:
    generation_config = GenerationConfig()
    setattr(generation_config, GENERATION_CONFIG_KEY, {"num_speculative_tokens": 2})
    assert DynSpecConfig.from_generation_config(generation_config) == DynSpecConfig(num_speculative_tokens=2)


def test_absent_key_gives_none() -> None:
    assert DynSpecConfig.from_generation_config(GenerationConfig()) is None
    assert DynSpecConfig.from_generation_config(None) is None


def test_config_object_under_the_key_is_returned() -> None:
    generation_config = GenerationConfig()
    config = DynSpecConfig(num_speculative_tokens=3)
    setattr(generation_config, GENERATION_CONFIG_KEY, config)
    assert DynSpecConfig.from_generation_config(generation_config) is config


def test_unknown_key_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({GENERATION_CONFIG_KEY: {"num_speculative_token": 3}}))
    loaded = GenerationConfig.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"Invalid `dynspec` entry.*num_speculative_token.*valid keys"):
        DynSpecConfig.from_generation_config(loaded)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_speculative_tokens", -1, "num_speculative_tokens"),
        ("num_speculative_tokens", 2.5, "num_speculative_tokens"),
        ("compact_hole_fraction", 0.0, "compact_hole_fraction"),
        ("collect_step_stats", "yes", "collect_step_stats"),
        ("policy", "", "policy"),
        ("policy_options", [1, 2], "policy_options"),
        ("prompt_lookup_min_ngram", 0, "prompt_lookup_min_ngram"),
    ],
)
def test_invalid_value_is_rejected(tmp_path: Path, field: str, value: object, message: str) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({GENERATION_CONFIG_KEY: {field: value}}))
    loaded = GenerationConfig.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"Invalid `dynspec` entry.*`{message}`"):
        DynSpecConfig.from_generation_config(loaded)


def test_entry_that_is_not_a_dict_is_rejected() -> None:
    generation_config = GenerationConfig()
    setattr(generation_config, GENERATION_CONFIG_KEY, 4)
    with pytest.raises(ValueError, match="must be a dict of DynSpecConfig settings, got int"):
        DynSpecConfig.from_generation_config(generation_config)


def test_writing_into_something_else_is_rejected() -> None:
    with pytest.raises(ValueError, match="expects a transformers GenerationConfig, got dict"):
        DynSpecConfig().to_generation_config({})  # type: ignore[arg-type]
