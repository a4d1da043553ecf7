"""EAGLE-3 heads in both published formats load and compute what the reference package (`speculators` 0.9.0)
computes: the fixtures in tests/fixtures/heads were written with it (`scripts/make_head_fixtures.py`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, DynamicCache

from hf_dynspec.eagle3 import Eagle3Head, HeadLoadError

FIXTURES = Path(__file__).parent / "fixtures" / "heads"
CASES = {  # case -> its verifier's folder
    "llama-speculators": FIXTURES / "llama-speculators" / "verifier",
    "qwen2-speculators": FIXTURES / "qwen2-speculators" / "verifier",
    "llama-specforge": FIXTURES / "llama-speculators" / "verifier",
}
TOLERANCE = dict(rtol=1e-4, atol=1e-5)
"""float32 throughout; the reference used 1-based positions and eager attention, which move logits by ~1e-6."""


def load(case: str) -> tuple[Eagle3Head, torch.nn.Module, dict[str, torch.Tensor]]:
    verifier = AutoModelForCausalLM.from_pretrained(CASES[case], dtype=torch.float32).eval()
    head = Eagle3Head.from_pretrained(FIXTURES / case / "head")
    head.bind(verifier)
    return head, verifier, load_file(FIXTURES / case / "reference.safetensors")


def step_zero(head: Eagle3Head, reference: dict[str, torch.Tensor], cache=None) -> torch.Tensor:
    """The head's last-layer states over the reference's positions (`[1, T, hidden]`), from its auxiliary states."""
    aux = reference["aux_hidden_states"]  # [1, T, num_aux * target_hidden]
    states = head.fuse(list(aux.chunk(len(head.aux_layer_ids(0) or [0, 0, 0]), dim=-1)))
    ids = reference["draft_input_ids"]
    positions = reference["position_ids"]
    embeds = head.get_input_embeddings()(ids)
    return head.step(embeds, states, positions, None, cache)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_verifiers_states_at_the_heads_layers_are_the_references(case):
    head, verifier, reference = load(case)
    with torch.no_grad():
        hidden = verifier(reference["input_ids"], output_hidden_states=True).hidden_states
    layers = head.aux_layer_ids(verifier.config.num_hidden_layers)
    torch.testing.assert_close(torch.cat([hidden[i] for i in layers], -1), reference["aux_hidden_states"], **TOLERANCE)


@pytest.mark.parametrize("case", sorted(CASES))
def test_first_step_logits_match_the_reference(case):
    head, _, reference = load(case)
    with torch.no_grad():
        logits = head.draft_logits(step_zero(head, reference))  # [1, T, draft_vocab]
    torch.testing.assert_close(logits, reference["step0_logits"], **TOLERANCE)
    assert torch.equal(head.target_ids[logits.argmax(-1)], reference["step0_target_argmax"])


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_chain_drafted_through_the_cache_is_the_references(case):
    """Drafting token by token through a KV cache, each token reading the head's own state before it, gives the
    chain the reference computed by recomputing the whole sequence each step."""
    head, _, reference = load(case)
    cache = DynamicCache(config=head.config)
    chain = []
    with torch.no_grad():
        out = step_zero(head, reference, cache)  # [1, T, hidden]
        position = reference["position_ids"][:, -1:]
        for _ in range(reference["chain_tokens"].shape[0]):
            token = head.target_ids[head.draft_logits(out[:, -1:]).argmax(-1)]  # [1, 1]
            chain.append(int(token))
            position = position + 1
            out = head.step(head.get_input_embeddings()(token), out[:, -1:], position, None, cache)
    assert chain == reference["chain_tokens"].tolist()


def test_both_formats_read_the_same_settings():
    head = Eagle3Head.from_pretrained(FIXTURES / "llama-specforge" / "head")
    converted = json.loads((FIXTURES / "llama-specforge" / "converted_config.json").read_text())
    assert head.settings.source_format == "specforge"
    assert head.settings.draft_vocab_size == converted["draft_vocab_size"]
    assert head.config.hidden_size == converted["transformer_layer_config"]["hidden_size"]


def test_a_folder_without_a_config_is_refused(tmp_path):
    with pytest.raises(HeadLoadError, match="no config.json"):
        Eagle3Head.from_pretrained(tmp_path)


def test_a_head_named_in_the_generation_config_round_trips_and_drafts(tmp_path):
    """`DynSpecConfig(draft_head=...)` in a saved generation config: the loop loads the head once per target and
    drafts with it, giving plain decoding's tokens."""
    from transformers import GenerationConfig

    import hf_dynspec
    from hf_dynspec import DynSpecConfig

    verifier = AutoModelForCausalLM.from_pretrained(CASES["llama-speculators"], dtype=torch.float32).eval()
    config = GenerationConfig(max_new_tokens=16, do_sample=False, pad_token_id=0)
    DynSpecConfig(draft_head=str(FIXTURES / "llama-speculators" / "head"), policy="static").to_generation_config(config)
    config.save_pretrained(tmp_path)
    loaded = GenerationConfig.from_pretrained(tmp_path)
    ids = load_file(FIXTURES / "llama-speculators" / "reference.safetensors")["input_ids"]
    plain = verifier.generate(ids, generation_config=GenerationConfig(max_new_tokens=16, do_sample=False, pad_token_id=0))
    outputs = [hf_dynspec.generate(verifier, input_ids=ids, generation_config=loaded, return_dict_in_generate=True)
               for _ in range(2)]
    for out in outputs:
        assert torch.equal(out.sequences, plain)
        assert out.dynspec_stats.draft_forwards > 0
    assert len(verifier._hf_dynspec_heads) == 1  # loaded once, kept with the target
