"""The `hf-dynspec` command line: one sub-command per module in `hf_dynspec.commands`."""

from __future__ import annotations

import argparse
import importlib
import sys

# Each module named here defines `add_parser(subparsers)`, which registers its sub-command and sets `func`.
COMMAND_MODULES = [
    "hf_dynspec.commands.calibrate",
    "hf_dynspec.commands.bench",
    "hf_dynspec.commands.demo",
    "hf_dynspec.commands.export_hub",
    "hf_dynspec.commands.serve",
    "hf_dynspec.commands.train_head",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-dynspec", description="Batched, load-aware speculative decoding.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
