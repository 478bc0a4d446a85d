"""``tierswap snapshot SRC DEST``: keep the last commit of a swap store as a standalone store.

DEST must be new or empty. On the same filesystem the chunk files are hard links (no data is
copied, and neither folder changes the other afterwards); elsewhere they are copied (reflinked
where the filesystem can), with a progress bar for large copies. SRC is opened read-only, so
this works while a writer has it open; the snapshot is the last commit that writer made.

A store on several folders (SRC is its home folder) makes a snapshot on as many folders: pass
one DEST per folder (each on its source folder's drive, so that every chunk is linked), or a
single DEST, which then holds the other folders inside its private folder (chunks of the other
drives are copied); either opens as a store through DEST (the first).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tierswap.config import format_size
from tierswap.errors import ConfigError
from tierswap.store import SwapStore

__all__ = ["add_parser", "run"]


def add_parser(commands: Any) -> None:
    """Register ``snapshot`` on the CLI's subparsers."""
    p = commands.add_parser(
        "snapshot",
        help="keep a store's last commit as a new store (hard links)",
        description=__doc__,
    )
    p.add_argument("src", type=Path, metavar="SRC", help="the store's folder")
    p.add_argument(
        "dest",
        type=Path,
        nargs="+",
        metavar="DEST",
        help="a new or empty folder (or one per folder of a store on several folders)",
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar while copying (default: for large copies on a terminal)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Take the snapshot and say what it holds and what it cost."""
    if not args.src.is_dir():
        raise ConfigError(f"{str(args.src)!r} is not a folder; pass the folder of a tierswap store")
    with SwapStore(args.src, mode="r") as store:
        result = store.snapshot(args.dest, progress=args.progress)
    if args.json:
        print(
            json.dumps(
                {
                    "path": str(result.path),
                    "generation": result.generation,
                    "files": result.files,
                    "linked_bytes": result.linked_bytes,
                    "copied_bytes": result.copied_bytes,
                }
            )
        )
    else:
        print(
            f"snapshot of generation {result.generation} in {result.path}: {result.files} files, "
            f"{format_size(result.linked_bytes)} linked, {format_size(result.copied_bytes)} copied"
        )
    return 0
