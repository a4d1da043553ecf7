"""`hf-dynspec export-hub OUT_DIR`: write a transformers `custom_generate` folder (see `hf_dynspec.hub`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..config import DynSpecConfig
from ..hub import export_hub
from ..policies import build_policy


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register the `export-hub` sub-command."""
    parser = subparsers.add_parser(
        "export-hub",
        help="Write a folder usable as model.generate(..., custom_generate=FOLDER, trust_remote_code=True).",
        description=(
            "Write OUT_DIR/custom_generate/{generate.py,requirements.txt} and OUT_DIR/README.md, following the "
            "conventions of custom generation methods on the Hugging Face Hub; optionally save a model into it."
        ),
    )
    parser.add_argument("out_dir", metavar="OUT_DIR", help="Folder to create (must not exist or be empty).")
    parser.add_argument(
        "--config",
        metavar="SETTINGS_JSON",
        help="JSON file of DynSpecConfig settings to bake into the folder (and into the model's generation config).",
    )
    parser.add_argument(
        "--model",
        metavar="NAME",
        help="Local model directory, local .gguf file or registry name whose model and tokenizer are saved into OUT_DIR.",
    )
    parser.add_argument("--overwrite", action="store_true", help="Write into OUT_DIR even if it is not empty.")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Export, then list the files written; errors are reported on stderr with exit status 2."""
    try:
        config = _load_config(args.config)
        result = export_hub(args.out_dir, config=config, model=args.model, overwrite=args.overwrite)
    except (OSError, ValueError) as error:
        print(f"hf-dynspec export-hub: error: {error}", file=sys.stderr)
        return 2
    print(f"Wrote {result.out_dir}:")
    for path in sorted(p for p in Path(result.out_dir).rglob("*") if p.is_file()):
        print(f"  {path.relative_to(result.out_dir)}")
    if result.model_name is not None and not result.tokenizer_saved:
        print(f"Note: {args.model} has no tokenizer files; only the model was saved.")
    return 0


def _load_config(path: str | None) -> DynSpecConfig | None:
    """The settings in the JSON file at `path` (`None` without one), their policy built once to check its name and
    options; errors name the file."""
    if path is None:
        return None
    try:
        config = DynSpecConfig.from_json_file(path)
        build_policy(config)
        return config
    except FileNotFoundError as error:
        raise FileNotFoundError(f"--config file {path!r} does not exist.") from error
    except ValueError as error:
        raise ValueError(f"--config file {path!r}: {error}") from error
