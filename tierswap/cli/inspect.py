"""``tierswap inspect DIR``: what a swap store holds, at which commit, and what it costs on disk.

The store is opened read-only (``mode="r"``), which is allowed while a writer has it open; the
figures are those of the last commit the reader sees.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tierswap.config import format_size
from tierswap.errors import ConfigError
from tierswap.store import SwapStore

__all__ = ["add_parser", "collect", "run"]


def add_parser(commands: Any) -> None:
    """Register ``inspect`` on the CLI's subparsers."""
    p = commands.add_parser(
        "inspect", help="list a store's arrays, commit and disk use", description=__doc__
    )
    p.add_argument("dir", type=Path, metavar="DIR", help="the store's folder")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(run=run)


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def collect(folder: Path) -> dict[str, Any]:
    """The store's description as plain data (what ``--json`` prints)."""
    if not folder.is_dir():
        raise ConfigError(f"{str(folder)!r} is not a folder; pass the folder of a tierswap store")
    with SwapStore(folder, mode="r") as store:
        arrays = [store.info(key) for key in sorted(store.keys())]
        described = {
            "path": str(store.path),
            "durable": store.durable,  # a reader reports the flag stored on disk
            "generation": store.generation,
            "meta": store.meta,
        }
        disk_bytes = store.disk_usage()
    meta = described["meta"] if isinstance(described["meta"], dict) else {}
    described["step"] = meta.get("step")
    described["arrays"] = [
        {"key": a.key, "dtype": _dtype_name(a.dtype), "shape": list(a.shape), "nbytes": a.nbytes}
        for a in arrays
    ]
    described["nbytes"] = sum(a.nbytes for a in arrays)
    described["disk_bytes"] = disk_bytes
    return described


def _rows(arrays: list[dict[str, Any]]) -> list[list[str]]:
    rows = [["key", "dtype", "shape", "bytes"]]
    for a in arrays:
        shape = "(" + ", ".join(map(str, a["shape"])) + ("," if len(a["shape"]) == 1 else "") + ")"
        rows.append([a["key"], a["dtype"], shape, format_size(a["nbytes"])])
    return rows


def print_text(described: dict[str, Any], stream: Any) -> None:
    """Human-readable summary, then one line per array."""
    mode = "durable" if described["durable"] else "scratch: durable=False, written in place"
    meta = json.dumps(described["meta"] or {}, sort_keys=True)
    step = "" if described["step"] is None else f", step {described['step']}"
    print(f"store       {described['path']} ({mode})", file=stream)
    print(f"commit      generation {described['generation']}{step}, meta {meta}", file=stream)
    print(
        f"arrays      {len(described['arrays'])} holding {format_size(described['nbytes'])}; "
        f"{format_size(described['disk_bytes'])} on disk",
        file=stream,
    )
    rows = _rows(described["arrays"])
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    print(file=stream)
    for row in rows:
        cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1]), row[2].ljust(widths[2])]
        print("  ".join([*cells, row[3].rjust(widths[3])]).rstrip(), file=stream)


def run(args: argparse.Namespace) -> int:
    """Print the description; 0 on success."""
    described = collect(args.dir)
    if args.json:
        print(json.dumps(described, indent=2, default=str))
    else:
        print_text(described, sys.stdout)
    return 0
