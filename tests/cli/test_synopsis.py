"""docs/cli.md's synopsis names every option each command accepts."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from tierswap.cli import build_parser

CLI_MD = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _synopsis() -> dict[str, str]:
    """Each command's lines of the first code block (continuation lines belong to the last)."""
    block = re.search(r"```\n(.*?)```", CLI_MD.read_text(), re.S)
    assert block is not None
    lines: dict[str, str] = {}
    command = ""
    for line in block.group(1).splitlines():
        if line.startswith("tierswap "):
            command = line.split()[1]
            lines[command] = line
        else:
            lines[command] += " " + line
    return lines


@pytest.mark.parametrize("command", sorted(_commands()))
def test_the_synopsis_lists_every_option(command: str) -> None:
    synopsis = _synopsis()
    assert command in synopsis
    options = {
        option
        for action in _commands()[command]._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    }
    missing = sorted(o for o in options if not re.search(rf"{o}(?![\w-])", synopsis[command]))
    assert not missing, f"docs/cli.md's synopsis of {command} lacks {missing}"
