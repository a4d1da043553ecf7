"""Training an EAGLE-3 draft head (`hf_dynspec.eagle3.Eagle3Head`) for a frozen target, saved in the `speculators`
format that vLLM serves and `Eagle3Head.from_pretrained` loads.

The target runs in inference mode on every batch (no hidden states are stored on disk): forward pre-hooks on its
auxiliary layers give the states the head reads (layer id `L` is the input of decoder layer `L`, transformers'
`hidden_states[L]`; id `n` is the last layer's output before the final norm, as vLLM takes it), and its last hidden
state times its output layer's rows of the draft vocabulary gives the distribution the head learns.

Training-time test (TTT, as `speculators`' `Eagle3DraftModel.forward` does it): after the shift of
`speculators.models.eagle3.data.shift_batch`, the head at position `t` reads the target's fused state at `t` and the
embedding of token `t + 1`, and learns the target's distribution of token `t + 2`. Step `k > 0` unrolls the drafting
chain: position `t` reads the head's own output state of step `k - 1` at `t` and the embedding of token `t + 1 + k`
(teacher-forced), at position `t + 1 + k`, and learns token `t + 2 + k`. Its queries attend to step 0's keys up to `t`
(causal) and to steps `1..k`'s keys at `t` only (the diagonal of each later block), which is what drafting `k` tokens
past position `t` with a KV cache sees. The loss is the forward KL divergence from the target's next-token
distribution restricted to the draft vocabulary to the head's, averaged over real positions and summed over steps with
weight `ttt_decay ** k`. The metrics are per step: top-1 agreement with the target, and the chain acceptance (steps
`0..k` all agree: what greedy verification would accept of a `k + 1`-token chain).
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import DynamicCache, LlamaConfig, PreTrainedModel

from .eagle3 import Eagle3Head, Eagle3Settings

SPECULATORS_VERSION = "0.9.0"
"""The `speculators` release whose format (config keys, weight names, conventions) the saved heads follow."""

DEFAULT_DRAFT_VOCAB = 32000
"""Draft vocabulary size of published EAGLE-3 heads for large-vocabulary targets."""


@dataclass
class HeadTrainingSettings:
    """How a head is trained (the `train-head` command's options)."""

    ttt_steps: int = 3  # training-time test steps (the chain length trained for)
    ttt_decay: float = 0.8  # the loss of step k is weighted ttt_decay ** k
    learning_rate: float = 3e-4
    weight_decay: float = 0.0
    warmup_steps: int | None = None  # None: 5% of the planned steps (at least 1)
    schedule: str = "cosine"  # "cosine" or "linear" decay after warm-up, to 0 at the end (or at the time budget)
    grad_clip: float = 0.5
    batch_size: int = 4
    epochs: int = 1
    max_length: int = 512  # tokens per sequence (longer ones are cut)
    draft_vocab_size: int = DEFAULT_DRAFT_VOCAB
    aux_layer_ids: list[int] | None = None  # None: (2, n // 2, n - 3), or spread ids for targets under 7 layers
    num_layers: int = 1
    norm_before_residual: bool = True  # the speculators trainer's defaults for new heads
    norm_before_fc: bool = True
    norm_output: bool = True
    autocast: str = "auto"  # "auto": the head's matmuls in bfloat16 (float32 weights) when the target is bfloat16
    minutes: float | None = None  # time budget of the training loop: stops cleanly and saves when spent
    seed: int = 0
    log_every: int = 1  # steps between entries of the log


@dataclass
class HeadTrainingLog:
    """What a run did: one record per logged step, plus the run's summary."""

    records: list[dict] = field(default_factory=list)
    steps: int = 0
    planned_steps: int = 0
    samples: int = 0
    tokens: int = 0
    wall_seconds: float = 0.0
    stopped_by: str = "finished"  # "finished", "time budget" or "interrupted"


# ---- the head's shape and vocabulary ------------------------------------------------------------------------------
def default_aux_layer_ids(num_layers: int) -> list[int]:
    """The auxiliary layer ids for a target of `num_layers` decoder layers: `(2, n // 2, n - 3)` as vLLM and
    `speculators` default to when these are distinct and valid (n >= 7), else three spread ids in `[0, n]`."""
    if num_layers >= 7:
        return [2, num_layers // 2, num_layers - 3]
    return sorted({round(i * num_layers / 2) for i in range(3)})


def head_layer_config(target: PreTrainedModel, num_layers: int = 1) -> LlamaConfig:
    """The head's decoder-layer config: a `LlamaConfig` with the target's width, heads, KV heads, head size, MLP width,
    rotary settings and RMS epsilon, its vocabulary size, and `num_layers` layers."""
    text = target.config.get_text_config()
    heads = text.num_attention_heads
    rope = getattr(text, "rope_parameters", None)
    if not rope:
        rope = {"rope_type": "default", "rope_theta": float(getattr(text, "rope_theta", 10000.0))}
    config = LlamaConfig(
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        hidden_act="silu",
        max_position_embeddings=getattr(text, "max_position_embeddings", 2048),
        rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
        rope_parameters=dict(rope),
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    return config


def draft_vocabulary(
    sequences: Sequence[Sequence[int]], vocab_size: int, draft_vocab_size: int, always: Sequence[int] = ()
) -> torch.LongTensor:
    """The sorted target ids of the draft vocabulary: the `always` ids (special tokens, EOS) and the most frequent
    tokens of `sequences`, filled up with the lowest unused ids when the data has fewer distinct tokens."""
    if draft_vocab_size >= vocab_size:
        return torch.arange(vocab_size)
    chosen = [i for i in dict.fromkeys(always) if 0 <= i < vocab_size][:draft_vocab_size]
    taken = set(chosen)
    counts = Counter(token for sequence in sequences for token in sequence)
    for token, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        if len(chosen) >= draft_vocab_size:
            break
        if token not in taken and 0 <= token < vocab_size:
            chosen.append(token)
            taken.add(token)
    filler = (i for i in range(vocab_size) if i not in taken)
    while len(chosen) < draft_vocab_size:
        chosen.append(next(filler))
    return torch.tensor(sorted(chosen), dtype=torch.long)


def special_ids(target: PreTrainedModel, tokenizer=None) -> list[int]:
    """EOS, BOS and pad ids of the target's configs, and the tokenizer's special ids."""
    ids: list[int] = []
    for config in (target.config.get_text_config(), getattr(target, "generation_config", None)):
        for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
            value = getattr(config, name, None) if config is not None else None
            ids.extend(value if isinstance(value, (list, tuple)) else [value] if value is not None else [])
    if tokenizer is not None:
        ids.extend(getattr(tokenizer, "all_special_ids", []) or [])
    return [int(i) for i in ids]


def final_norm(target: PreTrainedModel) -> nn.Module | None:
    """The target's final norm (`model.norm` in most families), or None."""
    decoder = target.get_decoder()
    norm = getattr(decoder, "norm", None) or getattr(decoder, "final_layernorm", None)
    return norm if isinstance(norm, nn.Module) and hasattr(norm, "weight") else None


def new_head(
    target: PreTrainedModel, target_ids: torch.LongTensor, settings: HeadTrainingSettings,
    verifier: str | None = None,
) -> Eagle3Head:
    """A float32 head for `target`: random decoder layer and `fc`, `lm_head` = the target's output-layer rows of the
    draft vocabulary `target_ids`, `norm` = the target's final norm; bound to the target (its embeddings)."""
    text = target.config.get_text_config()
    ids = list(settings.aux_layer_ids or default_aux_layer_ids(text.num_hidden_layers))
    eagle = Eagle3Settings(
        draft_vocab_size=len(target_ids), aux_layer_ids=ids, norm_before_residual=settings.norm_before_residual,
        norm_before_fc=settings.norm_before_fc, norm_output=settings.norm_output, verifier=verifier,
    )
    torch.manual_seed(settings.seed)
    head = Eagle3Head(head_layer_config(target, settings.num_layers), eagle).float()
    with torch.no_grad():
        head.d2t.copy_(target_ids - torch.arange(len(target_ids)))
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[target_ids.to(target.device)].float().cpu())
        norm = final_norm(target)
        if norm is not None and norm.weight.shape == head.norm.weight.shape:
            head.norm.weight.copy_(norm.weight.float().cpu())
    head.bind(target)
    return head.to(target.device)


# ---- the target's side ----------------------------------------------------------------------------------------------
class AuxStates:
    """Forward hooks that keep the target's states at the head's auxiliary layers during one forward."""

    def __init__(self, target: PreTrainedModel, ids: Sequence[int]) -> None:
        layers = getattr(target.get_decoder(), "layers", None)
        if not isinstance(layers, nn.ModuleList):
            raise ValueError(f"{type(target).__name__} keeps no decoder layers under `get_decoder().layers`: an "
                             "EAGLE-3 head cannot read its states.")
        self.ids, self.states = list(ids), {}
        self.handles = []
        for index in sorted(set(self.ids)):
            if index < len(layers):
                self.handles.append(layers[index].register_forward_pre_hook(self._before(index), with_kwargs=True))
            else:
                self.handles.append(layers[-1].register_forward_hook(self._after(index), with_kwargs=True))

    def _before(self, index: int):
        def hook(module, args, kwargs):
            self.states[index] = args[0] if args else kwargs["hidden_states"]

        return hook

    def _after(self, index: int):
        def hook(module, args, kwargs, output):
            self.states[index] = output[0] if isinstance(output, tuple) else output

        return hook

    def take(self) -> list[torch.Tensor]:
        states, self.states = self.states, {}
        return [states[i] for i in self.ids]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


@torch.no_grad()
def target_batch(
    target: PreTrainedModel, tap: AuxStates, input_ids: torch.LongTensor, attention_mask: torch.Tensor,
    target_ids: torch.LongTensor,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One target forward: its auxiliary states (`[batch, length, target_hidden]` each) and its logits at every
    position restricted to the draft vocabulary (`[batch, length, draft_vocab]`, float32): the verifier's output
    layer's rows of `target_ids` over its last (normed) hidden state."""
    decoder = target.get_decoder()
    out = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    last = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    output = target.get_output_embeddings()
    weight = output.weight[target_ids]
    bias = output.bias[target_ids] if getattr(output, "bias", None) is not None else None
    logits = nn.functional.linear(last, weight, bias).float()
    return tap.take(), logits


# ---- the training-time test ---------------------------------------------------------------------------------------
def ttt_mask(valid: torch.Tensor, step: int) -> torch.Tensor:
    """`[batch, 1, length, (step + 1) * length]` bool: step 0's keys causal over real positions (and each position
    itself, so no row is empty), then one diagonal block per later step."""
    length = valid.shape[1]
    eye = torch.eye(length, dtype=torch.bool, device=valid.device)
    causal = torch.ones(length, length, dtype=torch.bool, device=valid.device).tril()
    first = (causal & valid[:, None, :].bool()) | eye  # [batch, length, length]
    blocks = [first] + [eye.expand_as(first)] * step
    return torch.cat(blocks, dim=-1).unsqueeze(1)


def unroll(
    head: Eagle3Head, states: torch.Tensor, ids: torch.LongTensor, real: torch.Tensor, ttt_steps: int = 3
) -> Iterator[torch.Tensor]:
    """The head's draft logits (`[batch, length, draft_vocab]`) of each training-time-test step, on shifted inputs:
    `states` the target's fused states at `t` (`[batch, length, hidden]`), `ids` the tokens `t + 1`, `real` where they
    are real tokens. Step `k` reads the tokens shifted left by `k` more (zeros past the end), the head's own output
    states of step `k - 1`, positions `1 + t + k`, and attends to step 0's keys causally and to later steps' keys on
    the diagonal (`ttt_mask`): `speculators`' `Eagle3DraftModel.forward` with `ttt_steps`."""
    length = ids.shape[1]
    positions = torch.arange(1, length + 1, device=ids.device).expand(ids.shape[0], -1)
    embeddings = head.get_input_embeddings()
    cache = DynamicCache()
    hidden = states
    for step in range(min(ttt_steps, length)):
        shifted = torch.cat([ids[:, step:], ids.new_zeros(ids.shape[0], step)], dim=1)
        with torch.no_grad():
            embeds = embeddings(shifted).to(head.fc.weight.dtype)
        hidden = head.step(embeds, hidden, positions + step, ttt_mask(real, step), cache)
        yield head.draft_logits(hidden).float()


def ttt_forward(
    head: Eagle3Head, aux: list[torch.Tensor], input_ids: torch.LongTensor, valid: torch.Tensor,
    target_logits: torch.Tensor, ttt_steps: int = 3, ttt_decay: float = 0.8,
) -> tuple[torch.Tensor, dict]:
    """The head's loss and metrics on one batch (unshifted: `input_ids`, `valid` `[batch, length]`, the target's
    `aux` states and `target_logits` at the same positions), over `ttt_steps` steps of the training-time test."""
    ids = input_ids[:, 1:]  # token t + 1 beside the state at t
    states = head.fuse([state[:, :-1] for state in aux])  # [batch, length - 1, hidden]
    targets = target_logits[:, 1:]  # the target's distribution of token t + 2
    real = valid[:, 1:].bool()
    length = ids.shape[1]
    loss = targets.new_zeros(())
    chain = real.clone()  # the chains starting at t that agreed on every step so far
    metrics: dict = {"accuracy": [], "acceptance": [], "step_loss": []}
    for step, logits in enumerate(unroll(head, states, ids, real, ttt_steps)):
        # chains starting at t: the logits at t predict token t + 2 + step, the target's at t + step
        own, theirs = logits[:, : length - step], targets[:, step:]
        where = real[:, step:] & real[:, : length - step]
        count = where.sum().clamp(min=1)
        log_q = torch.log_softmax(own, -1)
        log_p = torch.log_softmax(theirs, -1)
        kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # [batch, length - step]
        step_loss = (kl * where).sum() / count
        loss = loss + (ttt_decay**step) * step_loss
        with torch.no_grad():
            agree = (own.argmax(-1) == theirs.argmax(-1)) & where
            chain[:, : length - step] &= agree
            metrics["accuracy"].append(float(agree.sum() / count))
            metrics["acceptance"].append(float((chain[:, : length - step] & where).sum() / count))
            metrics["step_loss"].append(float(step_loss))
    metrics["loss"] = float(loss.detach())
    return loss, metrics


# ---- data ---------------------------------------------------------------------------------------------------------
def batches(
    sequences: Sequence[Sequence[int]], batch_size: int, pad_id: int, generator: random.Random
) -> list[tuple[torch.LongTensor, torch.Tensor]]:
    """Shuffled right-padded batches `(input_ids, attention_mask)` of sequences of similar lengths."""
    order = list(range(len(sequences)))
    generator.shuffle(order)
    # sort within windows of a few batches: less padding, still shuffled
    window = batch_size * 8
    order = [i for start in range(0, len(order), window)
             for i in sorted(order[start : start + window], key=lambda i: len(sequences[i]))]
    chunks = [order[start : start + batch_size] for start in range(0, len(order), batch_size)]
    generator.shuffle(chunks)
    out = []
    for chunk in chunks:
        width = max(len(sequences[i]) for i in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(chunk):
            ids[row, : len(sequences[i])] = torch.tensor(sequences[i], dtype=torch.long)
            mask[row, : len(sequences[i])] = 1
        out.append((ids, mask))
    return out


@torch.no_grad()
def self_distill(
    target: PreTrainedModel, prompts: Sequence[Sequence[int]], new_tokens: int, pad_id: int, batch_size: int = 8,
    deadline: float | None = None, progress: bool = True,
) -> list[list[int]]:
    """Each prompt followed by up to `new_tokens` tokens the target generates greedily after it (up to its EOS).
    Past `deadline` (a `time.monotonic()` value), the remaining prompts are kept without continuations."""
    from tqdm.auto import tqdm

    out: list[list[int]] = []
    bar = tqdm(total=len(prompts), desc="self-distillation", disable=not progress, unit="prompt")
    for start in range(0, len(prompts), batch_size):
        chunk = [list(p) for p in prompts[start : start + batch_size]]
        if deadline is not None and time.monotonic() > deadline:
            out.extend(chunk)
            bar.update(len(chunk))
            continue
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(chunk):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        generated = target.generate(
            ids.to(target.device), attention_mask=mask.to(target.device), max_new_tokens=new_tokens, do_sample=False,
            pad_token_id=pad_id,
        )[:, width:].cpu()
        eos = target.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
        for prompt, row in zip(chunk, generated.tolist()):
            tail = []
            for token in row:
                tail.append(token)
                if token in eos:
                    break
            out.append(prompt + tail)
        bar.update(len(chunk))
    bar.close()
    return out


# ---- the training loop --------------------------------------------------------------------------------------------
def _schedule(settings: HeadTrainingSettings, warmup: int) -> Callable[[int, float], float]:
    def factor(step: int, progress: float) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(max(progress, 0.0), 1.0)
        if settings.schedule == "linear":
            return max(1.0 - progress, 0.0)
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def train_head(
    target: PreTrainedModel,
    sequences: Sequence[Sequence[int]],
    settings: HeadTrainingSettings | None = None,
    *,
    head: Eagle3Head | None = None,
    tokenizer=None,
    pad_id: int | None = None,
    verifier: str | None = None,
    progress: bool = True,
    deadline: float | None = None,
) -> tuple[Eagle3Head, HeadTrainingLog]:
    """Train an EAGLE-3 head for the frozen `target` on token `sequences` (each cut to `settings.max_length`).

    A new head (`new_head`, its draft vocabulary the most frequent tokens of `sequences` plus the special ids) unless
    `head` is given. The head trains in float32 whatever the target's dtype; the target's states are cast to it.
    The schedule reaches its end at the last planned step or at the time budget (`settings.minutes`, or `deadline`, a
    `time.monotonic()` value), whichever comes first; the loop stops there, or at Ctrl-C, and returns what it has."""
    from tqdm.auto import tqdm

    settings = settings or HeadTrainingSettings()
    started = time.monotonic()
    if settings.minutes is not None:
        budget_end = started + 60 * settings.minutes
        deadline = budget_end if deadline is None else min(deadline, budget_end)
    sequences = [list(s)[: settings.max_length] for s in sequences if len(s) >= 3]
    if not sequences:
        raise ValueError("No training sequence of 3 tokens or more.")
    text = target.config.get_text_config()
    if pad_id is None:
        pad_id = text.pad_token_id if text.pad_token_id is not None else 0
    if head is None:
        ids = draft_vocabulary(sequences, text.vocab_size, settings.draft_vocab_size, special_ids(target, tokenizer))
        head = new_head(target, ids, settings, verifier)
    head.train()
    target.eval()
    for parameter in target.parameters():
        parameter.requires_grad_(False)
    target_ids = head.target_ids.to(target.device)
    tap = AuxStates(target, head.aux_layer_ids(text.num_hidden_layers))
    parameters = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=settings.learning_rate, betas=(0.9, 0.95),
                                  weight_decay=settings.weight_decay)
    batches_per_epoch = math.ceil(len(sequences) / settings.batch_size)
    planned = batches_per_epoch * settings.epochs
    warmup = settings.warmup_steps if settings.warmup_steps is not None else max(1, planned // 20)
    factor = _schedule(settings, max(warmup, 1))
    log = HeadTrainingLog(planned_steps=planned)
    generator = random.Random(settings.seed)
    torch.manual_seed(settings.seed)
    bar = tqdm(total=planned, desc="train-head", disable=not progress, unit="step")
    device = target.device
    autocast = head_autocast(settings.autocast, target)
    try:
        for _epoch in range(settings.epochs):
            for input_ids, mask in batches(sequences, settings.batch_size, pad_id, generator):
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    log.stopped_by = "time budget"
                    raise StopIteration
                progress_share = log.steps / planned
                if deadline is not None:
                    progress_share = max(progress_share, (now - started) / max(deadline - started, 1e-9))
                lr = settings.learning_rate * factor(log.steps, progress_share)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                input_ids, mask = input_ids.to(device), mask.to(device)
                aux, target_logits = target_batch(target, tap, input_ids, mask, target_ids)
                with autocast:
                    loss, metrics = ttt_forward(
                        head, aux, input_ids, mask, target_logits, settings.ttt_steps, settings.ttt_decay
                    )
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(parameters, settings.grad_clip)
                optimizer.step()
                log.steps += 1
                log.samples += input_ids.shape[0]
                log.tokens += int(mask.sum())
                if log.steps % settings.log_every == 0 or log.steps == planned:
                    log.records.append({
                        "step": log.steps, "seconds": round(time.monotonic() - started, 3), "lr": lr,
                        "grad_norm": float(norm), "samples": log.samples, **metrics,
                    })
                bar.update(1)
                bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc=f"{metrics['accuracy'][0]:.2f}",
                                accept="/".join(f"{a:.2f}" for a in metrics["acceptance"]))
    except StopIteration:
        pass
    except KeyboardInterrupt:
        log.stopped_by = "interrupted"
    finally:
        bar.close()
        tap.remove()
    log.wall_seconds = time.monotonic() - started
    return head.eval(), log


def head_autocast(mode: str, target: PreTrainedModel):
    """`torch.autocast` to bfloat16 for the head's forward and backward when `mode` is `"bf16"`, or `"auto"` with a
    bfloat16 target (its device computes in it); a disabled context otherwise (`"off"`, `"auto"` with another dtype).
    The head's weights, optimiser states and loss stay float32."""
    if mode not in ("auto", "bf16", "off"):
        raise ValueError(f"autocast must be auto, bf16 or off, got {mode!r}.")
    enabled = mode == "bf16" or (mode == "auto" and target.dtype == torch.bfloat16)
    return torch.autocast(device_type=target.device.type, dtype=torch.bfloat16, enabled=enabled)


@torch.no_grad()
def evaluate_head(
    head: Eagle3Head, target: PreTrainedModel, sequences: Sequence[Sequence[int]], ttt_steps: int = 3,
    batch_size: int = 4, max_length: int = 512, pad_id: int = 0, autocast: str = "auto",
) -> dict:
    """The training-time test's loss and metrics of `head` on `sequences` (token-weighted means over batches)."""
    text = target.config.get_text_config()
    tap = AuxStates(target, head.aux_layer_ids(text.num_hidden_layers))
    target_ids = head.target_ids.to(target.device)
    totals: dict = {}
    weight = 0
    try:
        sequences = [list(s)[:max_length] for s in sequences if len(s) >= 3]
        for input_ids, mask in batches(sequences, batch_size, pad_id, random.Random(0)):
            input_ids, mask = input_ids.to(target.device), mask.to(target.device)
            aux, logits = target_batch(target, tap, input_ids, mask, target_ids)
            with head_autocast(autocast, target):
                _, metrics = ttt_forward(head, aux, input_ids, mask, logits, ttt_steps)
            tokens = int(mask.sum())
            weight += tokens
            for name, value in metrics.items():
                if isinstance(value, list):
                    totals.setdefault(name, [0.0] * len(value))
                    totals[name] = [a + b * tokens for a, b in zip(totals[name], value)]
                else:
                    totals[name] = totals.get(name, 0.0) + value * tokens
    finally:
        tap.remove()
    return {name: [v / weight for v in value] if isinstance(value, list) else value / weight
            for name, value in totals.items()}


# ---- saving -------------------------------------------------------------------------------------------------------
