"""Tiny models built from configs (no downloads) and helpers shared by the tests."""

from __future__ import annotations

import copy
import importlib.util
import os
from pathlib import Path
from types import ModuleType

import pytest
import torch
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from hf_dynspec.evaluation.overhead import mirror_head

os.environ.setdefault("HF_DYNSPEC_CHECK_TREES", "1")  # the loop checks every tree it builds (`candidates.tree`)
if os.environ.get("PYTEST_XDIST_WORKER"):  # `pytest -n N` on N cores: one thread a worker, not N each
    torch.set_num_threads(1)

PAD, EOS, BOS = 0, 1, 2
VOCAB = 96

EVALUATION = Path(__file__).resolve().parent.parent / "evaluation"


def evaluation_script(name: str) -> ModuleType:
    """The script `evaluation/<name>.py`, or the probe `evaluation/probes/<name>.py`, imported as a module (the scripts
    are not part of the package)."""
    folders = (EVALUATION, EVALUATION / "probes")
    path = next((folder / f"{name}.py" for folder in folders if (folder / f"{name}.py").is_file()), None)
    if path is None:
        raise FileNotFoundError(f"No script {name}.py in {EVALUATION} or {EVALUATION / 'probes'}.")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SPECIAL_TOKENS = {"pad": "<pad>", "bos": "<s>", "eos": "</s>", "unk": "<unk>"}


def word_tokenizer(
    vocab: int = VOCAB, specials: dict[str, int] | None = None
) -> PreTrainedTokenizerFast:
    """A left-padding word-level tokenizer for the tiny models: `specials` maps roles of `SPECIAL_TOKENS` to ids (the
    tiny models' pad, bos and eos by default), every other id below `vocab` is the word `w<id>`."""
    specials = specials if specials is not None else {"pad": PAD, "bos": BOS, "eos": EOS}
    words = {SPECIAL_TOKENS[role]: index for role, index in specials.items()}
    words |= {f"w{index}": index for index in range(vocab) if index not in specials.values()}
    backend = Tokenizer(WordLevel(words, unk_token=SPECIAL_TOKENS["unk"] if "unk" in specials else None))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokens = {f"{role}_token": SPECIAL_TOKENS[role] for role in specials}
    return PreTrainedTokenizerFast(tokenizer_object=backend, padding_side="left", **tokens)


FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
}


def tiny_model(
    family: str = "llama", seed: int = 0, vocab: int = VOCAB, dtype: torch.dtype = torch.float64, **overrides
):
    """A randomly initialised 2-layer model; float64 by default so argmax ties from rounding cannot occur."""
    config_class, model_class = FAMILIES[family]
    settings = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=BOS,
        initializer_range=0.3,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = model_class(config_class(**settings)).to(dtype).eval()
    model.generation_config.pad_token_id = settings["pad_token_id"]
    model.generation_config.eos_token_id = settings["eos_token_id"]
    return model


def perturbed(model, scale: float, seed: int = 123):
    """A copy of `model` with Gaussian noise on every weight: a draft that agrees with it part of the time."""
    torch.manual_seed(seed)
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(torch.randn_like(parameter) * scale * parameter.std().clamp(min=1e-3))
    return draft


def left_padded_prompts(lengths: list[int], vocab: int = VOCAB, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts of the given lengths, left-padded: `input_ids` and `attention_mask` `[batch, max(lengths)]`."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = torch.randint(3, vocab, (length,), generator=generator)
        mask[row, width - length :] = 1
    return ids, mask


@pytest.fixture(scope="session")
def llama():
    return tiny_model("llama", seed=0)


@pytest.fixture(scope="session")
def qwen2():
    return tiny_model("qwen2", seed=0)


@pytest.fixture(scope="module")
def mirrored():
    """A target with tiny embeddings (its norms' epsilon tinier still) and silent later layers, and its
    `mirror_head`."""
    target = tiny_model("llama", seed=3, num_hidden_layers=4, tie_word_embeddings=False, rms_norm_eps=1e-30)
    with torch.no_grad():
        target.model.embed_tokens.weight.mul_(1e-6)
        for layer in target.model.layers[1:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return target, mirror_head(target)
