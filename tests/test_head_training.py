"""Training EAGLE-3 heads (`hf_dynspec.head_training`, `hf-dynspec train-head`): the training-time test reproduces
`speculators`' unrolling, training learns the target, and the saved folder loads, fits and drafts exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import left_padded_prompts, tiny_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import hf_dynspec
from hf_dynspec import DynSpecConfig
from hf_dynspec.cli import main
from hf_dynspec.eagle3 import Eagle3Head
from hf_dynspec.evaluation.data import random_token_prompts
from hf_dynspec.head_saving import save_head
from hf_dynspec.head_training import (
    AuxStates,
    HeadTrainingSettings,
    default_aux_layer_ids,
    draft_vocabulary,
    evaluate_head,
    new_head,
    self_distill,
    target_batch,
    train_head,
    ttt_mask,
    unroll,
)

HEADS = Path(__file__).resolve().parent / "fixtures" / "heads"
VOCAB = 96


@pytest.mark.parametrize("case", ["llama-speculators", "qwen2-speculators"])
def test_the_unrolling_reproduces_speculators_training_time_test(case):
    """`unroll` gives the logits of `Eagle3DraftModel.forward(..., ttt_steps=3)` (speculators 0.9.0) at every step,
    and `AuxStates` reads the verifier's states at the head's layers as the reference did."""
    reference = load_file(HEADS / case / "reference.safetensors")
    target = AutoModelForCausalLM.from_pretrained(HEADS / case / "verifier", dtype=torch.float32).eval()
    head = Eagle3Head.from_pretrained(HEADS / case / "head")
    head.bind(target)
    ids = reference["input_ids"]
    tap = AuxStates(target, head.aux_layer_ids(target.config.num_hidden_layers))
    try:
        aux, _ = target_batch(target, tap, ids, torch.ones_like(ids), head.target_ids)
    finally:
        tap.remove()
    torch.testing.assert_close(torch.cat(aux, -1), reference["aux_hidden_states"], atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        states = head.fuse(list(reference["aux_hidden_states"].chunk(len(aux), -1)))
        draft_ids = reference["draft_input_ids"]
        steps = list(unroll(head, states, draft_ids, torch.ones_like(draft_ids, dtype=torch.bool), 3))
    assert len(steps) == 3
    for step, logits in enumerate(steps):
        torch.testing.assert_close(logits, reference["ttt_logits"][step], atol=1e-4, rtol=1e-4)


def test_the_mask_lets_step_k_see_step_0_causally_and_later_steps_on_the_diagonal():
    valid = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    mask = ttt_mask(valid, 2)[0, 0]  # [4, 12]
    assert mask.shape == (4, 12)
    first, second, third = mask[:, :4], mask[:, 4:8], mask[:, 8:]
    assert torch.equal(first[:3, :3], torch.ones(3, 3, dtype=torch.bool).tril())
    assert not first[:3, 3].any() and first[3, 3]  # padding keys are not seen; a padding query sees itself
    assert torch.equal(second, torch.eye(4, dtype=torch.bool)) and torch.equal(third, torch.eye(4, dtype=torch.bool))


def test_the_draft_vocabulary_takes_the_special_ids_and_the_most_frequent_tokens():
    ids = draft_vocabulary([[5, 5, 5, 7, 7, 9], [7, 11]], vocab_size=20, draft_vocab_size=4, always=[1, 1, 0])
    assert ids.tolist() == [0, 1, 5, 7]
    assert draft_vocabulary([[3]], 20, 4).tolist() == [0, 1, 2, 3]  # filled up with the lowest unused ids
    assert draft_vocabulary([[3]], 20, 32).tolist() == list(range(20))
    assert default_aux_layer_ids(28) == [2, 14, 25]
    assert default_aux_layer_ids(2) == [0, 1, 2]


def token_target() -> torch.nn.Module:
    """A tiny target whose next token depends on the current token only (attention outputs zeroed): a head learns it
    within a few dozen steps."""
    target = tiny_model("llama", seed=0, dtype=torch.float32, num_hidden_layers=3)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    return target


@pytest.fixture(scope="module")
def trained():
    """`(target, head, log, before, after)`: a head trained for `token_target`, and its held-out metrics before and
    after training."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is fastest, and much faster on a busy machine
    try:
        return _train()
    finally:
        torch.set_num_threads(threads)


def _train():
    torch.manual_seed(0)
    target = token_target()
    data = random_token_prompts(48, VOCAB, 16, 32, seed=0, low=3)
    held_out = random_token_prompts(16, VOCAB, 16, 32, seed=1, low=3)
    settings = HeadTrainingSettings(draft_vocab_size=64, batch_size=8, epochs=24, learning_rate=2e-2, max_length=32)
    untrained = new_head(target, draft_vocabulary(data, VOCAB, 64, [0, 1, 2]), settings)
    before = evaluate_head(untrained, target, held_out)
    head, log = train_head(target, data, settings, progress=False)
    after = evaluate_head(head, target, held_out)
    return target, head, log, before, after


def test_training_lowers_the_loss_and_raises_agreement_with_the_target(trained):
    _, head, log, before, after = trained
    assert log.steps == log.planned_steps == 144 and log.stopped_by == "finished"
    first, last = log.records[0], log.records[-1]
    assert last["loss"] < 0.2 * first["loss"]
    assert after["loss"] < 0.2 * before["loss"]  # on held-out sequences
    assert max(before["accuracy"]) < 0.1 < 0.5 < min(after["accuracy"])
    assert after["acceptance"][1] > 0.35  # chains of two tokens: the head drafts from its own states
    assert all(a >= b for a, b in zip(after["acceptance"], after["acceptance"][1:]))


def test_the_saved_head_loads_binds_and_drafts_the_targets_greedy_output(trained, tmp_path):
    target, head, _, _, _ = trained
    folder = save_head(head, tmp_path / "head", target, verifier="tiny-token-target", speculative_tokens=3)
    config = json.loads((folder / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3DraftModel"]
    assert config["transformer_layer_config"]["model_type"] == "llama"
    assert config["transformer_layer_config"]["vocab_size"] == VOCAB
    assert config["draft_vocab_size"] == 64 and config["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]
    for key in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "target_hidden_size",
                "speculators_version"):
        assert key in config
    speculators = config["speculators_config"]
    assert speculators["algorithm"] == "eagle3" and speculators["default_proposal_method"] == "greedy"
    assert speculators["proposal_methods"][0]["speculative_tokens"] == 3
    assert speculators["verifier"] == {"name_or_path": "tiny-token-target", "architectures": ["LlamaForCausalLM"]}
    weights = load_file(folder / "model.safetensors")
    assert "embed_tokens.weight" not in weights and "input_norm.weight" in weights
    assert weights["t2d"].dtype == torch.bool and int(weights["t2d"].sum()) == 64
    assert torch.equal(torch.arange(64) + weights["d2t"], weights["t2d"].nonzero().squeeze(1))

    loaded = Eagle3Head.from_pretrained(folder)
    loaded.bind(target)
    for name, tensor in head.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor)
    ids, mask = left_padded_prompts([7, 12, 4], seed=3)
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    out = target.generate(
        ids, attention_mask=mask, max_new_tokens=20, do_sample=False, assistant_model=loaded,
        custom_generate=hf_dynspec.speculative_loop, return_dict_in_generate=True,
        dynspec_config=DynSpecConfig(proposer="draft", policy="static", num_speculative_tokens=3),
    )
    assert torch.equal(out.sequences, plain)
    stats = out.dynspec_stats
    assert stats.accepted_tokens > 0.4 * stats.draft_tokens > 0  # the trained head drafts what the target says


def test_the_command_trains_a_tiny_head_within_its_time_budget(tmp_path):
    out = tmp_path / "tiny-head"
    code = main(["train-head", "--tiny", "--out", str(out), "--minutes", "0.05", "--max-samples", "24",
                 "--max-length", "24", "--epochs", "1000", "--draft-vocab-size", "128", "--eval-samples", "4", "--self-distill", "0",
                 "--quiet"])
    assert code == 0
    assert {"config.json", "model.safetensors", "training.json", "training.png"} <= {p.name for p in out.iterdir()}
    log = json.loads((out / "training.json").read_text())
    assert log["stopped_by"] == "time budget" and 0 < log["steps"] < log["planned_steps"]
    assert log["settings"]["minutes"] == 0.05 and log["settings"]["ttt_steps"] == 3
    assert {"torch", "transformers", "hf_dynspec"} <= set(log["versions"])
    assert len(log["records"]) == log["steps"] and len(log["records"][-1]["acceptance"]) == 3
    assert len(log["held_out"]["accuracy"]) == 3
    head = Eagle3Head.from_pretrained(out)
    assert head.settings.draft_vocab_size == 128 and head.settings.aux_layer_ids == [0, 1, 2]


def test_a_bfloat16_target_trains_the_float32_head_under_bfloat16_autocast():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target = token_target().to(torch.bfloat16)
        data = random_token_prompts(16, VOCAB, 12, 20, seed=2, low=3)
        settings = HeadTrainingSettings(draft_vocab_size=64, batch_size=8, epochs=4, learning_rate=2e-2)
        head, log = train_head(target, data, settings, progress=False)
    finally:
        torch.set_num_threads(threads)
    assert {p.dtype for p in head.parameters()} == {torch.float32}
    assert log.steps == 8 and log.records[-1]["loss"] < log.records[0]["loss"]


def test_the_command_refuses_a_negative_prompt_offset(tmp_path):
    with pytest.raises(ValueError, match="--prompt-offset must be >= 0"):
        main(["train-head", "--tiny", "--out", str(tmp_path / "head"), "--prompt-offset", "-1", "--quiet"])


def test_self_distillation_appends_the_targets_own_greedy_answer():
    """Batched and left-padded, each prompt gets what the target alone generates after it, up to its EOS."""
    target = tiny_model("llama", seed=2, dtype=torch.float32, num_hidden_layers=2)
    prompts = random_token_prompts(5, target.config.vocab_size, 3, 11, seed=4, low=2)
    out = self_distill(target, prompts, new_tokens=12, pad_id=0, batch_size=3, progress=False)
    eos = target.generation_config.eos_token_id
    for prompt, sequence in zip(prompts, out):
        alone = target.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0].tolist()
        if eos in alone[len(prompt) :]:
            alone = alone[: alone.index(eos, len(prompt)) + 1]
        assert sequence == alone
