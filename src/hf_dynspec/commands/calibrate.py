"""`hf-dynspec calibrate`: time a target/draft pair on this machine, write a profile, optionally print a vLLM table.

    hf-dynspec calibrate --target T --draft D [--batch-sizes 1,2,4,8,16,32] [--tokens-per-row 1,2,3,5,9]
                         [--context-length 256] [--warmup 2] [--repeats 5] --out profile.json
    hf-dynspec calibrate --tiny --out profile.json                  # tiny random models, no weights needed
    hf-dynspec calibrate --target T --draft D@8bit --target-max-memory cpu=1GiB --target-offload-folder DIR --out p.json
    hf-dynspec calibrate --load profile.json --vllm-table --acceptance 0.7 --num-speculative-tokens 5

With `--vllm-table` the vLLM `--speculative-config` JSON is the only thing written to stdout (progress and the
summary go to stderr), so it can be piped or captured.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from ..calibration import CalibrationSettings, calibrate, parse_int_list, summarize, vllm_speculative_config
from ..cost_models import Profile
from ..evaluation.models import DTYPES, LoadOptions, split_variant
from ..kernels import NARROW_LINEAR
from .bench import add_model_options


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register the `calibrate` sub-command."""
    parser = subparsers.add_parser(
        "calibrate",
        help="Measure a target/draft pair's step costs; write a profile for the goodput policy or a vLLM table.",
        description=(
            "Time target forwards over (batch size, tokens per row) and draft forwards per batch size on top of a KV "
            "cache of --context-length tokens, with warm-up runs and medians. The profile feeds "
            "DynSpecConfig(policy='goodput', policy_options={'cost_model': 'profile', 'profile': PATH})."
        ),
    )
    models = parser.add_argument_group("models")
    models.add_argument("--target", metavar="NAME", help="Target model: registry name, local path or Hub id.")
    models.add_argument("--draft", metavar="NAME", help="Draft model: registry name, local path or Hub id.")
    models.add_argument("--tiny", action="store_true", help="Use tiny random models built from configs instead.")
    models.add_argument("--device", default="cpu", help="Device to measure on (default cpu).")
    add_model_options(parser)
    points = parser.add_argument_group("measurement")
    defaults = CalibrationSettings()
    points.add_argument("--batch-sizes", default=_join(defaults.batch_sizes), help="Comma-separated batch sizes.")
    points.add_argument(
        "--tokens-per-row", default=_join(defaults.tokens_per_row), help="Comma-separated new tokens per row (1 + k)."
    )
    points.add_argument("--context-length", type=int, default=defaults.context_length, help="KV cache tokens per row.")
    points.add_argument("--warmup", type=int, default=defaults.warmup, help="Untimed runs per point.")
    points.add_argument("--repeats", type=int, default=defaults.repeats, help="Timed runs per point (median kept).")
    points.add_argument("--seed", type=int, default=defaults.seed, help="Seed of the random inputs and tiny models.")
    points.add_argument(
        "--narrow-linear", choices=NARROW_LINEAR, default=defaults.narrow_linear,
        help="Linear layers over a few rows computed weight-first, as the loop does with this "
        "DynSpecConfig.narrow_linear (auto: where measured faster).",
    )
    points.add_argument("--no-progress", action="store_true", help="Hide the progress bar.")
    output = parser.add_argument_group("output")
    output.add_argument("--out", metavar="PROFILE_JSON", help="Write the profile here.")
    output.add_argument("--load", metavar="PROFILE_JSON", help="Skip measuring: use this saved profile.")
    output.add_argument("--vllm-table", action="store_true", help="Print vLLM's --speculative-config JSON to stdout.")
    output.add_argument("--acceptance", type=float, default=0.7, help="Per-token acceptance assumed for the table.")
    output.add_argument(
        "--num-speculative-tokens", type=int, default=5, help="Maximum draft length of the table (vLLM's maximum)."
    )
    output.add_argument("--vllm-max-batch-size", type=int, default=256, help="Largest batch size the table covers.")
    output.add_argument("--vllm-method", default="draft_model", help="`method` written into the vLLM config.")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Measure (or load), save, summarise, and print the vLLM table when asked; errors exit with status 2."""
    try:
        profile = _profile(args)
        if args.out:
            profile.save(args.out)
        print(summarize(profile), file=sys.stderr)
        if args.out:
            print(f"Wrote {args.out}", file=sys.stderr)
        if args.vllm_table:
            config = vllm_speculative_config(
                profile,
                acceptance=args.acceptance,
                num_speculative_tokens=args.num_speculative_tokens,
                max_batch_size=args.vllm_max_batch_size,
                method=args.vllm_method,
            )
            print(json.dumps(config))
    except (OSError, ValueError) as error:
        print(f"hf-dynspec calibrate: error: {error}", file=sys.stderr)
        return 2
    return 0


def _profile(args: argparse.Namespace) -> Profile:
    if args.load:
        if args.tiny or args.target or args.draft:
            raise ValueError("--load uses a saved profile; drop --tiny/--target/--draft (or drop --load to measure).")
        return Profile.load(args.load)
    if not args.out and not args.vllm_table:
        raise ValueError("nothing to do: give --out PROFILE_JSON to save the profile and/or --vllm-table.")
    settings = CalibrationSettings(
        batch_sizes=parse_int_list(args.batch_sizes, "--batch-sizes"),
        tokens_per_row=parse_int_list(args.tokens_per_row, "--tokens-per-row"),
        context_length=args.context_length,
        warmup=args.warmup,
        repeats=args.repeats,
        seed=args.seed,
        narrow_linear=args.narrow_linear,
    )
    target, draft, names = _models(args)
    return calibrate(target, draft, settings, *names, progress=not args.no_progress)


def _models(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.nn.Module, tuple[str, str]]:
    """The pair to time and the names recorded in the profile."""
    if args.tiny:
        if args.target or args.draft:
            raise ValueError("--tiny builds its own models; drop --target/--draft (or drop --tiny).")
        from ..evaluation.settings import TINY_UNSUPPORTED
        from ..evaluation.tiny import tiny_pair

        placed = ["--" + name.replace("_", "-") for name in TINY_UNSUPPORTED if getattr(args, name) is not None]
        if placed:
            raise ValueError(f"--tiny builds models in memory and only takes a dtype; drop {', '.join(placed)}.")
        target, draft = tiny_pair(seed=args.seed)
        dtypes = {"auto": torch.float32, **DTYPES}  # tiny models are built in float32
        target = target.to(args.device, dtypes[args.target_dtype or args.dtype])
        draft = draft.to(args.device, dtypes[args.draft_dtype or args.dtype])
        return target, draft, ("tiny-target", "tiny-draft")
    if not args.target or not args.draft:
        raise ValueError("give both --target and --draft (model names or paths), or --tiny for tiny random models.")
    from ..evaluation.models import ModelSourceError, load_model, resolve_model

    try:
        loaded = []
        for role in ("target", "draft"):
            name, options = _load_options(args, role)
            loaded.append(load_model(resolve_model(name), options))
    except ModelSourceError as error:
        raise ValueError(str(error)) from error
    return loaded[0], loaded[1], (args.target, args.draft)


def _load_options(args: argparse.Namespace, role: str) -> tuple[str, LoadOptions]:
    """`(name without variant, LoadOptions)` of the `"target"` or `"draft"` named on the command line."""
    name, variant = split_variant(getattr(args, role))
    options = LoadOptions(
        dtype=getattr(args, f"{role}_dtype") or args.dtype,
        quantization=getattr(args, f"{role}_quantization") or "none",
        max_memory=getattr(args, f"{role}_max_memory"),
        offload_folder=getattr(args, f"{role}_offload_folder"),
        device=args.device,
    )
    return name, options.with_variant(variant)


def _join(values: list[int]) -> str:
    return ",".join(str(v) for v in values)
