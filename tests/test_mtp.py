"""The target's own MTP layers as a draft head (`hf_dynspec.mtp`): exact output in both engines, the state it reads,
and clear errors."""

from __future__ import annotations

import pytest
import torch
from conftest import left_padded_prompts
from test_eagle3 import check_reads, record_reads
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Glm4MoeConfig, Glm4MoeForCausalLM, LlamaConfig

import hf_dynspec
from hf_dynspec import DynSpecConfig
from hf_dynspec.eagle3 import HeadLoadError
from hf_dynspec.mtp import MtpHead

SMALL = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
    num_attention_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
    max_position_embeddings=256, eos_token_id=1, pad_token_id=0, n_group=1, topk_group=1, num_nextn_predict_layers=1,
)
FAMILIES = {
    "deepseek_v3": lambda: DeepseekV3ForCausalLM(DeepseekV3Config(
        **SMALL, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
        num_key_value_heads=4,
    )),
    "glm4_moe": lambda: Glm4MoeForCausalLM(Glm4MoeConfig(**SMALL, head_dim=8, num_key_value_heads=2)),
}


def tiny_target(family: str, seed: int = 0):
    torch.manual_seed(seed)
    return FAMILIES[family]().eval()


def generate(target, head, ids, mask, new=20, **config):
    return target.generate(
        ids, attention_mask=mask, max_new_tokens=new, do_sample=False, assistant_model=head,
        custom_generate=hf_dynspec.speculative_loop, return_dict_in_generate=True, dynspec_config=DynSpecConfig(**config),
    )


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize(("lengths", "proposer", "k"), [([9, 4, 12], "draft", 3), ([7], "auto", 5)])
def test_greedy_tokens_match_plain_decoding(family, lengths, proposer, k):
    target = tiny_target(family)
    head = MtpHead.random(target)
    ids, mask = left_padded_prompts(lengths, vocab=96, seed=k)
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    out = generate(target, head, ids, mask, proposer=proposer, policy="static", num_speculative_tokens=k)
    assert torch.equal(out.sequences, plain)
    assert out.dynspec_stats.draft_forwards > 0


def test_the_mtp_layer_reads_the_targets_last_hidden_state(monkeypatch):
    """Below a row's committed tokens the MTP layer reads what transformers hands its own MTP loop: the target's
    `output_hidden_states[-1]` at the position before."""
    target = tiny_target("glm4_moe", seed=1)
    head = MtpHead.random(target)
    ids, mask = left_padded_prompts([6, 10], vocab=96, seed=2)
    seen = record_reads(monkeypatch)
    sequences = generate(target, head, ids, mask, proposer="draft", policy="static", num_speculative_tokens=3, new=10).sequences
    real = torch.cat([mask, torch.ones_like(sequences[:, mask.shape[1] :])], 1)
    with torch.no_grad():
        positions = (real.cumsum(-1) - 1).clamp(min=0)
        last = target(sequences, attention_mask=real, position_ids=positions, output_hidden_states=True).hidden_states[-1]
    assert check_reads(seen, mask, last, tolerance=1e-5) > 10


def test_continuous_batching_with_mtp_gives_plain_tokens():
    from test_continuous import cb_config, greedy, run, speculating

    target = tiny_target("glm4_moe", seed=3)
    head = MtpHead.random(target)
    prompts = [left_padded_prompts([n], vocab=96, seed=n)[0][0].tolist() for n in (5, 9, 13)]
    expected = [target.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
    expected = [tokens[: tokens.index(1) + 1] if 1 in tokens else tokens for tokens in expected]
    config = DynSpecConfig(num_speculative_tokens=3, policy="static", proposer="draft")
    manager = speculating(target, generation_config=greedy(20), cb=cb_config(8, max_batch_tokens=64),
                          dynspec_config=config, assistant_model=head)
    try:
        got = list(run(manager, prompts, 20).values())
    finally:
        manager.stop(block=True)
    assert got == expected
    assert manager.speculation.draft_tokens > 0


def test_a_target_without_mtp_layers_or_another_target_is_refused():
    from transformers import LlamaForCausalLM

    plain = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(HeadLoadError, match="declares no MTP layers"):
        MtpHead.from_target(plain)
    target, other = tiny_target("glm4_moe", seed=1), tiny_target("glm4_moe", seed=2)
    ids, mask = left_padded_prompts([5], vocab=96, seed=1)
    with pytest.raises(HeadLoadError, match="belongs to another"):
        generate(target, MtpHead.random(other), ids, mask)


def checkpoint_with_mtp(folder, seed: int = 4) -> dict[str, torch.Tensor]:
    """A GLM-4.5-Air-shaped checkpoint (46 decoder layers; transformers finds MTP weights by that layer count) of
    tiny width, its MTP layer stored as the released checkpoints store it: the decoder layer `model.layers.46.*`
    with unfused experts, and `enorm`, `hnorm`, `eh_proj` and `shared_head.norm` beside it. Returns those weights."""
    from safetensors.torch import load_file, save_file

    config = dict(SMALL, num_hidden_layers=46)
    torch.manual_seed(seed)
    Glm4MoeForCausalLM(Glm4MoeConfig(**config, head_dim=8, num_key_value_heads=2)).save_pretrained(folder)
    torch.manual_seed(seed + 1)
    deeper = Glm4MoeForCausalLM(Glm4MoeConfig(**dict(config, num_hidden_layers=47), head_dim=8, num_key_value_heads=2))
    deeper.save_pretrained(folder / "deeper")
    weights = load_file(folder / "model.safetensors")
    mtp = {k: v for k, v in load_file(folder / "deeper" / "model.safetensors").items() if k.startswith("model.layers.46.")}
    width = SMALL["hidden_size"]
    for name, shape in (("enorm", [width]), ("hnorm", [width]), ("shared_head.norm", [width]), ("eh_proj", [width, 2 * width])):
        mtp[f"model.layers.46.{name}.weight"] = torch.randn(shape)
    save_file({**weights, **mtp}, folder / "model.safetensors", metadata={"format": "pt"})
    return {**mtp, "fused_gate_up": deeper.model.layers[46].mlp.experts.gate_up_proj.detach()}


def test_mtp_weights_load_from_the_targets_checkpoint(tmp_path):
    """The MTP layer of a checkpoint laid out as released ones are is what the head drafts with, and greedy output
    with it (named as `draft_head="mtp"`) is plain decoding's."""
    stored = checkpoint_with_mtp(tmp_path)
    target = Glm4MoeForCausalLM.from_pretrained(tmp_path).eval()
    head = MtpHead.from_target(target)
    layer = head.mtp.layers[0]
    for ours, theirs in ((layer.eh_proj, "eh_proj"), (layer.enorm, "enorm"), (layer.hnorm, "hnorm"),
                         (layer.post_norm, "shared_head.norm"), (layer.mtp_block.self_attn.q_proj, "self_attn.q_proj")):
        assert torch.equal(ours.weight, stored[f"model.layers.46.{theirs}.weight"]), theirs
    assert torch.equal(layer.mtp_block.mlp.experts.gate_up_proj, stored["fused_gate_up"])
    ids, mask = left_padded_prompts([7, 3], vocab=96, seed=5)
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    ours = generate(target, None, ids, mask, new=16, draft_head="mtp", proposer="draft", policy="static",
                    num_speculative_tokens=3)
    assert ours.sequences.tolist() == plain.tolist()
    assert ours.dynspec_stats.draft_tokens > 0
