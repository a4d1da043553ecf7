"""Write the EAGLE-3 draft-head reference fixtures under ``tests/fixtures/heads/``.

The fixtures are produced with the reference implementation, the ``speculators``
package (version 0.9.0), so that a loader written later can be checked against
them. ``speculators`` pins ``transformers<=5.19``, so it must not go into the
project's Python; run this script with a throw-away virtual environment::

    python3 -m venv /tmp/specvenv
    /tmp/specvenv/bin/pip install torch==2.13.0 speculators==0.9.0
    # speculators 0.9.0 also pulls CUDA builds of torchvision/torchaudio, which
    # break ``import transformers`` next to a CPU torch; nothing here needs them:
    /tmp/specvenv/bin/pip uninstall -y torchvision torchaudio
    cd <repository root> && /tmp/specvenv/bin/python scripts/make_head_fixtures.py

Everything is float32, seeded and run on the CPU, so a rerun writes the same
tensors. Three cases are written (see ``tests/fixtures/heads/README.md``):

* ``llama-speculators``: tiny random ``LlamaForCausalLM`` verifier plus a random
  EAGLE-3 head in the speculators layout, with the trainer's defaults for new
  eagle3 heads (``norm_before_residual``, ``norm_before_fc`` and ``norm_output``
  all true, draft layers marked ``sliding_attention`` with window 2048) and the
  package's default auxiliary layer ids.
* ``qwen2-speculators``: tiny random ``Qwen2ForCausalLM`` verifier (attention
  bias on) plus a two-layer head with a llama ``transformer_layer_config`` (what
  the trainer builds for eagle3 heads of any verifier), all norm flags false,
  explicit auxiliary layer ids.
* ``llama-specforge``: a random head in the SpecForge / original EAGLE-3 layout
  (``LlamaForCausalLMEagle3``, ``midlayer.*``) for the llama verifier above,
  converted with the package's own ``Eagle3Converter``; its references come
  from the converted model.

Conventions found in the package and in vLLM, and recorded in each
``reference.json``:

* Layer id ``L`` of ``eagle_aux_hidden_state_layer_ids`` is the *input* of
  decoder layer ``L`` (vLLM captures ``hidden_states + residual`` before running
  layer ``L``), i.e. transformers' ``output_hidden_states[L]``: offset 0. Id 0
  is the embedding output; id ``num_hidden_layers`` is the final pre-norm
  output (transformers' last ``hidden_states`` entry is post-norm, so it differs
  there). Default ids: ``[2, n // 2, n - 3]``.
* The head at position ``t`` sees the aux hidden state of position ``t`` and
  the embedding of token ``t + 1`` (``shift_batch``); the last position gets the
  verifier's next token. Training positions are ``1 + arange(T)``.
* Draft ids map to target ids as ``target = draft + d2t[draft]``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from speculators.convert.eagle.eagle3_converter import Eagle3Converter
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.models.utils import resolve_target_layer_ids
from speculators.train.cli import create_transformer_layer_config
from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
from torch import nn
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

ROOT = Path("tests/fixtures/heads")
HIDDEN = 24
HEADS = 3
KV_HEADS = 1
INTERMEDIATE = 40
TARGET_VOCAB = 256
DRAFT_VOCAB = 96
ALWAYS_IN_DRAFT = 8  # target ids 0..7 are always in the draft vocabulary
SEQ_LEN = 12
CHAIN_LEN = 4
TTT_STEPS = 3
WEIGHT_STD = 0.2
ATOL = 1e-5


@dataclass(frozen=True)
class Case:
    """One speculators-format fixture: verifier shape plus head settings."""

    name: str
    verifier_type: str
    verifier_layers: int
    aux_layer_ids: list[int] | None
    draft_layers: int
    full_attention_indices: list[int]
    norm_before_residual: bool
    norm_before_fc: bool
    norm_output: bool
    seed: int


LLAMA = Case("llama-speculators", "llama", 7, None, 1, [], True, True, True, 1)
QWEN2 = Case("qwen2-speculators", "qwen2", 4, [1, 2, 3], 2, [0, 1], False, False, False, 2)
SPECFORGE_NAME = "llama-specforge"
SPECFORGE_SEED = 3


def randomize_(module: nn.Module, skip: tuple[str, ...] = ()) -> None:
    """Re-draw parameters: matrices ~ N(0, 0.2), norms ~ 1 + N(0, 0.2), biases ~ N(0, 0.05)."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.startswith(skip):
                continue
            if param.ndim >= 2:
                param.normal_(0.0, WEIGHT_STD)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.05)
            else:
                param.copy_(1.0 + WEIGHT_STD * torch.randn_like(param))


def verifier_config(case: Case) -> LlamaConfig | Qwen2Config:
    """Tiny verifier config; untied embeddings so lm_head is a separate tensor."""
    common: dict[str, Any] = {
        "vocab_size": TARGET_VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": case.verifier_layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": None,
    }
    if case.verifier_type == "llama":
        return LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})


def make_verifier(case: Case, out: Path) -> PreTrainedModel:
    """Build, randomize and save the verifier (safetensors) under ``out``."""
    torch.manual_seed(case.seed)
    config = verifier_config(case)
    config._attn_implementation = "eager"  # noqa: SLF001
    model_cls = LlamaForCausalLM if case.verifier_type == "llama" else Qwen2ForCausalLM
    model = model_cls(config).to(torch.float32).eval()
    randomize_(model)
    model.save_pretrained(out)
    return model


def vocab_maps(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random draft vocabulary (always holding 0..7) through the package's builder."""
    gen = torch.Generator().manual_seed(seed)
    rest = ALWAYS_IN_DRAFT + torch.randperm(TARGET_VOCAB - ALWAYS_IN_DRAFT, generator=gen)
    chosen = list(range(ALWAYS_IN_DRAFT)) + rest[: DRAFT_VOCAB - ALWAYS_IN_DRAFT].tolist()
    freq = {tid: 1000 - rank for rank, tid in enumerate(chosen)}
    d2t, t2d = build_vocab_mappings_from_distribution(freq, DRAFT_VOCAB, TARGET_VOCAB)
    return d2t, t2d


def load_head(path: Path, layer_ids: list[int] | None = None) -> Eagle3DraftModel:
    """Reload a saved head with the package's own ``from_pretrained`` (eager attention)."""
    config = Eagle3SpeculatorConfig.from_pretrained(path)
    config.transformer_layer_config._attn_implementation = "eager"  # noqa: SLF001
    if layer_ids is not None:
        config.eagle_aux_hidden_state_layer_ids = layer_ids
    model = Eagle3DraftModel.from_pretrained(path, config=config)
    if "embed_tokens.weight" not in head_file_keys(path):
        # With transformers 5.19 a weight missing from the file is left as torch.empty
        # memory, not the NaN that load_verifier_weights tests for, so the verifier's
        # embedding is only loaded when forced (the package's own loader, overwrite on).
        model._load_verifier_weights(overwrite_embed_tokens=True)  # noqa: SLF001
    return model.to(torch.float32).eval()


def make_speculators_head(case: Case, verifier_dir: Path, head_dir: Path) -> None:
    """Build a head the way ``speculators train`` does, randomize it, save it."""
    tl_config = create_transformer_layer_config(
        verifier_name_or_path=str(verifier_dir),
        num_layers=case.draft_layers,
        draft_arch="llama",
        hidden_act="silu",
        sliding_window=2048,
        full_attention_indices=case.full_attention_indices,
    )
    d2t, t2d = vocab_maps(case.seed)
    torch.manual_seed(case.seed + 100)
    model = Eagle3DraftModel.from_training_args(
        verifier_config=tl_config,
        t2d=t2d,
        d2t=d2t,
        verifier_name_or_path=str(verifier_dir),
        target_layer_ids=case.aux_layer_ids,
        draft_vocab_size=DRAFT_VOCAB,
        norm_before_residual=case.norm_before_residual,
        norm_before_fc=case.norm_before_fc,
        norm_output=case.norm_output,
        ttt_steps=TTT_STEPS,
        draft_attn_impl="eager",
    )
    randomize_(model, skip=("embed_tokens", "verifier_lm_head", "verifier_norm"))
    model.save_pretrained(head_dir)
    # save_pretrained also copies the package's config class source (auto_map); not a fixture
    (head_dir / "config.py").unlink()


def aux_hidden_states(
    verifier: PreTrainedModel, input_ids: torch.Tensor, layer_ids: list[int]
) -> tuple[torch.Tensor, int]:
    """Inputs of the decoder layers ``layer_ids`` (vLLM's capture point) and the greedy next token."""
    captured: dict[int, torch.Tensor] = {}
    layers = verifier.model.layers

    def grab(idx: int):
        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            captured[idx] = (args[0] if args else kwargs["hidden_states"]).detach().clone()

        return hook

    handles = [layers[i].register_forward_pre_hook(grab(i), with_kwargs=True) for i in range(len(layers))]
    handles.append(verifier.model.norm.register_forward_pre_hook(grab(len(layers)), with_kwargs=True))
    with torch.no_grad():
        out = verifier(input_ids=input_ids, output_hidden_states=True)
    for handle in handles:
        handle.remove()
    for idx in range(len(layers)):  # offset 0: hidden_states[L] is the input of layer L
        assert torch.equal(out.hidden_states[idx], captured[idx]), idx
    aux = torch.cat([captured[i] for i in layer_ids], dim=-1)
    return aux, int(out.logits[0, -1].argmax())


def package_forward_logits(
    model: Eagle3DraftModel,
    aux: torch.Tensor,
    draft_ids: torch.Tensor,
    position_ids: torch.Tensor,
    ttt_steps: int,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Run the package's ``forward``; logits are captured by a hook on ``lm_head``."""
    logits: list[torch.Tensor] = []
    handle = model.lm_head.register_forward_hook(lambda _m, _i, out: logits.append(out.detach().clone()))
    with torch.no_grad():
        tokens = model(
            hidden_states=aux,
            input_ids=draft_ids,
            document_ids=torch.zeros_like(draft_ids),
            position_ids=position_ids,
            ttt_steps=ttt_steps,
        )
    handle.remove()
    return torch.stack(logits), tokens


def project_aux(model: Eagle3DraftModel, aux: torch.Tensor) -> torch.Tensor:
    """The package's input side: optional input_norm / fc_norm, then ``fc``."""
    if model.input_norm is not None:
        aux = model.input_norm(aux)
    if model.fc_norm is not None:
        chunks = aux.chunk(len(model.fc_norm), dim=-1)
        aux = torch.cat([norm(c) for norm, c in zip(model.fc_norm, chunks, strict=True)], dim=-1)
    return model.fc(aux)


def run_layers(
    model: Eagle3DraftModel, hidden: torch.Tensor, target_ids: torch.Tensor, position_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One full-causal pass of the head's layers, in the order of the package's forward.

    Returns (carried hidden state, draft logits): the carried value is the
    decoder output, passed through ``norm`` first when ``norm_output`` is set.
    """
    length = hidden.shape[1]
    causal = torch.full((length, length), float("-inf")).triu(1)[None, None]
    states = torch.cat([model.embed_tokens(target_ids), hidden], dim=-1)
    position_embeddings = model.rotary_emb(states, position_ids)
    for layer in model.layers:
        states = layer(
            states,
            attention_mask=causal,
            position_ids=position_ids,
            position_embeddings=position_embeddings,
        )
    if model.config.norm_output:
        states = model.norm(states)
        return states, model.lm_head(states)
    return states, model.lm_head(model.norm(states))


def greedy_chain(
    model: Eagle3DraftModel, aux: torch.Tensor, draft_ids: torch.Tensor, d2t: torch.Tensor
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy chain from the last position by recomputation (no KV cache); also every step's logits."""
    fc_hidden = project_aux(model, aux)
    length = draft_ids.shape[1]
    carried: list[torch.Tensor] = []
    chain: list[int] = []
    all_logits: list[torch.Tensor] = []
    with torch.no_grad():
        for step in range(CHAIN_LEN):
            hidden = torch.cat([fc_hidden, *carried], dim=1)
            drafted = torch.tensor(chain, dtype=torch.long).view(1, len(chain))
            ids = torch.cat([draft_ids, drafted], dim=1)
            positions = 1 + torch.arange(length + step).unsqueeze(0)
            states, logits = run_layers(model, hidden, ids, positions)
            all_logits.append(logits)
            carried.append(states[:, -1:])
            draft = int(logits[0, -1].argmax())
            chain.append(draft + int(d2t[draft]))
    return chain, all_logits


def check_ttt_consistency(
    model: Eagle3DraftModel, aux: torch.Tensor, draft_ids: torch.Tensor, ttt_logits: torch.Tensor
) -> float:
    """Recomputation reproduces the package's ttt step 1 (teacher-forced) at every branch."""
    fc_hidden = project_aux(model, aux)
    length = draft_ids.shape[1]
    worst = 0.0
    with torch.no_grad():
        states, _ = run_layers(model, fc_hidden, draft_ids, 1 + torch.arange(length).unsqueeze(0))
        for i in range(length - 1):
            hidden = torch.cat([fc_hidden[:, : i + 1], states[:, i : i + 1]], dim=1)
            ids = torch.cat([draft_ids[:, : i + 1], draft_ids[:, i + 1 : i + 2]], dim=1)
            positions = 1 + torch.arange(i + 2).unsqueeze(0)
            _, logits = run_layers(model, hidden, ids, positions)
            worst = max(worst, float((logits[0, -1] - ttt_logits[1, 0, i]).abs().max()))
    assert worst < ATOL, worst
    return worst


def head_file_keys(head_dir: Path) -> list[str]:
    """Tensor names in the head folder's ``model.safetensors``."""
    return sorted(load_file(head_dir / "model.safetensors"))


def min_margin(logits: torch.Tensor) -> float:
    """Smallest gap between the best and second-best logit over rows (argmax robustness)."""
    top = logits.topk(2, dim=-1).values
    return float((top[..., 0] - top[..., 1]).min())


def compute_reference(
    model: Eagle3DraftModel, verifier: PreTrainedModel, layer_ids: list[int], seed: int
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """All reference tensors for one head, plus the numbers found while checking them."""
    gen = torch.Generator().manual_seed(seed + 200)
    input_ids = torch.randint(0, TARGET_VOCAB, (1, SEQ_LEN), generator=gen)
    assert torch.equal(model.embed_tokens.weight, verifier.model.embed_tokens.weight)
    aux, next_token = aux_hidden_states(verifier, input_ids, layer_ids)
    draft_ids = torch.cat([input_ids[:, 1:], torch.tensor([[next_token]])], dim=1)
    positions = 1 + torch.arange(SEQ_LEN).unsqueeze(0)
    step_logits, _ = package_forward_logits(model, aux, draft_ids, positions, 1)
    step0 = step_logits[0]
    ttt_logits, ttt_tokens = package_forward_logits(model, aux, draft_ids, positions, TTT_STEPS)
    assert torch.equal(ttt_logits[0], step0)
    assert torch.equal(ttt_tokens[0], step0.argmax(-1))
    zero_based, _ = package_forward_logits(model, aux, draft_ids, positions - 1, 1)
    d2t = model.d2t
    chain, chain_logits = greedy_chain(model, aux, draft_ids, d2t)
    manual_step0 = chain_logits[0]
    assert torch.allclose(manual_step0, step0, atol=ATOL), float((manual_step0 - step0).abs().max())
    assert chain[0] == int(step0[0, -1].argmax()) + int(d2t[step0[0, -1].argmax()])
    ttt_diff = check_ttt_consistency(model, aux, draft_ids, ttt_logits)
    draft_argmax = step0.argmax(-1)
    tensors = {
        "input_ids": input_ids,
        "aux_hidden_states": aux,
        "draft_input_ids": draft_ids,
        "position_ids": positions,
        "step0_logits": step0,
        "step0_draft_argmax": draft_argmax,
        "step0_target_argmax": draft_argmax + d2t[draft_argmax],
        "chain_tokens": torch.tensor(chain, dtype=torch.long),
        "ttt_logits": ttt_logits,
        "ttt_draft_argmax": torch.stack(ttt_tokens),
        "d2t": d2t.clone(),
        "t2d": model.t2d.clone(),
    }
    checks = {
        "verifier_greedy_next_token": next_token,
        "max_abs_diff_manual_vs_package_step0": float((manual_step0 - step0).abs().max()),
        "max_abs_diff_recompute_vs_package_ttt_step1": ttt_diff,
        "max_abs_diff_positions_0_based_vs_1_based": float((zero_based[0] - step0).abs().max()),
        "min_top1_top2_margin_step0": min_margin(step0[0]),
        "min_top1_top2_margin_chain": min_margin(torch.stack([logits[0, -1] for logits in chain_logits])),
    }
    return tensors, checks


TENSOR_DOC = {
    "input_ids": "[1, T] int64 target ids fed to the verifier",
    "aux_hidden_states": "[1, T, num_aux*hidden] f32: verifier hidden states at the head's aux layer ids, "
    "concatenated in the order of eagle_aux_hidden_state_layer_ids; id L = input of decoder layer L "
    "= transformers output_hidden_states[L] (pre-norm), vLLM's hidden_states + residual before layer L",
    "draft_input_ids": "[1, T] int64 target ids: input_ids shifted left by one, last = verifier greedy "
    "next token (the head at t sees aux hidden state t and the embedding of token t+1)",
    "position_ids": "[1, T] int64: 1 + arange(T), the package's default (forward() and shift_batch)",
    "step0_logits": "[1, T, draft_vocab] f32: output of the package's lm_head in Eagle3DraftModel.forward "
    "(ttt_steps=1, document_ids all 0, i.e. full causal attention), captured by a forward hook on lm_head",
    "step0_draft_argmax": "[1, T] int64 draft-vocabulary ids, argmax of step0_logits (= forward()'s return)",
    "step0_target_argmax": "[1, T] int64 target ids: draft + d2t[draft]",
    "chain_tokens": f"[{CHAIN_LEN}] int64 target ids: greedy chain drafted from the last position by "
    "recomputation without a KV cache (see chain_procedure)",
    "ttt_logits": f"[{TTT_STEPS}, 1, T, draft_vocab] f32: lm_head outputs of the package's forward with "
    f"ttt_steps={TTT_STEPS} (training-time unrolling: step k>0 is teacher-forced with input_ids shifted "
    "left by k and zero-padded, hidden = previous step's carried state at the same position, position_ids "
    "+k, attention to step-0 keys <= t plus this position's own keys of steps 1..k)",
    "ttt_draft_argmax": f"[{TTT_STEPS}, 1, T] int64: the package forward's returned draft tokens",
    "d2t": "[draft_vocab] int64 offsets as stored in the head: target = draft + d2t[draft]",
    "t2d": "[target_vocab] bool as stored in the head: true where the target id is in the draft vocab",
}

CHAIN_PROCEDURE = (
    "token 0 = d2t-mapped argmax of step0_logits at position T-1. For k = 1..3: build a sequence of length "
    "T+k whose positions j < T take hidden fc(aux_hidden_states[j]) (after input_norm / fc_norm when "
    "configured) and input id draft_input_ids[j], and whose positions T+m (m < k) take the carried hidden "
    "state of step m (the output of the last decoder layer at the last position of step m's sequence, "
    "passed through `norm` first iff norm_output) and input id chain_tokens[m] (target id); "
    "position_ids = 1 + arange(T+k); run embed -> cat([embeds, hidden]) -> decoder layers with a full "
    "causal mask -> lm_head(norm(.)) (lm_head(.) of the already-normed state when norm_output); token k = "
    "d2t-mapped argmax at the last position. This equals KV-cached autoregressive drafting; it is checked "
    "against the package's teacher-forced ttt step 1 at every position (max_abs_diff_recompute_vs_package_"
    "ttt_step1)."
)


def write_reference(case_dir: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """``reference.safetensors`` plus ``reference.json``."""
    save_file({k: v.contiguous() for k, v in tensors.items()}, case_dir / "reference.safetensors")
    meta = {**meta, "tensors": {k: TENSOR_DOC[k] for k in tensors}, "chain_procedure": CHAIN_PROCEDURE}
    (case_dir / "reference.json").write_text(json.dumps(meta, indent=2) + "\n")


def common_meta(model: Eagle3DraftModel, head_dir: Path, num_layers: int) -> dict[str, Any]:
    """Conventions shared by every case, and what the head folder holds."""
    keys = head_file_keys(head_dir)
    return {
        "layer_id_is_hidden_states_index": 0,
        "layer_id_note": "aux id L = input of verifier decoder layer L = transformers "
        "output_hidden_states[L]; id num_hidden_layers would be the final PRE-norm output (transformers' "
        "last hidden_states entry is post-norm)",
        "default_layer_ids_rule": "[2, n // 2, n - 3] (speculators resolve_target_layer_ids, vLLM)",
        "default_layer_ids": [2, num_layers // 2, num_layers - 3],
        "layer_ids_used": list(model.config.eagle_aux_hidden_state_layer_ids),
        "verifier_num_hidden_layers": num_layers,
        "id_shift": "draft_input_ids[t] = input_ids[t+1]; draft_input_ids[T-1] = verifier greedy next token",
        "position_ids": "1 + arange(T) (package default); positions shifted by a constant give the same "
        "logits up to rounding (RoPE is relative), see checks",
        "d2t_mapping": "target_id = draft_id + d2t[draft_id] (package and vLLM)",
        "logits_capture": "forward hook on Eagle3DraftModel.lm_head during the package's forward()",
        "attention_implementation": "eager (transformers eager_attention_forward, float additive mask)",
        "norm_before_residual": model.config.norm_before_residual,
        "norm_before_fc": model.config.norm_before_fc,
        "fc_norm": model.config.fc_norm,
        "norm_output": model.config.norm_output,
        "draft_num_hidden_layers": model.config.transformer_layer_config.num_hidden_layers,
        "head_file_keys": keys,
        "head_has": {
            name: name in keys
            for name in ("embed_tokens.weight", "lm_head.weight", "d2t", "t2d", "verifier_lm_head.weight")
        },
        "embed_tokens_source": "the head's embed_tokens.weight equals the verifier's model.embed_tokens.weight"
        if "embed_tokens.weight" in keys
        else "not in the head: loaded from the verifier's model.embed_tokens.weight",
        "dtype": "float32",
    }


def speculators_case(case: Case) -> tuple[Eagle3DraftModel, PreTrainedModel]:
    """Write one speculators-format case and its references."""
    case_dir = ROOT / case.name
    verifier = make_verifier(case, case_dir / "verifier")
    make_speculators_head(case, case_dir / "verifier", case_dir / "head")
    model = load_head(case_dir / "head")
    layer_ids = list(model.config.eagle_aux_hidden_state_layer_ids)
    tensors, checks = compute_reference(model, verifier, layer_ids, case.seed)
    meta = common_meta(model, case_dir / "head", case.verifier_layers)
    meta.update(
        case=case.name,
        format="speculators (Eagle3SpeculatorConfig / Eagle3DraftModel.save_pretrained)",
        verifier=f"{case_dir}/verifier ({type(verifier).__name__})",
        checks=checks,
    )
    write_reference(case_dir, tensors, meta)
    return model, verifier


def specforge_state(seed: int) -> dict[str, torch.Tensor]:
    """Random weights with SpecForge's LlamaForCausalLMEagle3 names (no embed_tokens)."""
    torch.manual_seed(seed)
    head_dim = HIDDEN // HEADS
    shapes = {
        "fc.weight": (HIDDEN, 3 * HIDDEN),
        "midlayer.self_attn.q_proj.weight": (HEADS * head_dim, 2 * HIDDEN),
        "midlayer.self_attn.k_proj.weight": (KV_HEADS * head_dim, 2 * HIDDEN),
        "midlayer.self_attn.v_proj.weight": (KV_HEADS * head_dim, 2 * HIDDEN),
        "midlayer.self_attn.o_proj.weight": (HIDDEN, HEADS * head_dim),
        "midlayer.mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
        "midlayer.mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
        "midlayer.mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
        "lm_head.weight": (DRAFT_VOCAB, HIDDEN),
    }
    state = {name: WEIGHT_STD * torch.randn(shape) for name, shape in shapes.items()}
    for norm in ("midlayer.hidden_norm", "midlayer.input_layernorm", "midlayer.post_attention_layernorm", "norm"):
        state[f"{norm}.weight"] = 1.0 + WEIGHT_STD * torch.randn(HIDDEN)
    state["d2t"], state["t2d"] = vocab_maps(seed)
    return state


def specforge_config() -> dict[str, Any]:
    """config.json as SpecForge saves a LlamaForCausalLMEagle3 draft (LlamaConfig + draft_vocab_size)."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "head_dim": HIDDEN // HEADS,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": INTERMEDIATE,
        "max_position_embeddings": 256,
        "mlp_bias": False,
        "num_attention_heads": HEADS,
        "num_hidden_layers": 1,
        "num_key_value_heads": KV_HEADS,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "transformers_version": "4.55.0",
        "use_cache": True,
        "vocab_size": TARGET_VOCAB,
        "draft_vocab_size": DRAFT_VOCAB,
    }


def specforge_case(verifier: PreTrainedModel) -> None:
    """Write the SpecForge-layout head, convert it with the package, reference the converted model."""
    case_dir = ROOT / SPECFORGE_NAME
    head_dir = case_dir / "head"
    head_dir.mkdir(parents=True, exist_ok=True)
    state = specforge_state(SPECFORGE_SEED)
    save_file(state, head_dir / "model.safetensors", metadata={"format": "pt"})
    (head_dir / "config.json").write_text(json.dumps(specforge_config(), indent=2) + "\n")
    verifier_dir = ROOT / LLAMA.name / "verifier"
    with tempfile.TemporaryDirectory() as tmp:
        converted = Path(tmp) / "converted"
        Eagle3Converter().convert(head_dir, converted, str(verifier_dir), validate=False)
        shutil.copyfile(converted / "config.json", case_dir / "converted_config.json")
        model = load_head(converted)
        meta = common_meta(model, converted, LLAMA.verifier_layers)
    layer_ids = resolve_target_layer_ids(None, str(verifier_dir))
    assert list(model.config.eagle_aux_hidden_state_layer_ids) == layer_ids
    for name, value in state.items():
        target = model.state_dict()[name.replace("midlayer.", "layers.0.")]
        assert torch.equal(target, value.to(target.dtype)), name
    tensors, checks = compute_reference(model, verifier, layer_ids, SPECFORGE_SEED)
    meta.update(
        case=SPECFORGE_NAME,
        format="SpecForge / original EAGLE-3 (LlamaForCausalLMEagle3, midlayer.*) in head/; converted with "
        "speculators Eagle3Converter (its config.json kept as converted_config.json: "
        "eagle_aux_hidden_state_layer_ids null there, resolved to the defaults from the verifier at load "
        "time); references computed from the converted model; head_file_keys/head_has describe the "
        "converted file, specforge_head_file_keys the SpecForge one",
        specforge_head_file_keys=sorted(state),
        verifier=f"{verifier_dir} (shared with {LLAMA.name})",
        checks=checks,
    )
    write_reference(case_dir, tensors, meta)


def main() -> None:
    """Write all three cases (run from the repository root)."""
    torch.set_default_dtype(torch.float32)
    for name in (LLAMA.name, QWEN2.name, SPECFORGE_NAME):
        shutil.rmtree(ROOT / name, ignore_errors=True)
    ROOT.mkdir(parents=True, exist_ok=True)
    _, llama_verifier = speculators_case(LLAMA)
    speculators_case(QWEN2)
    specforge_case(llama_verifier)


if __name__ == "__main__":
    main()
