"""``tierswap verify DIR``: check every chunk's CRC32C and the metadata of a swap store.

Exit status 0 when everything is intact, 1 when anything is damaged (each damaged key and chunk
is named), 2 when DIR is not a store at all. The store is opened read-only. A store on several
folders is verified whole (every chunk in every folder) through its home folder, which lists
the others, or through all of its folders in order (``tierswap verify A B``).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tierswap.errors import ConfigError, CorruptionError
from tierswap.store import SwapStore

__all__ = ["EXIT_DAMAGED", "add_parser", "check", "run"]

EXIT_DAMAGED = 1


def add_parser(commands: Any) -> None:
    """Register ``verify`` on the CLI's subparsers."""
    p = commands.add_parser(
        "verify", help="check every chunk checksum and the metadata", description=__doc__
    )
    p.add_argument(
        "dir",
        type=Path,
        nargs="+",
        metavar="DIR",
        help="the store's folder (its home, for a store on several folders; or all, in order)",
    )
    p.add_argument("--json", action="store_true", help='print {"intact": ..., "problems": [...]}')
    p.set_defaults(run=run)


def check(folder: Path | Sequence[Path]) -> tuple[list[str], int]:
    """(problems, number of arrays checked); metadata that cannot be read is one problem."""
    folders = [folder] if isinstance(folder, Path) else list(folder)
    for path in folders:
        if not path.is_dir():
            raise ConfigError(f"{str(path)!r} is not a folder; pass the folder of a tierswap store")
    try:
        with SwapStore(folders, mode="r") as store:
            return list(store.verify()), len(store)
    except CorruptionError as exc:
        return [f"store metadata: {exc}"], 0


def run(args: argparse.Namespace) -> int:
    """Print each problem; 0 when intact, 1 when damaged."""
    problems, checked = check(args.dir)
    where = " ".join(str(folder) for folder in args.dir)
    if args.json:
        print(json.dumps({"path": where, "intact": not problems, "problems": problems}))
    elif problems:
        for problem in problems:
            print(f"DAMAGED  {problem}")
        print(f"{len(problems)} problem(s) in {where}")
    else:
        print(f"intact: {checked} arrays in {where}, every chunk checksum and the metadata")
    return EXIT_DAMAGED if problems else 0
