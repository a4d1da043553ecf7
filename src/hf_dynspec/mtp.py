"""The target's own multi-token-prediction (MTP) layers as a draft head.

Models such as DeepSeek-V3, GLM-4-MoE and Ernie 4.5 MoE ship MTP layers beside their decoder
(`num_nextn_predict_layers` / `num_mtp_layers` in their configs): a layer that reads the target's last hidden state
at position `t` and the embedding of token `t + 1` (`enorm`, `hnorm`, `eh_proj`, then a decoder layer of the
target's own kind) and predicts token `t + 2` through the target's output layer. transformers builds them
(`transformers.modeling_layers.MtpModel`, loaded from the target's checkpoint by `MtpModel.from_pretrained(target)`)
and drives them in its own assisted loop at batch 1 (`use_mtp`).

[`MtpHead`] wraps that model as a `StateHead`, so the loop and continuous batching draft with it at any batch size,
each row its own length: the target's last hidden state (as transformers' `output_hidden_states[-1]` gives it: after
the final norm) is read by a forward hook on the final norm, and while drafting past the target's states the layer
reads its own output, as transformers chains its MTP layers. The first MTP layer drafts every depth (DeepSeek-V3 and
GLM-4-MoE ship one); the others of a checkpoint with several are not used.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import MtpModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .eagle3 import MASK_CACHE, HeadLoadError, StateHead


def mtp_layers(target: PreTrainedModel) -> int:
    """How many MTP layers the target's config declares (0: none)."""
    return int(getattr(target.config.get_text_config(), "num_mtp_layers", None) or 0)


class MtpHead(StateHead):
    """The target's first MTP layer as a draft head (`MtpHead.from_target(model)`)."""

    _supports_sdpa = True
    _supports_attention_backend = True
    # transformers decides from a module's source whether its experts can switch implementation; this head's experts
    # are the target's own layer classes, which can
    _can_set_experts_implementation_cached_value = True

    def __init__(self, mtp: MtpModel, target: PreTrainedModel) -> None:
        super().__init__(mtp.config)
        self.mtp = mtp
        self._target = (target,)  # not a submodule: the head shares the target's embeddings and output layer

    @classmethod
    def from_target(cls, target: PreTrainedModel, device: str | torch.device | None = None) -> MtpHead:
        """The MTP layers of `target`'s checkpoint (`target.name_or_path`), loaded by transformers."""
        if not mtp_layers(target):
            raise HeadLoadError(
                f"{type(target).__name__}'s config declares no MTP layers (`num_mtp_layers`); use a draft model or an "
                "EAGLE-3 head with this target."
            )
        device = device if device is not None else target.device
        return cls(MtpModel.from_pretrained(target, device_map={"": device}).eval(), target)

    @classmethod
    def random(cls, target: PreTrainedModel) -> MtpHead:
        """A randomly initialised MTP layer for `target` (tests; a checkpoint without MTP weights)."""
        return cls(MtpModel(target, mtp_layers(target)).to(target.device, target.dtype).eval(), target)

    def get_input_embeddings(self) -> nn.Module:
        return self.mtp.embed_tokens

    def get_output_embeddings(self) -> None:
        return None

    def bind(self, target: PreTrainedModel) -> None:
        if target is not self._target[0]:
            raise HeadLoadError(
                f"This MTP head belongs to another {type(self._target[0]).__name__} than the target it is given; "
                "build it from the target that generates: `MtpHead.from_target(model)`."
            )

    def tap_points(self, target: PreTrainedModel) -> list[tuple[nn.Module, str]]:
        """The output of the target's final norm: its last hidden state."""
        return [(target.get_decoder().norm, "output")]

    def fuse(self, states: list[torch.Tensor]) -> torch.Tensor:
        return states[0].to(self.dtype)

    def forward(
        self,
        input_ids: torch.LongTensor,  # [batch, width]
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,  # [batch, width]
        cache=None,
        use_cache: bool = True,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """The target's logits for the token after next (`[batch, keep, vocab]`), from the states `HeadInputs`
        holds before each token."""
        cache = cache if cache is not None else kwargs.pop("past_key_values", None)
        before = self._states_before(position_ids)  # [batch, width, hidden]
        embeds = self.mtp.embed_tokens(input_ids.to(self.device))  # [batch, width, hidden]
        mask = create_causal_mask(
            config=self.config, inputs_embeds=embeds, attention_mask=attention_mask, position_ids=position_ids,
            **{MASK_CACHE: cache},
        )
        rotary = self.mtp.rotary_emb(embeds, position_ids=position_ids) if self.mtp.rotary_emb is not None else None
        out = self.mtp.layers[0](
            embeds, before.to(embeds.dtype), position_embeddings=rotary, attention_mask=mask, position_ids=position_ids,
            cache=cache, **kwargs,
        )  # [batch, width, hidden]
        if self.mtp.use_shared_post_norm:
            out = self.mtp.shared_post_norm(out)
        self.inputs.record(position_ids, out)
        logits = self.mtp._project_to_logits(self.kept_states(out, logits_to_keep))
        return CausalLMOutputWithPast(logits=logits.float())
