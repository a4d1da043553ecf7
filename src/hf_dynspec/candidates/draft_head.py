"""The draft model's output layer over part of the vocabulary.

At batch 1 a draft forward mostly reads weights, and a small draft's output layer is a large share of them: on the
default pair (Qwen2.5-Coder 0.5B, 151 936 tokens, hidden size 896) it holds 136M of the draft's 494M parameters. A
byte-level BPE vocabulary lists tokens in the order their merges were learned, that is roughly from most to least
frequent, so the first few tens of thousands of ids cover nearly every token of ordinary text and code. A
[`DraftHead`] computes the draft's logits only for those ids, the batch's own prompt tokens (identifiers, rare words
a row may copy) and the end-of-sequence ids; every other id gets `-inf`, so the draft never proposes it.

Output does not change: the target decides every token. Greedy decoding stays token-identical, and sampled decoding
still follows the target's distribution, because rejection sampling is exact for any draft distribution `q` (here
`q` is zero outside the kept ids, and those tokens come from the residual `max(0, p - q)`). Only acceptance can
drop, when the draft's own choice lies outside the kept ids.
"""

from __future__ import annotations

import logging
import weakref

import torch
from transformers import PreTrainedModel

from ..devices import input_device
from ..kernels import row_major

logger = logging.getLogger(__name__)

_SUPPORT: weakref.WeakKeyDictionary[torch.nn.Module, str | None] = weakref.WeakKeyDictionary()
"""Per draft model: why its output layer cannot be narrowed, or `None` when it can (checked once per model)."""


class DraftHead:
    """Draft logits for the kept ids only (`-inf` elsewhere), computed from the decoder's last hidden states.

    Build it with [`DraftHead.for_batch`], which returns `None` when nothing would be left out or the model's logits
    are not a plain linear map of its last hidden state.
    """

    def __init__(self, model: PreTrainedModel, first: int, extra_ids: torch.LongTensor) -> None:
        """
        Args:
            model: the draft model (its output embeddings must be a floating-point `nn.Linear`).
            first: the ids `0 .. first - 1` are kept.
            extra_ids: `[extra]` further ids to keep, all `>= first` and distinct.
        """
        head = model.get_output_embeddings()
        self.decoder = model.get_decoder()
        self.vocab_size = int(head.weight.shape[0])
        self.weight = head.weight[:first]  # [first, hidden] a view: no copy
        self.bias = None if head.bias is None else head.bias[:first]
        self.extra_ids = extra_ids.to(head.weight.device)  # [extra]
        self.extra_weight = head.weight[self.extra_ids]  # [extra, hidden]
        self.extra_bias = None if head.bias is None else head.bias[self.extra_ids]
        self.num_kept = first + int(extra_ids.numel())

    @classmethod
    def for_batch(
        cls, model: PreTrainedModel, size: int | None, prompt_ids: torch.LongTensor, eos_ids: list[int]
    ) -> DraftHead | None:
        """The head keeping the first `size` ids, every id in `prompt_ids` (`[batch, length]`) and `eos_ids`; `None`
        when `size` is `None` or covers the whole vocabulary, or when the model does not support it
        (see `unsupported_reason`, logged once per model)."""
        head = model.get_output_embeddings()
        vocab = int(head.weight.shape[0]) if head is not None else 0
        if size is None or size >= vocab or unsupported_reason(model) is not None:
            return None
        wanted = torch.cat([prompt_ids.reshape(-1).cpu(), torch.tensor(eos_ids, dtype=torch.long)])
        extra = torch.unique(wanted[(wanted >= size) & (wanted < vocab)])  # [extra] sorted, distinct
        return cls(model, size, extra)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[batch, keep, hidden]` last hidden states -> `[batch, keep, vocab]` float32 logits, `-inf` off the kept ids."""
        hidden = row_major(hidden.to(self.weight.device))  # a slice of the last positions: one product, no weight copy
        out = hidden.new_full((*hidden.shape[:-1], self.vocab_size), float("-inf"), dtype=torch.float32)
        first = self.weight.shape[0]
        out[..., :first] = torch.nn.functional.linear(hidden, self.weight, self.bias)
        if self.extra_ids.numel():
            out[..., self.extra_ids] = torch.nn.functional.linear(hidden, self.extra_weight, self.extra_bias).float()
        return out


def unsupported_reason(model: PreTrainedModel) -> str | None:
    """Why `model`'s output layer cannot be narrowed, or `None`. Checked once per model by comparing its logits with
    a linear map of its decoder's last hidden state on a few tokens, so models that scale, soft-cap or add a bias to
    their logits after the output layer keep their whole vocabulary (their config names the transform, as Gemma 2,
    Cohere and Granite do, or the comparison finds it)."""
    if model not in _SUPPORT:
        _SUPPORT[model] = _check(model)
        if _SUPPORT[model] is not None:
            logger.info("The draft keeps its whole vocabulary: %s", _SUPPORT[model])
    return _SUPPORT[model]


LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""Config fields of models that transform their logits after the output layer (Gemma 2/3, Cohere, Granite)."""


def _check(model: PreTrainedModel) -> str | None:
    config = model.config.get_text_config()
    transforms = [name for name in LOGIT_TRANSFORMS if getattr(config, name, None) not in (None, 1, 1.0)]
    if transforms:
        return f"its config sets {transforms}, which change its logits after the output layer"
    head = model.get_output_embeddings()
    if head is None:
        return "it has no output embeddings"
    if not isinstance(head, torch.nn.Linear) or not head.weight.is_floating_point():
        return f"its output layer is a {type(head).__name__} with {head.weight.dtype} weights, not a floating-point nn.Linear"
    if head.weight.device.type == "meta":
        return "its output layer is offloaded (weights on the meta device)"
    decoder = model.get_decoder()
    if decoder is model:
        return "transformers finds no decoder module inside it (`get_decoder()` returns the model itself)"
    vocab = int(head.weight.shape[0])
    ids = (torch.arange(1, 9) % vocab).unsqueeze(0).to(input_device(model))  # [1, 8]
    with torch.no_grad():
        full = model(input_ids=ids, use_cache=False).logits[:, -1].float()  # [1, vocab]
        hidden = decoder(input_ids=ids, use_cache=False).last_hidden_state[:, -1:]  # [1, 1, hidden]
        narrowed = torch.nn.functional.linear(hidden.to(head.weight.device), head.weight, head.bias)[:, 0].float()
    scale = float(full.abs().max())
    if full.shape != narrowed.shape or not torch.allclose(full, narrowed.to(full.device), rtol=1e-2, atol=1e-3 * scale):
        return "its logits are not a plain linear map of its decoder's last hidden state"
    return None
