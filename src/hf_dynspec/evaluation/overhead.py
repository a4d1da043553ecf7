"""The launch-bound proxy (`hf-dynspec bench --scenario overhead`): what the loop costs per forward when a forward's
time is the framework's host cost per operator, as on a GPU in eager mode.

The proxy target has the default target's depth (28 Qwen2 layers) and vocabulary at width 64, so a forward costs
what its operators cost to launch, not what its weights cost to read. Its embeddings are tiny (and its norms'
epsilon tinier), so its residual stream is its first layer's output, and its later layers add nothing to it (zero
output projections) while still running. A one-layer EAGLE-3 head built from its first layer (`mirror_head`)
therefore predicts what it predicts: every draft token is accepted, and the loop's speed over plain decoding is what
its own cost per forward allows. A full-depth draft (a copy of the target) is accepted as well and shows what a
draft model costs in this regime.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections import Counter
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, PreTrainedModel, Qwen2Config, Qwen2ForCausalLM

from ..config import DynSpecConfig
from ..eagle3 import Eagle3Head, Eagle3Settings
from ..loop import speculative_loop

PROXY_LAYERS, PROXY_WIDTH, PROXY_VOCAB = 28, 64, 151_936
"""The default target's depth and vocabulary (Qwen2.5-Coder 1.5B) at width 64."""

OVERHEAD_METHODS = ("plain", "head-static:4", "head-static:8", "head-default", "draft-static:4")
"""Plain `generate`; the loop with the one-layer head at static lengths and with the default config (`DynSpecConfig()`);
the loop with the full-depth draft at static length 4."""


def proxy_target(layers: int = PROXY_LAYERS, width: int = PROXY_WIDTH, vocab: int = PROXY_VOCAB, seed: int = 0) -> Qwen2ForCausalLM:
    """The proxy target: `layers` Qwen2 layers of width `width`, tiny embeddings, every layer after the first silent."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-30, tie_word_embeddings=False,
        max_position_embeddings=4096,
    )
    target = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        target.model.embed_tokens.weight.mul_(1e-6)
        for layer in target.model.layers[1:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    target.generation_config.eos_token_id = None
    target.generation_config.pad_token_id = 0
    return target


def mirror_head(target: PreTrainedModel) -> Eagle3Head:
    """A one-layer EAGLE-3 head that predicts what `target` predicts when the target's residual stream is its first
    layer's output: the target's first layer attending over the embedding half of the head's input, the state the
    head reads normalised to zero (so it enters neither attention nor the residual stream), the target's final norm
    and output layer over the whole vocabulary."""
    text = target.config.get_text_config()
    layer = target.get_decoder().layers[0]
    config = LlamaConfig(
        vocab_size=text.vocab_size, hidden_size=text.hidden_size, intermediate_size=text.intermediate_size,
        num_hidden_layers=1, num_attention_heads=text.num_attention_heads,
        num_key_value_heads=text.num_key_value_heads, rms_norm_eps=text.rms_norm_eps,
        attention_bias=layer.self_attn.q_proj.bias is not None, max_position_embeddings=text.max_position_embeddings,
    )
    config.rope_parameters = copy.deepcopy(getattr(text, "rope_parameters", None)) or config.rope_parameters
    head = Eagle3Head(config, Eagle3Settings(draft_vocab_size=text.vocab_size, aux_layer_ids=[0, 1, 1],
                                             norm_before_residual=True))
    ours = head.layers[0]
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.zero_()
        for name in ("q_proj", "k_proj", "v_proj"):
            mine, theirs = getattr(ours.self_attn, name), getattr(layer.self_attn, name)
            mine.weight[:, : theirs.weight.shape[1]] = theirs.weight
            if theirs.bias is not None:
                mine.bias.copy_(theirs.bias)
        ours.self_attn.o_proj.weight.copy_(layer.self_attn.o_proj.weight)
        ours.mlp.load_state_dict(layer.mlp.state_dict())
        ours.input_layernorm.load_state_dict(layer.input_layernorm.state_dict())
        ours.post_attention_layernorm.load_state_dict(layer.post_attention_layernorm.state_dict())
        head.norm.load_state_dict(target.get_decoder().norm.state_dict())
        head.lm_head.weight.copy_(target.get_output_embeddings().weight)
    return head.to(target.dtype).eval()


class OperatorCount(TorchDispatchMode):
    """Counts the aten operators run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


@dataclass
class OverheadRun:
    """One method on one prompt."""

    seconds: float
    tokens: int
    target_forwards: int
    draft_forwards: int


def run_method(method: str, target, head, draft, prompt: torch.LongTensor, new: int) -> OverheadRun:
    """Generate `new` tokens after `prompt` (`[1, length]`) with `method` (`OVERHEAD_METHODS`)."""
    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, attention_mask=torch.ones_like(prompt))
    if method != "plain":
        kind, _, setting = method.partition("-")
        config = DynSpecConfig() if setting == "default" else DynSpecConfig(
            policy="static", num_speculative_tokens=int(setting.split(":")[1]), proposer="draft"
        )
        kwargs |= dict(assistant_model=head if kind == "head" else draft, custom_generate=speculative_loop,
                       dynspec_config=config, return_dict_in_generate=True)
    start = time.perf_counter()
    with torch.inference_mode():
        out = target.generate(prompt, **kwargs)
    seconds = time.perf_counter() - start
    if method == "plain":
        return OverheadRun(seconds, new, new, 0)
    stats = out.dynspec_stats
    return OverheadRun(seconds, new, stats.target_forwards, stats.draft_forwards)


def count_operators(method: str, target, head, draft, prompt: torch.LongTensor, new: int) -> int:
    """Aten operators one generation of `method` runs."""
    with OperatorCount() as counter:
        run_method(method, target, head, draft, prompt, new)
    return counter.count


def measure_overhead(
    num_prompts: int = 16, prompt_length: int = 32, new: int = 48, repetitions: int = 3,
    methods: tuple[str, ...] = OVERHEAD_METHODS, progress: bool = True, seed: int = 0,
) -> dict:
    """Per method: median ms per token over prompts and repetitions (each repetition's per-prompt times summed),
    target and draft forwards, aten operators per token and per forward (one prompt, counted apart)."""
    from tqdm.auto import tqdm

    target = proxy_target(seed=seed)
    head, draft = mirror_head(target), copy.deepcopy(target)
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, target.config.vocab_size, (1, prompt_length), generator=generator) for _ in range(num_prompts)]
    for method in methods:  # warm-up: one-off measurements and first-call costs
        run_method(method, target, head, draft, prompts[0], 8)
    times: dict[str, list[float]] = {m: [] for m in methods}
    counts: dict[str, Counter] = {m: Counter() for m in methods}
    bar = tqdm(total=repetitions * len(methods) * num_prompts, desc="overhead proxy", disable=not progress)
    for _ in range(repetitions):
        for method in methods:
            runs = [run_method(method, target, head, draft, p, new) for p in prompts]
            bar.update(len(prompts))
            times[method].append(1000 * sum(r.seconds for r in runs) / sum(r.tokens for r in runs))
            counts[method] = Counter(target=sum(r.target_forwards for r in runs), draft=sum(r.draft_forwards for r in runs))
    bar.close()
    plain = statistics.median(times["plain"]) if "plain" in times else None
    rows = []
    for method in methods:
        operators = count_operators(method, target, head, draft, prompts[0], new)
        forwards = (counts[method]["target"] + counts[method]["draft"]) / num_prompts
        ms = statistics.median(times[method])
        rows.append(dict(
            method=method, ms_per_token=ms, ms_per_token_repetitions=times[method],
            x_plain=plain / ms if plain else None,
            target_forwards=counts[method]["target"] / num_prompts, draft_forwards=counts[method]["draft"] / num_prompts,
            operators_per_token=operators / new, operators_per_forward=operators / forwards if forwards else None,
        ))
    settings = dict(layers=PROXY_LAYERS, width=PROXY_WIDTH, vocab=PROXY_VOCAB, num_prompts=num_prompts,
                    prompt_length=prompt_length, max_new_tokens=new, repetitions=repetitions, dtype="float32")
    return dict(scenario="overhead", settings=settings, rows=rows)


def overhead_table(results: dict) -> str:
    """The proxy's markdown table."""
    lines = ["| method | ms / token | x plain | target forwards | draft forwards | aten ops / token | aten ops / forward |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in results["rows"]:
        per_forward = f"{row['operators_per_forward']:.0f}" if row["operators_per_forward"] else "-"
        lines.append(
            f"| {row['method']} | {row['ms_per_token']:.2f} | {row['x_plain']:.2f}x | {row['target_forwards']:.1f} | "
            f"{row['draft_forwards']:.1f} | {row['operators_per_token']:.0f} | {per_forward} |"
        )
    return "\n".join(lines)
