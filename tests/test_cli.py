"""The command line: every command documents itself."""

from __future__ import annotations

import argparse

import pytest

from hf_dynspec.cli import build_parser


def commands() -> list[str]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(action.choices)


@pytest.mark.parametrize("command", commands())
def test_every_command_prints_its_help(command, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([command, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: hf-dynspec {command}")
