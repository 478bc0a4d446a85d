"""The entry points: ``tierswap`` / ``python -m tierswap`` and ``main(argv)``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tierswap import __version__
from tierswap.cli import build_parser, main


def _run_module(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(Path.cwd())}
    cmd = [sys.executable, "-m", "tierswap", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)


def test_python_m_tierswap_lists_the_commands() -> None:
    done = _run_module("--help")
    assert done.returncode == 0
    for command in ("bench", "inspect", "verify"):
        assert command in done.stdout


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_each_command_has_help(command: str) -> None:
    done = _run_module(command, "--help")
    assert done.returncode == 0
    assert "DIR" in done.stdout
    assert "--json" in done.stdout


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert __version__ in capsys.readouterr().out


def test_every_subcommand_is_wired() -> None:
    parser = build_parser()
    for argv in (["bench"], ["inspect", "d"], ["verify", "d"]):
        assert callable(parser.parse_args(argv).run)
