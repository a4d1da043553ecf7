"""`hf-dynspec train-head`: train an EAGLE-3 draft head for a target model, saved in the `speculators` format.

    hf-dynspec train-head --target qwen2.5-coder-1.5b --out heads/qwen2.5-coder-1.5b-eagle3 \\
        --dataset humaneval,sharegpt --prompt-offset 32 --max-samples 600 --self-distill 96 --max-length 384 \\
        --minutes 165 --eval-samples 24
    hf-dynspec train-head --tiny --out /tmp/tiny-head --minutes 0.2      # tiny random target, random tokens (tests)

The first line fits in 3 hours on 2 CPU cores (Intel Xeon with AMX, the target in bfloat16, a busy machine): a
batch of 2 x 256 tokens took about 8 s for the target's forward and 10 s for the head's three TTT steps, forward
and backward, so about 30 tokens a second, some 400 samples of about 250 tokens an hour (the schedule ends at the
time budget, so the run stops by itself; loading the model, the held-out evaluation and saving take a few minutes
more). That is far less data than published heads see (hundreds of thousands of samples on GPUs): expect a
head that helps on text like its training data, not a general one.

Train on the target's own answers (`--self-distill`, on by default): a head drafts answers, and prompts alone teach
it little. A head trained 50 minutes on 1036 ShareGPT prompts alone reached a held-out chain acceptance of 0.58 /
0.44 / 0.39, measured on prompt text whose chat template repeats in every sequence, yet on the target's answers to
HumanEval it drafted 2 right tokens of 129 (`docs/benchmarks/head_humaneval_b1_48_amx.json`: the default policy
stopped drafting with it). Measure a head where it will draft: `evaluation/head_headroom.py` gives its chains along
the target's greedy answers, and `--prompt-offset` keeps a benchmark's prompts out of training.

What it does:
- loads the target (`--target`: registry name, local path or Hub id, in `--dtype`) and freezes it;
- builds the training sequences: the prompts of `--dataset` (comma-separated names of `hf_dynspec.evaluation.data`,
  or `.jsonl` paths; chat prompts rendered with the chat template), at most `--max-samples` in all, each cut to
  `--max-length` tokens; with `--self-distill N`, each prompt followed by up to N tokens the target generates
  greedily after it (what the head will be asked to draft; batches of at least 16 prompts; this takes at most 40% of
  `--minutes`);
- picks the draft vocabulary: the `--draft-vocab-size` most frequent tokens of those sequences plus the special ids;
- trains a one-layer head (`hf_dynspec.head_training`): the target's states at layers (2, n // 2, n - 3) computed on
  the fly per batch, the training-time test over `--ttt-steps` steps (the head fed its own states, as when it
  drafts), forward-KL loss against the target's next-token distribution over the draft vocabulary, AdamW with warm-up
  and cosine decay, gradient clipping; the head's weights are float32 (its matmuls run under bfloat16 autocast when
  the target is bfloat16, which a CPU with AMX computes about twice as fast). The schedule ends at the last step of `--epochs`
  epochs or when `--minutes` is spent, whichever comes first; Ctrl-C also stops it cleanly, and the head is saved;
- writes to `--out`: `config.json` and `model.safetensors` (the `speculators` format: vLLM serves it with
  `--speculative-config '{"method": "eagle3", "model": "OUT", "num_speculative_tokens": 3}'`, and
  `hf_dynspec.eagle3.Eagle3Head.from_pretrained("OUT")` loads it), `training.json` (settings, versions, wall time,
  per-step loss, top-1 agreement and chain acceptance) and `training.png` (loss and acceptance against the step).

Use it:

```python
head = Eagle3Head.from_pretrained("OUT", dtype=model.dtype)
out = hf_dynspec.generate(model, **inputs, assistant_model=head, max_new_tokens=64)
```

The acceptance printed and plotted is measured on the training batches, teacher-forced; `--eval-samples N` holds
out N sequences and reports the same metrics on them after training.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from ..evaluation.models import DEFAULT_TARGET, DTYPE_CHOICES, DTYPES
from ..head_training import DEFAULT_DRAFT_VOCAB, HeadTrainingSettings

SELF_DISTILL_SHARE = 0.4
"""The share of `--minutes` that generating `--self-distill` continuations may take."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register the `train-head` sub-command."""
    defaults = HeadTrainingSettings()
    parser = subparsers.add_parser(
        "train-head",
        help="Train an EAGLE-3 draft head for a target; saved in the speculators format (vLLM, Eagle3Head).",
        description=(__doc__ or "").split("\n\n")[0],
        epilog="See the module docstring of hf_dynspec.commands.train_head for what it does step by step.",
    )
    parser.add_argument("--target", default=None, metavar="NAME",
                        help=f"Target model: registry name, local path or Hub id (default {DEFAULT_TARGET}).")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                        help="The target's dtype (auto: the checkpoint's; bfloat16 for GGUF registry models on CPUs "
                        "that compute in it). The head trains in float32.")
    parser.add_argument("--out", required=True, help="Folder to write the head, training.json and training.png to.")
    parser.add_argument("--dataset", default="humaneval,sharegpt",
                        help="Comma-separated prompt sources (hf_dynspec.evaluation.data names or .jsonl paths).")
    parser.add_argument("--max-samples", type=int, default=512, help="Training sequences in all (split over sources).")
    parser.add_argument("--prompt-offset", type=int, default=0, metavar="N",
                        help="Skip each source's first N prompts (the bench's `--prompt-offset`: keep the prompts a "
                        "benchmark measures out of training).")
    parser.add_argument("--max-length", type=int, default=defaults.max_length, help="Tokens per sequence at most.")
    parser.add_argument("--self-distill", type=int, default=96, metavar="N",
                        help="Append up to N tokens the target generates greedily after each prompt (0: prompts "
                        "only, which teaches a head little it can draft: see the module's docstring).")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--learning-rate", type=float, default=defaults.learning_rate)
    parser.add_argument("--epochs", type=int, default=defaults.epochs)
    parser.add_argument("--ttt-steps", type=int, default=defaults.ttt_steps,
                        help="Training-time test steps (the chain length trained for; also the config's "
                        "speculative_tokens).")
    parser.add_argument("--ttt-decay", type=float, default=defaults.ttt_decay,
                        help="Loss weight of TTT step k: decay**k.")
    parser.add_argument("--draft-vocab-size", type=int, default=DEFAULT_DRAFT_VOCAB,
                        help="Draft vocabulary size (the most frequent tokens of the data; capped at the target's).")
    parser.add_argument("--minutes", type=float, default=None,
                        help="Time budget of the whole run; training stops cleanly and saves when it is spent.")
    parser.add_argument("--eval-samples", type=int, default=0,
                        help="Hold out this many sequences and report the metrics on them after training.")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--tiny", action="store_true",
                        help="A tiny random target (hf_dynspec.evaluation.tiny) and random token data, for tests.")
    parser.add_argument("--quiet", action="store_true", help="No progress bars; only the final summary line.")
    parser.set_defaults(func=run)


def _load(args: argparse.Namespace):
    """`(target, tokenizer or None, verifier name for the config)`."""
    if args.tiny:
        from ..evaluation.tiny import tiny_pair

        if args.target:
            raise ValueError("--tiny builds its own target; drop --target (or drop --tiny).")
        target = tiny_pair(seed=args.seed)[0]
        return target.to({"auto": torch.float32, **DTYPES}[args.dtype]), None, "tiny-target"
    from ..evaluation.models import REGISTRY, LoadOptions, ModelSourceError, load_model, load_tokenizer, resolve_model

    name = args.target or DEFAULT_TARGET
    try:
        location = resolve_model(name)
        target = load_model(location, LoadOptions(dtype=args.dtype))
    except ModelSourceError as error:
        raise ValueError(str(error)) from error
    tokenizer = load_tokenizer(location)
    verifier = REGISTRY[name].hub_id if name in REGISTRY else name
    return target, tokenizer, verifier


def _sequences(args: argparse.Namespace, target, tokenizer) -> list[list[int]]:
    """The prompts' token ids (before self-distillation), at most `--max-samples`, each cut to `--max-length`."""
    if args.tiny:
        from ..evaluation.data import random_token_prompts

        vocab = target.config.vocab_size
        return random_token_prompts(args.max_samples, vocab, min(16, args.max_length), args.max_length,
                                    seed=args.seed, low=2)
    from ..evaluation.data import encode, load_prompts

    sources = [name.strip() for name in args.dataset.split(",") if name.strip()]
    if not sources:
        raise ValueError("--dataset names no prompt source.")
    sequences: list[list[int]] = []
    for index, source in enumerate(sources):
        share = (args.max_samples - len(sequences)) // (len(sources) - index)
        if share < 1:
            continue
        prompts = load_prompts(source, share + args.prompt_offset)[args.prompt_offset :]
        sequences.extend(ids[: args.max_length] for ids in encode(prompts, tokenizer))
    return sequences


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    deadline = started + 60 * args.minutes if args.minutes is not None else None
    if args.prompt_offset < 0:
        raise ValueError(f"--prompt-offset must be >= 0 (prompts to skip per source), got {args.prompt_offset}.")
    if args.max_samples < 1 or args.max_length < 3 or args.batch_size < 1 or args.epochs < 1 or args.ttt_steps < 1:
        raise ValueError("--max-samples, --batch-size, --epochs and --ttt-steps must be at least 1, "
                         "--max-length at least 3.")
    from ..eagle3 import Eagle3Head
    from ..head_saving import plot_log, save_head, write_log
    from ..head_training import evaluate_head, self_distill, train_head

    torch.manual_seed(args.seed)
    target, tokenizer, verifier = _load(args)
    text = target.config.get_text_config()
    pad_id = text.pad_token_id if text.pad_token_id is not None else (
        tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0)
    sequences = _sequences(args, target, tokenizer)
    if args.self_distill > 0:
        budget = started + SELF_DISTILL_SHARE * 60 * args.minutes if args.minutes is not None else None
        sequences = self_distill(target, sequences, args.self_distill, pad_id, batch_size=max(args.batch_size, 16),
                                 deadline=budget, progress=not args.quiet)
        sequences = [s[: args.max_length] for s in sequences]
    held_out: list[list[int]] = []
    if args.eval_samples > 0:
        if args.eval_samples >= len(sequences):
            raise ValueError(f"--eval-samples {args.eval_samples} leaves no training sequence of {len(sequences)}.")
        sequences, held_out = sequences[: -args.eval_samples], sequences[-args.eval_samples :]
    settings = HeadTrainingSettings(
        ttt_steps=args.ttt_steps, ttt_decay=args.ttt_decay, learning_rate=args.learning_rate,
        batch_size=args.batch_size, epochs=args.epochs, max_length=args.max_length,
        draft_vocab_size=min(args.draft_vocab_size, text.vocab_size), minutes=args.minutes, seed=args.seed,
    )
    head, log = train_head(target, sequences, settings, tokenizer=tokenizer, pad_id=pad_id, verifier=verifier,
                           progress=not args.quiet, deadline=deadline)
    out = Path(args.out)
    save_head(head, out, target, verifier, speculative_tokens=args.ttt_steps)
    Eagle3Head.from_pretrained(out).bind(target)  # the saved folder loads and fits its target
    evaluation = None
    if held_out:
        evaluation = evaluate_head(head, target, held_out, args.ttt_steps, args.batch_size, args.max_length, pad_id)
    extra = {
        "target": verifier, "target_dtype": str(target.dtype).removeprefix("torch."), "dataset": args.dataset,
        "tiny": args.tiny, "self_distill": args.self_distill, "sequences": len(sequences),
        "data_tokens": sum(len(s) for s in sequences), "draft_vocab_size": head.settings.draft_vocab_size,
        "aux_layer_ids": head.settings.aux_layer_ids, "command_seconds": round(time.monotonic() - started, 3),
        "held_out": evaluation,
    }
    write_log(out, log, settings, extra)
    plot = plot_log(out, log)
    last = log.records[-1] if log.records else None
    summary = {
        "out": str(out), "steps": log.steps, "samples": log.samples, "stopped_by": log.stopped_by,
        "wall_seconds": round(log.wall_seconds, 1), "plot": str(plot) if plot else None,
        "loss": round(last["loss"], 4) if last else None,
        "acceptance": [round(a, 3) for a in last["acceptance"]] if last else None,
        "held_out_acceptance": [round(a, 3) for a in evaluation["acceptance"]] if evaluation else None,
    }
    print(json.dumps(summary), file=sys.stdout)
    return 0
