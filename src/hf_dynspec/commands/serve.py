"""`hf-dynspec serve`: transformers' OpenAI-compatible server with speculation.

    hf-dynspec serve [MODEL] --continuous-batching --draft DRAFT [--port 8000] [--dtype auto]
    hf-dynspec serve [MODEL] --continuous-batching --proposer suffix
    hf-dynspec serve [MODEL] --continuous-batching --prompt-lookup-num-tokens 4
    hf-dynspec serve ./my-model --continuous-batching --proposer suffix --served-model-name my-model

MODEL defaults to the default target (`qwen2.5-coder-1.5b`, from its pip packages), DRAFT (a draft model) to
nothing: `--draft qwen2.5-coder-0.5b` serves the default pair, `--draft qwen2.5-coder-0.5b@4bit` with the draft's
weights in 4 bits (bitsandbytes), which makes drafting cheap enough to pay on a CPU. Any model `transformers serve` takes works too.
Clients talk to it as to `transformers serve`: `/v1/chat/completions`, `/v1/completions`,
`/v1/responses`, streaming included, naming the model as it is served (MODEL as given, or `--served-model-name`).
Malformed requests are answered with a 4xx naming the field (`hf_dynspec.request_checks`).
"""

from __future__ import annotations

import argparse
from typing import Any

from ..config import DynSpecConfig
from ..evaluation.models import DEFAULT_DRAFT, DEFAULT_TARGET

SERVE_OPTIONS = {
    # our flag: (transformers serve's option, type, help)
    "--host": ("host", str, "Address to listen on (default localhost)."),
    "--port": ("port", int, "Port to listen on (default 8000)."),
    "--device": ("device", str, "Device to run on (default cpu)."),
    "--dtype": ("dtype", str, "Model dtype ('auto' takes the checkpoint's)."),
    "--cb-block-size": ("cb_block_size", int, "KV cache block size in tokens (continuous batching)."),
    "--cb-num-blocks": ("cb_num_blocks", int, "KV cache blocks (continuous batching)."),
    "--cb-max-batch-tokens": ("cb_max_batch_tokens", int, "Most tokens in one step (continuous batching)."),
    "--log-level": ("log_level", str, "Logging level (default warning)."),
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="Serve a model over transformers' OpenAI-compatible server, speculating.",
        description=(
            "Runs `transformers serve MODEL` with the model enabled by hf_dynspec: under --continuous-batching every "
            "decoding request drafts from a draft model, prompt lookup or suffix trees, with a draft length the policy "
            "chooses from the load each step."
        ),
    )
    parser.add_argument("model", nargs="?", default=DEFAULT_TARGET,
                        help=f"Registry name, local folder or Hub id (default {DEFAULT_TARGET}).")
    parser.add_argument("--continuous-batching", action="store_true",
                        help="Serve with transformers' continuous batching (paged attention), where speculation is "
                             "chosen per request and step.")
    parser.add_argument("--draft", default=None, metavar="NAME",
                        help=f"Draft model: registry name (the default pair's is {DEFAULT_DRAFT}; "
                             f"{DEFAULT_DRAFT}@4bit for bitsandbytes 4-bit weights), local folder or Hub id; computing "
                             "in the served model's dtype.")
    parser.add_argument("--prompt-lookup-num-tokens", type=int, default=None,
                        help="Draft up to this many tokens a step by prompt lookup.")
    parser.add_argument("--proposer", choices=("suffix", "hybrid", "draft"), default=None,
                        help="'suffix': draft from suffix trees over every request's prompt and output; with --draft, "
                             "per request and step from them or the draft model. 'hybrid' (with --draft): prompt "
                             "lookup or the draft model. 'draft' (with --draft): the draft model alone. Without it, a "
                             "--draft drafts beside copies from each request's context, as the policy decides.")
    parser.add_argument("--dynspec-config", default=None,
                        help="DynSpecConfig as a JSON file or a JSON object (policy, num_speculative_tokens, ...).")
    parser.add_argument("--stats-interval", type=float, default=10.0, metavar="SECONDS",
                        help="Seconds between the lines saying what speculation did and which requests hold blocks "
                             "of the paged caches, logged with --log-level info when they change (default 10).")
    parser.add_argument("--served-model-name", default=None, metavar="NAME",
                        help="The name clients know the model by, in /v1/models, requests and answers (default: "
                             "MODEL as given; transformers 5.25 or newer).")
    for flag, (_, kind, text) in SERVE_OPTIONS.items():
        parser.add_argument(flag, type=kind, default=None, help=text)
    parser.set_defaults(func=run)


def serve_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """`hf_dynspec.serving.serve`'s arguments for the parsed command line."""
    config = DynSpecConfig.coerce(_config_value(args.dynspec_config))
    if args.proposer is not None:
        config = DynSpecConfig.from_dict({**config.to_dict(), "proposer": args.proposer})
    options = {name: getattr(args, flag[2:].replace("-", "_")) for flag, (name, _, _) in SERVE_OPTIONS.items()}
    options = {name: value for name, value in options.items() if value is not None}
    options.setdefault("device", "cpu")
    return {
        "model": args.model,
        "assistant_model": args.draft,
        "prompt_lookup_num_tokens": args.prompt_lookup_num_tokens,
        "dynspec_config": config,
        "continuous_batching": args.continuous_batching,
        "stats_interval": args.stats_interval,
        "served_model_name": args.served_model_name,
        **options,
    }


def _config_value(text: str | None) -> dict | str | None:
    if text is None or not text.lstrip().startswith("{"):
        return text
    import json

    return json.loads(text)


def run(args: argparse.Namespace) -> int:
    from ..serving import serve

    serve(**serve_arguments(args))
    return 0
