"""Position keys or context keys for coupled sampling: which lets more of an epoch repeat the one before?

Coupled sampling can key each token's noise by its position in the response (`hf_dynspec.coupling`). A row whose
update changed one token keeps its noise aligned with the earlier sample at every later position, and may re-join
it after a substitution; an inserted or dropped token shifts every later position, and the row samples with other
noise from then on. Keying by context instead (the last 4 tokens, and how often they occurred before in the row's
response, so no key repeats within a row; `DynSpecConfig(coupling_keys=...)`) re-aligns after a shift as soon as 4
tokens agree again, but a substitution changes the keys of the next 4 positions.

This probe samples the rollout scenario (2 ShareGPT prompts x 8 samples, temperature 1) with both keyings through a
plain token-by-token sampler, takes `--updates` GRPO steps with a LoRA adapter (`evaluation.epochs.train_grpo`),
samples again with both (and, before any update, with the same weights in batches of half the rows, whose forwards
round otherwise in low precision), and counts with hindsight the tokens of the second epoch that a rollout cache could propose
right: by position (the earlier sample's token at the same position) or by context (the token that followed the same
key in the earlier sample; `evaluation.epochs.oracle_widths`), and the verify forwards the best schedule would then
need. Both keyings, sampled here with the library's keys, give the speculative loop's coupled samples (checked for
the configured default; in low precision up to near ties).

    python evaluation/probes/context_keys.py --updates 4 --max-new-tokens 256 --out context_keys.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
from transformers import DynamicCache

from hf_dynspec.config import DynSpecConfig
from hf_dynspec.coupling import CONTEXT_TOKENS, RowKeys, gumbel_noise, stream_keys
from hf_dynspec.evaluation.bench import load_inputs
from hf_dynspec.evaluation.epochs import (
    EpochSettings,
    _tokenizer,
    oracle_widths,
    sample_coupled,
    train_grpo,
)
from hf_dynspec.evaluation.runner import left_pad, trim
from hf_dynspec.evaluation.settings import SCENARIOS, BenchSettings


@torch.inference_mode()
def sample_keyed(model, prompts: list[list[int]], settings: BenchSettings, keying: str) -> list[list[int]]:
    """Each row's sample, token by token with a KV cache, its noise keyed by `keying` ('position' or 'context')."""
    config = model.generation_config
    eos = set(config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id])
    pad = int(config.pad_token_id if config.pad_token_id is not None else next(iter(eos)))
    ids, mask = left_pad(prompts, pad)
    streams = stream_keys(prompts, DynSpecConfig().seed)  # [rows]
    rows = [[] for _ in prompts]
    keys = [RowKeys(prompt, keying) for prompt in prompts]
    cache, positions = DynamicCache(), (mask.cumsum(-1) - 1).clamp(min=0)
    inputs, done = ids, torch.zeros(len(prompts), dtype=torch.bool)
    for _ in range(settings.max_new_tokens):
        logits = model(input_ids=inputs, attention_mask=mask, position_ids=positions[:, -inputs.shape[1]:],
                       past_key_values=cache, use_cache=True).logits[:, -1].float()
        scores = logits / (settings.temperature or 1.0)  # the rollout's top-p 1 and top-k 0 change nothing
        next_keys = torch.tensor([row_keys.along()[0] for row_keys in keys])  # [rows]
        tokens = (scores + gumbel_noise(streams, next_keys, scores.shape[-1])).argmax(-1)
        for i, token in enumerate(tokens.tolist()):
            if not done[i]:
                keys[i].extend([token])
                rows[i].append(token)
                done[i] = token in eos
        if bool(done.all()):
            break
        inputs = torch.where(done, pad, tokens).unsqueeze(1)
        mask = torch.cat([mask, (~done).long().unsqueeze(1)], dim=1)
        positions = torch.cat([positions, positions[:, -1:] + 1], dim=1)
    return trim(torch.tensor([row + [pad] * (settings.max_new_tokens - len(row)) for row in rows]), eos)


def summary(prompts, first, second, keying: str) -> dict:
    widths = [oracle_widths(a, b, prompt=p, keying=keying) for p, a, b in zip(prompts, first, second)]
    tokens = sum(len(row) - 1 for row in second)
    return {
        "identical_rows": sum(a == b for a, b in zip(first, second)),
        "reusable_share": sum(sum(w) - len(w) for w in widths) / max(tokens, 1),
        "forwards": sum(map(len, widths)),
        "tokens_after_prefill": tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    preset = {k: v for k, v in SCENARIOS["rollout"].items() if k not in ("methods", "do_sample")}
    settings = BenchSettings(**{**preset, "max_new_tokens": args.max_new_tokens}, do_sample=True, tiny=args.tiny,
                             scenario="rollout")
    from peft import LoraConfig, get_peft_model

    target, _, prompts = load_inputs(settings, need_draft=False)
    policy = get_peft_model(target, LoraConfig(r=16, lora_alpha=32, task_type="CAUSAL_LM")).eval()
    base = policy.get_base_model()
    first = {keying: sample_keyed(base, prompts, settings, keying) for keying in ("position", "context")}
    loop = sample_coupled(base, prompts, settings)
    differ = sum(a != b for a, b in zip(loop, first[DynSpecConfig().coupling_keys]))
    print(f"{DynSpecConfig().coupling_keys}-keyed samples as the loop's coupled ones: {len(loop) - differ}/{len(loop)} rows (in low precision "
          "the two forwards round differently, and a near tie of perturbed scores may flip)")
    results = {"rows_as_the_loop": len(loop) - differ, "numerics": {}}
    half = len(prompts) // 2  # the same weights in batches of half the rows: forwards of other shapes round otherwise
    for keying in ("position", "context"):
        halves = [row for part in (prompts[:half], prompts[half:]) for row in sample_keyed(base, part, settings, keying)]
        results["numerics"][keying] = summary(prompts, first[keying], halves, keying)
        print(f"{keying} keys, no update, other batch shapes: {results['numerics'][keying]}")

    def measure(steps: int) -> None:
        for keying in ("position", "context"):
            second = sample_keyed(base, prompts, settings, keying)
            results[keying] = summary(prompts, first[keying], second, keying)
            print(f"{keying} keys after {steps} update(s): {results[keying]}")

    epochs = EpochSettings(updates=[args.updates], learning_rate=args.learning_rate)
    train_grpo(policy, _tokenizer(settings), prompts, dataclasses.replace(settings), epochs, measure, progress=False)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"settings": vars(args), "context_tokens": CONTEXT_TOKENS, "results": results}, handle, indent=1)


if __name__ == "__main__":
    main()
