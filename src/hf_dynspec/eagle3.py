"""EAGLE-3 draft heads: a small decoder that drafts from the target's own hidden states.

An EAGLE-3 head (Li et al., 2025) reads the target's hidden states at a few layers (its auxiliary layers, commonly
three: an early, a middle and a late one), fuses them with a linear layer (`fc`) into one hidden state per position,
and runs one decoder layer (sometimes a few) over the concatenation of that state and the embedding of the next
token. Its output layer scores a draft vocabulary (a subset of the target's); `d2t` maps draft ids to target ids.
While drafting, the head feeds its own output state back in place of the target's, which it has not seen yet.

Here a head is a `PreTrainedModel` whose logits cover the target's vocabulary (`-inf` outside the draft vocabulary),
so the loop's draft-model machinery (its ragged cache, masks, sampling, coupled sampling, early stops) drives it
like any draft model; what differs (the target's states as an input) comes in through `HeadInputs`.

Both published formats load ([`Eagle3Head.from_pretrained`]):
- the `speculators` format (`"speculators_model_type": "eagle3"`, a `transformer_layer_config`, weights named
  `layers.0.*`), which vLLM reads;
- the SpecForge / EAGLE format (`"architectures": ["LlamaForCausalLMEagle3"]`, the decoder layer's fields at the top
  level, weights named `midlayer.*`), which SGLang reads.

Layer ids follow vLLM: auxiliary layer `L` is the input of the target's decoder layer `L` (transformers'
`hidden_states[L]`); without ids in the config, a target of `n` layers uses `(2, n // 2, n - 3)`.
"""

from __future__ import annotations

import inspect
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn
from transformers import LlamaConfig, PreTrainedModel
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

LAYER_CACHE = "cache" if "cache" in inspect.signature(LlamaDecoderLayer.forward).parameters else "past_key_values"
MASK_CACHE = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
"""What transformers calls the KV cache argument of decoder layers and masks (`past_key_values` before 5.2x)."""

SPECFORGE_ARCHITECTURES = ("LlamaForCausalLMEagle3",)
"""`architectures` of heads in the SpecForge / EAGLE format."""


def decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    """The decoder layers of a transformers causal LM (`model.model.layers` in most families)."""
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise HeadLoadError(
            f"A draft head reads the target's decoder layers, and {type(model).__name__} keeps none under "
            "`get_decoder().layers`; use a draft model with this target."
        )
    return layers


class HeadLoadError(ValueError):
    """A head folder or Hub id that cannot be read as an EAGLE-3 head, or a head that does not fit its target."""


@dataclass
class Eagle3Settings:
    """What an EAGLE-3 head adds to its decoder layer's config (the `speculators` format's names)."""

    draft_vocab_size: int
    aux_layer_ids: list[int] | None = None  # the target's layers read; None: (2, n // 2, n - 3) for n target layers
    target_hidden_size: int | None = None  # the target's width, when it differs from the head's
    norm_before_residual: bool = False  # the first layer's residual is the normalised hidden state
    norm_before_fc: bool = False  # an RMS norm over the concatenated auxiliary states before `fc`
    fc_norm: bool = False  # an RMS norm per auxiliary state before `fc`
    norm_output: bool = False  # the state fed back while drafting is the normalised output
    verifier: str | None = None  # the target the head was trained for (name or path), as the folder says
    source_format: str = "speculators"
    extra: dict = field(default_factory=dict)


class Eagle3FirstLayer(LlamaDecoderLayer):
    """The head's first decoder layer: attention over `[embedding; hidden]` (twice the width), the residual stream
    carrying the hidden state alone."""

    def __init__(self, config: LlamaConfig, norm_before_residual: bool) -> None:
        super().__init__(config, 0)
        width, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        head_dim = config.head_dim
        bias = config.attention_bias
        self.self_attn.q_proj = nn.Linear(2 * width, heads * head_dim, bias=bias)
        self.self_attn.k_proj = nn.Linear(2 * width, kv_heads * head_dim, bias=bias)
        self.self_attn.v_proj = nn.Linear(2 * width, kv_heads * head_dim, bias=bias)
        self.hidden_norm = LlamaRMSNorm(width, eps=config.rms_norm_eps)
        self.norm_before_residual = norm_before_residual

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:  # [batch, width, 2 * hidden]
        embeds, hidden = hidden_states.chunk(2, dim=-1)  # [batch, width, hidden] each
        hidden = self.hidden_norm(hidden)
        residual = hidden if self.norm_before_residual else hidden_states[..., embeds.shape[-1] :]
        attended, _ = self.self_attn(hidden_states=torch.cat([self.input_layernorm(embeds), hidden], -1), **kwargs)
        hidden_states = residual + attended
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class HeadInputs:
    """What a head reads besides token ids, per slot and real position: the target's fused auxiliary states
    (`target`, written by `TargetTap` after each target forward) and the head's own output states (`own`, written by
    each head forward). A slot is a row of the loop's batch, or a request under continuous batching. A token at
    position `p` reads the state at `p - 1`: the target's where the target has computed it (`p < committed`, the
    slot's committed tokens), the head's own while it drafts past them. `columns` names the slot of each column of
    the forward that runs (`[batch, width]`; `None`: row `b` is slot `b`)."""

    def __init__(self, slots: int, width: int, hidden: int, dtype: torch.dtype, device: torch.device) -> None:
        self.target = torch.zeros((slots, width, hidden), dtype=dtype, device=device)  # [slots, width, hidden]
        self.own = torch.zeros_like(self.target)  # [slots, width, hidden]
        self.committed = torch.zeros(slots, dtype=torch.long, device=device)  # [slots]
        self.columns: torch.LongTensor | None = None
        self.given: torch.Tensor | None = None  # [batch, width, hidden] the states the next forward reads, if given
        self.last: torch.Tensor | None = None  # [batch, width, hidden] the last head forward's output states

    def ensure(self, slots: int, width: int) -> None:
        """Room for `slots` slots and positions below `width` (each doubling)."""
        have_slots, have_width = self.target.shape[:2]
        if slots <= have_slots and width <= have_width:
            return
        grown_slots = have_slots if slots <= have_slots else max(slots, 2 * have_slots)
        grown_width = have_width if width <= have_width else max(width, 2 * have_width)
        pad = (0, 0, 0, grown_width - have_width, 0, grown_slots - have_slots)
        self.target = nn.functional.pad(self.target, pad)
        self.own = nn.functional.pad(self.own, pad)
        self.committed = nn.functional.pad(self.committed, (0, grown_slots - have_slots))

    def slots_of(self, positions: torch.LongTensor) -> torch.LongTensor:
        """`[batch, width]` the slot of each column of a forward over `positions`."""
        if self.columns is not None:
            return self.columns.to(positions.device)
        return torch.arange(positions.shape[0], device=positions.device).unsqueeze(1).expand_as(positions)

    def before(self, positions: torch.LongTensor) -> torch.Tensor:
        """`[batch, width, hidden]` the state each token reads: at position `positions - 1` (zeros at position 0), or
        the states `given` for this forward (token trees, whose siblings share positions)."""
        if self.given is not None:
            return self.given
        slots = self.slots_of(positions).clamp(min=0)
        previous = (positions - 1).clamp(min=0, max=self.target.shape[1] - 1)  # [batch, width]
        from_target = positions < self.committed[slots]  # [batch, width]
        state = torch.where(from_target.unsqueeze(-1), self.target[slots, previous], self.own[slots, previous])
        return state * (positions > 0).unsqueeze(-1)

    def record(self, positions: torch.LongTensor, states: torch.Tensor) -> None:
        """A head forward's output states (`[batch, width, hidden]`): kept as `last` and as its own states."""
        self.last = states
        self.write("own", positions, states)

    def write(self, whose: str, positions: torch.LongTensor, states: torch.Tensor) -> None:
        """Write `states` (`[batch, width, hidden]`) at `positions` (`[batch, width]`) of the `"target"` or `"own"`
        states of each column's slot (columns of slot -1 belong to no one); where a slot repeats a position in a row
        (left padding sits at position 0 before the first real token), its last column wins."""
        slots = self.slots_of(positions)
        self.ensure(int(slots.max()) + 1, int(positions.max()) + 1)
        store = self.target if whose == "target" else self.own
        last = slots >= 0
        last[:, :-1] &= (positions[:, :-1] != positions[:, 1:]) | (slots[:, :-1] != slots[:, 1:])  # [batch, width]
        rows, columns = last.nonzero(as_tuple=True)
        store[slots[rows, columns], positions[rows, columns]] = states[rows, columns].to(store.dtype)

    def clear(self, slot: int) -> None:
        """Forget a slot's states (a request left)."""
        self.committed[slot] = 0
        self.target[slot].zero_()
        self.own[slot].zero_()

    def select_rows(self, keep: torch.LongTensor) -> None:
        self.target, self.own, self.committed = self.target[keep], self.own[keep], self.committed[keep]


class StateHead(PreTrainedModel):
    """A draft head that reads the target's hidden states (an EAGLE-3 head, the target's own MTP layers): the loop
    and continuous batching drive it as a draft model whose forward also reads `inputs` (`HeadInputs`, set for the
    length of a call). A head names where in the target it reads (`tap_points`) and how it fuses what it reads
    (`fuse`), and `bind` checks it fits its target."""

    inputs: HeadInputs | None = None

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        """Its cache is transformers' `DynamicCache`, which the loop crops and compacts."""
        return True

    def bind(self, target: PreTrainedModel) -> None:
        """Check that the head fits `target`; a clear error names what does not."""
        raise NotImplementedError

    def tap_points(self, target: PreTrainedModel) -> list[tuple[nn.Module, str]]:
        """Where the head reads the target: modules of `target` and whether their `"input"` or `"output"`."""
        raise NotImplementedError

    def fuse(self, states: list[torch.Tensor]) -> torch.Tensor:
        """The states read at `tap_points` (each `[..., target_hidden]`) as the one state `[..., hidden]` a token
        reads."""
        raise NotImplementedError

    def kept_states(self, out: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
        """The positions of `out` (`[batch, width, hidden]`) whose logits a forward returns."""
        if isinstance(logits_to_keep, torch.Tensor):
            return out[:, logits_to_keep]  # packed positions (continuous batching)
        return out[:, -logits_to_keep:] if logits_to_keep else out

    def _states_before(self, position_ids: torch.LongTensor | None) -> torch.Tensor:
        if self.inputs is None:
            raise RuntimeError("A draft head drafts inside the speculative loop, which feeds it the target's states.")
        if position_ids is None:
            raise ValueError("A draft head needs the tokens' position ids.")
        return self.inputs.before(position_ids)


class Eagle3Head(StateHead):
    """An EAGLE-3 draft head, used as `assistant_model` (`model.generate(..., assistant_model=head,
    custom_generate=hf_dynspec.speculative_loop)`): its logits cover the target's vocabulary, `-inf` outside its
    draft vocabulary. Load one with [`Eagle3Head.from_pretrained`]; it is bound to its target when a call starts
    (`bind`), which checks that they fit."""

    config_class = LlamaConfig
    base_model_prefix = "eagle3"
    _supports_sdpa = True
    _supports_attention_backend = True

    def __init__(self, config: LlamaConfig, settings: Eagle3Settings) -> None:
        super().__init__(config)
        self.settings = settings
        num_aux = len(settings.aux_layer_ids) if settings.aux_layer_ids else 3
        target_width = settings.target_hidden_size or config.hidden_size
        eps = config.rms_norm_eps
        self.input_norm = LlamaRMSNorm(num_aux * target_width, eps=eps) if settings.norm_before_fc else None
        self.fc_norm = nn.ModuleList(LlamaRMSNorm(target_width, eps=eps) for _ in range(num_aux)) if settings.fc_norm else None
        self.fc = nn.Linear(num_aux * target_width, config.hidden_size, bias=False)
        first = Eagle3FirstLayer(config, settings.norm_before_residual)
        self.layers = nn.ModuleList([first, *(LlamaDecoderLayer(config, i) for i in range(1, config.num_hidden_layers))])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=eps)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.lm_head = nn.Linear(config.hidden_size, settings.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(settings.draft_vocab_size, dtype=torch.long), persistent=True)
        self.embed_tokens: nn.Embedding | None = None  # the head's own, when its folder has one
        self._target_embeddings: tuple[nn.Module, ...] = ()  # the target's input embeddings (not a submodule)
        self.same_vocabulary = False  # set by `bind`
        self.post_init()

    # ---- the pieces the loop reads -----------------------------------------------------------------------------
    def get_input_embeddings(self) -> nn.Module:
        if self.embed_tokens is not None:
            return self.embed_tokens
        if not self._target_embeddings:
            raise HeadLoadError("This EAGLE-3 head has no embeddings of its own: bind it to its target first.")
        return self._target_embeddings[0]

    def get_output_embeddings(self) -> None:
        """None: the head's logits are not a linear map onto the target's vocabulary (see `target_ids`)."""
        return None

    @property
    def target_ids(self) -> torch.LongTensor:
        """`[draft_vocab]` the target id of each draft id."""
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def aux_layer_ids(self, target_layers: int) -> list[int]:
        """The target's layers the head reads, for a target of `target_layers` decoder layers."""
        return list(self.settings.aux_layer_ids or (2, target_layers // 2, target_layers - 3))

    def bind(self, target: PreTrainedModel) -> None:
        """Check that the head fits `target` (width, vocabulary, layers) and share its input embeddings; a clear
        error names what does not match."""
        text = target.config.get_text_config()
        width = self.settings.target_hidden_size or self.config.hidden_size
        problems = []
        if text.hidden_size != width:
            problems.append(f"the head reads hidden states of width {width}, the target's are {text.hidden_size}")
        if self.config.vocab_size != text.vocab_size:
            problems.append(f"the head maps onto a vocabulary of {self.config.vocab_size}, the target's has {text.vocab_size}")
        bad = [i for i in self.aux_layer_ids(text.num_hidden_layers) if not 0 <= i <= text.num_hidden_layers]
        if bad:
            problems.append(f"auxiliary layer ids {bad} lie outside the target's {text.num_hidden_layers} layers")
        if self.embed_tokens is None and text.hidden_size != self.config.hidden_size:
            problems.append("the head has no embeddings of its own and the target's width differs from the head's")
        if problems:
            trained = f" (it was trained for {self.settings.verifier})" if self.settings.verifier else ""
            raise HeadLoadError(
                f"This EAGLE-3 head does not fit the target {type(target).__name__}{trained}: "
                + "; ".join(problems) + ". Use the head trained for this target."
            )
        self._target_embeddings = (target.get_input_embeddings(),)
        theirs = self._target_embeddings[0].weight
        if self.embed_tokens is not None and self.embed_tokens.weight.shape == theirs.shape:
            if theirs.device.type != "meta" and torch.equal(self.embed_tokens.weight, theirs.to(self.embed_tokens.weight)):
                self.embed_tokens = None  # a copy of the target's (the speculators format saves one): share theirs
        # the draft vocabulary is the target's, in its order: logits need no mapping (read once, not per forward)
        self.same_vocabulary = self.settings.draft_vocab_size == self.config.vocab_size and not bool(self.d2t.any())

    def tap_points(self, target: PreTrainedModel) -> list[tuple[nn.Module, str]]:
        """The input of the target's decoder layer `L` for each auxiliary layer id `L` (the last layer's output for
        `L` equal to the number of layers)."""
        layers = decoder_layers(target)
        return [(layers[i], "input") if i < len(layers) else (layers[-1], "output") for i in self.aux_layer_ids(len(layers))]

    def fuse(self, aux: list[torch.Tensor]) -> torch.Tensor:
        """The target's auxiliary states (each `[..., target_hidden]`) fused into one `[..., hidden]` state."""
        if self.fc_norm is not None:
            aux = [norm(state) for norm, state in zip(self.fc_norm, aux)]
        joined = torch.cat([state.to(self.fc.weight.dtype) for state in aux], dim=-1)  # [..., num_aux * target_hidden]
        if self.input_norm is not None:
            joined = self.input_norm(joined)
        return self.fc(joined)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[..., draft_vocab]` logits from the last layer's output states `[..., hidden]`."""
        return self.lm_head(hidden if self.settings.norm_output else self.norm(hidden))

    def step(
        self, embeds: torch.Tensor, before: torch.Tensor, positions: torch.LongTensor, mask, cache, **kwargs
    ) -> torch.Tensor:
        """The decoder over `[batch, width]` tokens: their embeddings and the states they read (`[batch, width,
        hidden]` each) -> the last layer's output states (`[batch, width, hidden]`, normalised with `norm_output`).
        `kwargs` reach attention (a paged cache's sequence bounds under continuous batching)."""
        hidden = torch.cat([embeds, before.to(embeds.dtype)], dim=-1)  # [batch, width, 2 * hidden]
        rotary = self.rotary_emb(embeds, position_ids=positions)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=mask, position_ids=positions, use_cache=cache is not None,
                           position_embeddings=rotary, **{LAYER_CACHE: cache}, **kwargs)
        return self.norm(hidden) if self.settings.norm_output else hidden

    def forward(
        self,
        input_ids: torch.LongTensor,  # [batch, width]
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,  # [batch, width] real positions (`HeadInputs` is keyed by them)
        cache=None,
        use_cache: bool = True,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Logits over the target's vocabulary (`[batch, keep, vocab]`, `-inf` outside the draft vocabulary) for
        tokens whose preceding states `HeadInputs` holds."""
        cache = cache if cache is not None else kwargs.pop("past_key_values", None)
        before = self._states_before(position_ids)  # [batch, width, hidden]
        embeds = self.get_input_embeddings()(input_ids.to(self.fc.weight.device)).to(self.fc.weight.dtype)
        mask = create_causal_mask(
            config=self.config, inputs_embeds=embeds, attention_mask=attention_mask, position_ids=position_ids,
            **{MASK_CACHE: cache},
        )
        out = self.step(embeds, before, position_ids, mask, cache, **kwargs)  # [batch, width, hidden]
        self.inputs.record(position_ids, out)
        scores = self.draft_logits(self.kept_states(out, logits_to_keep)).float()  # [batch, keep, draft_vocab]
        if self.same_vocabulary:
            return CausalLMOutputWithPast(logits=scores)  # the draft vocabulary is the target's
        logits = scores.new_full((*scores.shape[:-1], self.config.vocab_size), float("-inf"))
        logits[..., self.target_ids] = scores
        return CausalLMOutputWithPast(logits=logits)

    # ---- loading ------------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls, name_or_path: str | os.PathLike, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
        revision: str | None = None,
    ) -> Eagle3Head:
        """Load a head from a folder or a Hub id, in either format (`speculators` or SpecForge / EAGLE)."""
        folder = _resolve(name_or_path, revision)
        config_dict = json.loads((folder / "config.json").read_text())
        layer_config, settings = read_config(config_dict, folder)
        head = cls(layer_config, settings)
        head.load_weights(_read_weights(folder))
        return head.to(device=device, dtype=dtype).eval()

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load a state dict in either format's names (`midlayer.*` for `layers.0.*`), with or without embeddings."""
        renamed = {_rename(name): tensor for name, tensor in weights.items()}
        renamed = {n: t for n, t in renamed.items() if not n.startswith(("verifier_", "t2d"))}
        if "embed_tokens.weight" in renamed:
            self.embed_tokens = nn.Embedding(*renamed["embed_tokens.weight"].shape)
        if "d2t" not in renamed:
            if self.settings.draft_vocab_size != self.config.vocab_size:
                raise HeadLoadError(
                    f"The head scores {self.settings.draft_vocab_size} draft ids of a vocabulary of "
                    f"{self.config.vocab_size} but its weights have no `d2t` map from draft ids to target ids."
                )
            renamed["d2t"] = torch.zeros(self.settings.draft_vocab_size, dtype=torch.long)
        renamed["d2t"] = renamed["d2t"].long()
        missing, unexpected = self.load_state_dict(renamed, strict=False)
        missing = [n for n in missing if not n.startswith("rotary_emb")]
        if missing or unexpected:
            raise HeadLoadError(f"The head's weights do not match its config: missing {missing}, unexpected {unexpected}.")


def read_config(config: dict, folder: Path | None = None) -> tuple[LlamaConfig, Eagle3Settings]:
    """The decoder layer's config and the head's settings from a head's `config.json`, in either format."""
    if config.get("speculators_model_type") == "eagle3":
        return _read_speculators(config)
    if any(name in SPECFORGE_ARCHITECTURES for name in config.get("architectures") or ()):
        return _read_specforge(config)
    where = f" in {folder}" if folder is not None else ""
    raise HeadLoadError(
        f"The config{where} is not an EAGLE-3 head: expected `\"speculators_model_type\": \"eagle3\"` (the speculators "
        f"format) or architectures {list(SPECFORGE_ARCHITECTURES)} (SpecForge / EAGLE); got "
        f"speculators_model_type={config.get('speculators_model_type')!r}, architectures={config.get('architectures')}."
    )


def _read_speculators(config: dict) -> tuple[LlamaConfig, Eagle3Settings]:
    layer = dict(config["transformer_layer_config"])
    if layer.get("model_type", "llama") not in ("llama", "qwen2", "qwen3"):
        raise HeadLoadError(f"EAGLE-3 heads with {layer['model_type']!r} decoder layers are not supported (llama only).")
    verifier = (config.get("speculators_config") or {}).get("verifier") or {}
    settings = Eagle3Settings(
        draft_vocab_size=int(config["draft_vocab_size"]),
        aux_layer_ids=config.get("eagle_aux_hidden_state_layer_ids"),
        target_hidden_size=config.get("target_hidden_size"),
        norm_before_residual=bool(config.get("norm_before_residual", False)),
        norm_before_fc=bool(config.get("norm_before_fc", False)),
        fc_norm=bool(config.get("fc_norm", False)),
        norm_output=bool(config.get("norm_output", False)),
        verifier=verifier.get("name_or_path"),
        source_format="speculators",
    )
    return _layer_config(layer), settings


def _read_specforge(config: dict) -> tuple[LlamaConfig, Eagle3Settings]:
    eagle = config.get("eagle_config") or {}
    settings = Eagle3Settings(
        draft_vocab_size=int(config.get("draft_vocab_size") or config["vocab_size"]),
        aux_layer_ids=eagle.get("eagle_aux_hidden_state_layer_ids"),
        target_hidden_size=config.get("target_hidden_size"),
        norm_before_residual=bool(config.get("norm_before_residual", False)),
        source_format="specforge",
    )
    return _layer_config(config), settings


IGNORED_LAYER_FIELDS = ("architectures", "model_type", "eagle_config", "auto_map", "layer_types", "sliding_window",
                        "use_sliding_window")
"""Config fields the head's layers do not take: a head attends over every position of its cache (the `speculators`
trainer marks its layer `sliding_attention` with a window of 2048, longer than what it drafts from in practice)."""


def _layer_config(fields: dict) -> LlamaConfig:
    """A `LlamaConfig` for the head's decoder layers, with SDPA attention."""
    keep = {k: v for k, v in fields.items() if k not in IGNORED_LAYER_FIELDS}
    config = LlamaConfig(**keep)
    config._attn_implementation = "sdpa"
    return config


def _rename(name: str) -> str:
    """A weight's name in this module: without a `model.` prefix, `midlayer.*` (SpecForge) as `layers.0.*`."""
    name = name.removeprefix("model.")
    return name.replace("midlayer.", "layers.0.")


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if files:
        weights: dict[str, torch.Tensor] = {}
        for file in files:
            weights.update(load_file(file))
        return weights
    binaries = sorted(folder.glob("pytorch_model*.bin"))
    if not binaries:
        raise HeadLoadError(f"No weights in {folder}: expected *.safetensors or pytorch_model.bin.")
    weights = {}
    for file in binaries:
        weights.update(torch.load(file, map_location="cpu", weights_only=True))
    return weights


def _resolve(name_or_path: str | os.PathLike, revision: str | None) -> Path:
    """A local folder, or the Hub snapshot of a repository id (downloaded by `huggingface_hub`)."""
    path = Path(name_or_path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise HeadLoadError(f"{path} has no config.json: it is not a saved head.")
        return path
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(name_or_path), revision=revision, allow_patterns=["*.json", "*.safetensors", "*.bin"]))
    except Exception as error:  # noqa: BLE001 - any Hub failure becomes one clear message
        raise HeadLoadError(f"Could not load the EAGLE-3 head {str(name_or_path)!r}: no such folder, and {error}") from error
