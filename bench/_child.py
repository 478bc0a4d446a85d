"""The benches that run each configuration in a child process of their own (a fresh peak RSS,
no memory left over from the one before): the hidden arguments a child takes, and its run."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def add_child_arguments(parser: argparse.ArgumentParser) -> None:
    """``--json`` (where the report goes), and the hidden ``--child`` (the role a child
    process plays) and ``--swap-dir`` (its folder)."""
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--swap-dir", default=None, help=argparse.SUPPRESS)


def spawn(
    script: str, role: str, folder: Path, forwarded: list[str], *, show_stderr: bool = False
) -> dict[str, Any]:
    """Run ``script`` as a child playing ``role`` in ``folder / role`` with the ``forwarded``
    arguments; the JSON of its last output line. ``show_stderr``: let its progress lines
    through (else its stderr is kept, and shown when it fails)."""
    command = [sys.executable, script, "--child", role, "--swap-dir", str(folder / role)]
    stderr = None if show_stderr else subprocess.PIPE
    proc = subprocess.run(
        command + forwarded, stdout=subprocess.PIPE, stderr=stderr, text=True, check=False
    )
    if proc.returncode != 0:
        detail = f":\n{proc.stderr[-3000:]}" if proc.stderr else f" (exit {proc.returncode})"
        raise SystemExit(f"{role} failed{detail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
