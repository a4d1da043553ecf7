"""A tiny random target/draft pair built from configs (no downloads), so the harness and notebooks run in seconds.

The target is a 2-layer Llama model; the draft is a 1-layer Qwen2 model that copies the target's embeddings, first
layer, final norm and head, so it agrees with the target often enough for speculation to do something.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, Qwen2Config, Qwen2ForCausalLM

TINY_VOCAB = 512
TINY_PAD, TINY_EOS = 0, 1


def _shared_settings(vocab_size: int) -> dict:
    return dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        pad_token_id=TINY_PAD,
        eos_token_id=TINY_EOS,
        bos_token_id=None,
        tie_word_embeddings=False,
    )


def _finish(model: PreTrainedModel) -> PreTrainedModel:
    model.generation_config.pad_token_id = TINY_PAD
    model.generation_config.eos_token_id = TINY_EOS
    return model.eval()


def tiny_pair(seed: int = 0, vocab_size: int = TINY_VOCAB) -> tuple[PreTrainedModel, PreTrainedModel]:
    """`(target, draft)`: a random 2-layer Llama target and a 1-layer Qwen2 draft sharing its vocabulary."""
    torch.manual_seed(seed)
    target = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, **_shared_settings(vocab_size)))
    draft = Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=1, **_shared_settings(vocab_size)))
    shared = {name: value for name, value in target.state_dict().items() if not name.startswith("model.layers.1.")}
    draft.load_state_dict(shared, strict=False)
    with torch.no_grad():
        for name, parameter in draft.named_parameters():
            if name.endswith("_proj.bias"):
                parameter.zero_()
    return _finish(target), _finish(draft)


def tiny_tokenizer(vocab_size: int = TINY_VOCAB):
    """A word-level tokenizer over the tiny pair's ids: id `i` is the word `w<i>` (pad and EOS aside), so token ids
    and text convert both ways exactly (clients that take text, such as TRL's trainers, see the same prompts)."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": TINY_PAD, "</s>": TINY_EOS} | {f"w{i}": i for i in range(vocab_size) if i not in (TINY_PAD, TINY_EOS)}
    backend = Tokenizer(WordLevel(words, unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", padding_side="left")
