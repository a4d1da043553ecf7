"""`hf-dynspec bench`: compare decoding methods on real (or tiny) models and prompts, in one run.

Examples:

```
hf-dynspec bench --scenario fixed --num-prompts 4 --batch-sizes 1,16 --out results.json --plots plots/
hf-dynspec bench --scenario long-tail --out long_tail.json
hf-dynspec bench --scenario rollout --out rollout.json --plots plots/
hf-dynspec bench --scenario rollout-epochs --updates 1,4 --learning-rate 1e-5 --out epochs.json --plots plots/
hf-dynspec bench --tiny --methods plain,hf-assisted,dynspec-static:4 --batch-sizes 1,4
hf-dynspec bench --scenario offload --out offload.json
hf-dynspec bench --scenario overhead --repetitions 3 --out overhead.json
hf-dynspec bench --scenario serve --out serve.json --plots plots/
hf-dynspec bench --scenario serve --through server --num-prompts 4 --methods cb-plain,cb-draft --out served.json
hf-dynspec bench --draft qwen2.5-coder-0.5b@8bit --target-dtype bfloat16 --batch-sizes 1
hf-dynspec bench --target-dtype float32 --batch-sizes 1 --methods plain,dynspec-goodput/fp32,dynspec-goodput/4bit
```
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..evaluation.methods import MethodError, parse_policy_options, table_policy_options
from ..evaluation.models import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    DTYPE_CHOICES,
    QUANTIZATIONS,
    VARIANTS,
    describe_registry,
    parse_max_memory,
)
from ..evaluation.settings import OUTPUT_LENGTHS, SCENARIOS, BenchSettings


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 1,4,16, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _rate_list(text: str) -> list[float | str]:
    """Request rates per second (`0.5`), or shares of the plain manager's capacity (`0.5x`)."""
    values: list[float | str] = []
    for part in (part.strip() for part in text.split(",") if part.strip()):
        try:
            value = float(part.removesuffix("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated rates such as 0.1,0.5,2 or shares of capacity such as 0.5x,1x,2x, got "
                f"{text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected positive request rates, got {text!r}")
        values.append(f"{value}x" if part.endswith("x") else value)
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one request rate, got {text!r}")
    return values


def _size_map(text: str) -> dict[int, int]:
    try:
        pairs = [part.split("=") for part in text.split(",") if part.strip()]
        return {int(size): int(count) for size, count in pairs}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BATCH=PROMPTS pairs such as 1=4,16=16, got {text!r}") from None


def _max_memory(text: str) -> dict[int | str, str]:
    try:
        return parse_max_memory(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """`--dtype` and the per-model dtype, quantization, memory and offload options (shared with `calibrate`)."""
    group = parser.add_argument_group(
        "model placement",
        "Per-model dtype, bitsandbytes quantization and accelerate offload. `auto` dtype: the checkpoint's own dtype "
        "(from_pretrained(dtype='auto')); GGUF registry models: bfloat16 on CPUs with AMX or AVX512-BF16 and CUDA "
        "GPUs with bfloat16, float32 (float16 on older GPUs) otherwise.",
    )
    group.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help="Weights dtype of both models.")
    for role in ("target", "draft"):
        group.add_argument(f"--{role}-dtype", choices=DTYPE_CHOICES, help=f"The {role}'s dtype (default: --dtype).")
        group.add_argument(f"--{role}-quantization", choices=QUANTIZATIONS,
                           help=f"bitsandbytes quantization of the {role} (default none).")
        group.add_argument(f"--{role}-max-memory", type=_max_memory, metavar="DEVICE=SIZE,...",
                           help=f"accelerate max_memory of the {role}, e.g. cpu=1GiB, or a share of its weights, "
                           "cpu=35%%; the rest is offloaded.")
        group.add_argument(f"--{role}-offload-folder", metavar="DIR",
                           help=f"Directory for the {role}'s weights offloaded to disk.")


MODEL_OPTIONS = tuple(
    f"{role}_{option}" for role in ("target", "draft") for option in ("dtype", "quantization", "max_memory",
                                                                       "offload_folder")
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `bench`."""
    parser = subparsers.add_parser(
        "bench",
        help="Benchmark plain, transformers' assisted and hf_dynspec decoding on the same prompts.",
        description=__doc__.split("\n\n")[0] + "\n\nRegistry models:\n" + describe_registry(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--scenario", choices=sorted([*SCENARIOS, "overhead"]), default="fixed",
                        help="Preset (dataset, batch sizes, methods, output lengths); other flags override it.")
    parser.add_argument("--target", default=DEFAULT_TARGET, help="Registry name, local path or Hub id.")
    parser.add_argument("--draft", default=DEFAULT_DRAFT,
                        help="Registry name, local path or Hub id; a registry name may end in a variant: "
                             + ", ".join("@" + v for v in VARIANTS) + f" (e.g. {DEFAULT_DRAFT}@8bit).")
    parser.add_argument("--dataset",
                        help="humaneval, sharegpt, codeedit (ShareGPT code-edit requests), agent (ShareGPT follow-ups "
                             "that rework the code of an earlier answer), tools (agent sessions: a file, a tool's output, a "
                             "request to rework the file), followups (a standard-library function answered, then a "
                             "request to rework it), mixed or a .jsonl path.")
    parser.add_argument("--num-prompts", type=int, help="Prompts per batch size (the dataset's first N after --prompt-offset).")
    parser.add_argument("--prompt-offset", type=int, default=0,
                        help="Skip the dataset's first N prompts: a held-out set for settings tuned on the first ones.")
    parser.add_argument("--batch-size-prompts", type=_size_map, default={},
                        help="Fewer prompts at some batch sizes, e.g. 1=4 (batch size 1 is slowest per prompt).")
    parser.add_argument("--batch-sizes", type=_int_list, help="Comma-separated, e.g. 1,4,16.")
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--methods", help="Comma-separated; see `hf_dynspec.evaluation.methods` for the names. A "
                        "method that uses the draft may end in /VARIANT to run with that variant of the draft ("
                        + ", ".join(VARIANTS) + "), e.g. dynspec-goodput/4bit.")
    parser.add_argument("--policy-option", action="append", metavar="POLICY.OPTION=VALUE",
                        help="Option of a dynspec policy, e.g. batch_table.table=table.json (repeatable).")
    parser.add_argument("--table", type=Path,
                        help="For dynspec-table: a vLLM speculative config with a batch-size table, or a calibration "
                             "profile (hf-dynspec calibrate) to derive the table from.")
    parser.add_argument("--table-acceptance", type=float, default=0.7,
                        help="Acceptance rate assumed when deriving the table from a profile.")
    parser.add_argument("--output-lengths", choices=OUTPUT_LENGTHS,
                        help="eos: rows stop at EOS; long-tail: each row also gets its own long-tailed budget.")
    parser.add_argument("--rates", type=_rate_list,
                        help="Serve scenario: comma-separated request rates per second, or shares of the plain "
                             "manager's measured capacity written 0.5x (default 0.25x,0.5x,1x,2x).")
    parser.add_argument("--through", choices=("engine", "server"), default="engine",
                        help="Serve scenario: 'engine' sends the trace to continuous-batching managers in this "
                             "process; 'server' starts each method as a server (plain `transformers serve` for "
                             "cb-plain, `hf-dynspec serve` for the others) and sends it over loopback HTTP, after the "
                             "same requests at once through generate, continuous batching and the server.")
    parser.add_argument("--repetitions", type=int, default=2)
    parser.add_argument("--warmup-tokens", type=int, default=8, help="Tokens of the untimed warm-up run (0: none).")
    parser.add_argument("--do-sample", action="store_true", help="Sample instead of greedy decoding.")
    parser.add_argument("--samples-per-prompt", type=int,
                        help="Rows per prompt, adjacent in the batch as TRL lays out a prompt's samples (rollout: 8).")
    parser.add_argument("--temperature", type=float, help="Sampling temperature (rollout: 1.0).")
    parser.add_argument("--top-p", type=float, help="Sampling top-p (rollout: 1.0).")
    parser.add_argument("--top-k", type=int, help="Sampling top-k, 0 for none (rollout: 0).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-prompt-tokens", type=int, default=768, help="Skip longer prompts.")
    parser.add_argument("--tiny", action="store_true", help="Tiny random models and random token prompts (for CI).")
    epochs = parser.add_argument_group("rollout-epochs scenario", "The first epoch, GRPO updates, the second epoch.")
    epochs.add_argument("--updates", type=_int_list, default=[1, 4],
                        help="Optimizer steps after which the second epoch is timed (default 1,4).")
    epochs.add_argument("--learning-rate", type=float, default=1e-5,
                        help="The LoRA adapter's constant learning rate (default 1e-5; TRL's default 1e-6 is meant "
                             "for full fine-tuning).")
    epochs.add_argument("--lora-rank", type=int, default=16)
    epochs.add_argument("--first-epoch-methods", default=None,
                        help="Methods timed on the first epoch, with an empty rollout cache ('' to skip; default: "
                             "the loop without speculation and the default, each with the standard and coupled sampler).")
    epochs.add_argument("--profile", help="A calibration profile pricing the hindsight bound's verifies by their width.")
    add_model_options(parser)
    parser.add_argument("--out", type=Path, help="Write results JSON here.")
    parser.add_argument("--plots", type=Path, help="Write PNG plots into this directory.")
    parser.add_argument("--quiet", action="store_true", help="No progress bars.")
    parser.set_defaults(func=run)


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    """`BenchSettings` from the scenario preset, overridden by every flag given explicitly."""
    preset = dict(SCENARIOS[args.scenario])
    for key in ("dataset", "num_prompts", "batch_sizes", "max_new_tokens", "methods", "output_lengths",
                "samples_per_prompt", "temperature", "top_p", "top_k", *MODEL_OPTIONS):
        value = getattr(args, key)
        if value is not None:
            preset[key] = value
    policy_options = parse_policy_options(args.policy_option, preset.pop("policy_options", {}))  # the command line wins
    if args.table is not None:
        policy_options["batch_table"] = table_policy_options(args.table, args.table_acceptance)
    return BenchSettings(
        target=args.target,
        draft=args.draft,
        policy_options=policy_options,
        repetitions=args.repetitions,
        warmup_tokens=args.warmup_tokens,
        do_sample=args.do_sample or preset.pop("do_sample", False),
        seed=args.seed,
        max_prompt_tokens=args.max_prompt_tokens,
        prompt_offset=args.prompt_offset,
        batch_size_prompts=args.batch_size_prompts,
        tiny=args.tiny,
        dtype=args.dtype,
        scenario=args.scenario,
        rates=args.rates,
        **preset,
    )


def run(args: argparse.Namespace) -> int:
    """Run the benchmark, print the markdown table, write JSON and plots when asked."""
    from ..evaluation.bench import run_benchmark
    from ..evaluation.methods import NO_SPECULATION
    from ..evaluation.report import markdown_table, summary_line
    from ..evaluation.rollout import rollout_table

    if args.scenario == "overhead":
        return _run_overhead(args)
    try:
        settings = settings_from_args(args)
        if settings.scenario == "serve":
            return _run_serve(settings, args)
        if settings.scenario == "rollout-epochs":
            return _run_epochs(settings, args)
        results = run_benchmark(settings, progress=not args.quiet)
    except (ValueError, MethodError) as error:
        raise SystemExit(f"hf-dynspec bench: {error}") from error
    print(markdown_table(results))
    rollout = rollout_table(results, NO_SPECULATION)
    if rollout:
        print(f"\n{rollout}")
    summary = summary_line(results)
    if summary:
        print(f"\n{summary}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
        print(f"\nResults: {args.out}")
    if args.plots:
        from ..evaluation.plots import write_plots

        for path in write_plots(results, args.plots):
            print(f"Plot: {path}")
    return 0


def _run_overhead(args: argparse.Namespace) -> int:
    """The launch-bound proxy (`hf_dynspec.evaluation.overhead`): its table and JSON."""
    from ..evaluation.overhead import OVERHEAD_METHODS, measure_overhead, overhead_table

    methods = tuple(args.methods.split(",")) if args.methods else OVERHEAD_METHODS
    unknown = sorted(set(methods) - set(OVERHEAD_METHODS))
    if unknown:
        raise SystemExit(f"hf-dynspec bench: the overhead scenario runs {', '.join(OVERHEAD_METHODS)}; got {unknown}")
    results = measure_overhead(
        num_prompts=args.num_prompts or 16, new=args.max_new_tokens or 48, repetitions=args.repetitions,
        methods=methods, progress=not args.quiet, seed=args.seed,
    )
    print(overhead_table(results))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
        print(f"\nResults: {args.out}")
    return 0


def _run_epochs(settings, args: argparse.Namespace) -> int:
    """The rollout-epochs scenario: its table, JSON and speed-against-KL plot."""
    from ..evaluation.epochs import FIRST_EPOCH_METHODS, EpochSettings, epochs_table, plot_epochs, run_epochs

    first = FIRST_EPOCH_METHODS if args.first_epoch_methods is None else args.first_epoch_methods
    epochs = EpochSettings(updates=args.updates, learning_rate=args.learning_rate, lora_rank=args.lora_rank,
                           first_epoch_methods=first, methods=settings.methods, profile=args.profile)
    results = run_epochs(settings, epochs, progress=not args.quiet)
    print(epochs_table(results))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
        print(f"\nResults: {args.out}")
    if args.plots:
        print(f"Plot: {plot_epochs(results, args.plots / 'epochs_speed_kl.png')}")
    return 0


def _run_serve(settings, args: argparse.Namespace) -> int:
    """The serve scenario: its tables, JSON and latency/TPOT plot."""
    from ..evaluation.serve import plot_serve, run_serve, serve_table

    if args.through == "server":
        import tempfile

        from ..evaluation.serve_http import burst_table, run_serve_through_servers, server_table

        with tempfile.TemporaryDirectory(prefix="hf-dynspec-serve-") as folder:
            results = run_serve_through_servers(settings, Path(folder), progress=not args.quiet)
        print(f"{burst_table(results)}\n\n{server_table(results)}")
    else:
        results = run_serve(settings, progress=not args.quiet)
        print(serve_table(results))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
        print(f"\nResults: {args.out}")
    if args.plots:
        print(f"Plot: {plot_serve(results, args.plots / 'serve_latency.png')}")
    return 0

