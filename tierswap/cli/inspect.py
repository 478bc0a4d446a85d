"""``tierswap inspect DIR``: what a swap store holds, who wrote it, and what it costs on disk.

A summary first (the writer, its step, world size and rank, the commit's generation and time,
tensors, bytes, disk use, the largest parameters), then one line per parameter in natural order
(``h.2`` before ``h.10``; a parameter is the group of arrays under one key prefix, e.g.
``transformer.h.0.attn.c_attn.weight/{exp_avg,exp_avg_sq,master}``). ``--all`` lists every
array instead; ``--json`` prints the full record. The store is opened read-only (``mode="r"``),
which is allowed while a writer has it open; the figures are those of the last commit it sees.

A store on several folders (one per drive) is inspected through its home folder, which lists
the others (or through all of them, in order: ``tierswap inspect A B``); a ``folders`` line
shows what each folder holds on disk, i.e. how the chunks are spread over the drives.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tierswap.config import format_size
from tierswap.errors import ConfigError
from tierswap.store import SwapStore

__all__ = ["add_parser", "collect", "natural_key", "run"]

#: The optimizer's entry in a commit's metadata.
OPTIMIZER_META = "tierswap.optim"
#: The group of the optimizer's own arrays (its pickled scalar state).
OPTIMIZER_GROUP = "optim"
#: Parameters listed in the summary's "largest" line.
LARGEST = 3


def add_parser(commands: Any) -> None:
    """Register ``inspect`` on the CLI's subparsers."""
    p = commands.add_parser(
        "inspect", help="summarize a store: writer, commit, parameters, disk use",
        description=__doc__,
    )  # fmt: skip
    p.add_argument(
        "dir",
        type=Path,
        nargs="+",
        metavar="DIR",
        help="the store's folder (its home, for a store on several folders; or all, in order)",
    )
    p.add_argument("--json", action="store_true", help="print the full record as JSON")
    p.add_argument(
        "--all", action="store_true", help="list every array, not one line per parameter"
    )
    p.set_defaults(run=run)


def natural_key(text: str) -> list[Any]:
    """Sort key that orders digit runs by value: ``p2`` before ``p10``, ``h.2`` before ``h.10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def collect(folder: Path | Sequence[Path]) -> dict[str, Any]:
    """The store's description as plain data (what ``--json`` prints)."""
    folders = [folder] if isinstance(folder, Path) else list(folder)
    for path in folders:
        if not path.is_dir():
            raise ConfigError(f"{str(path)!r} is not a folder; pass the folder of a tierswap store")
    folder = folders[0]
    with SwapStore(folders, mode="r") as store:
        infos = [store.info(key) for key in sorted(store.keys(), key=natural_key)]
        described = {
            "path": str(store.path),
            "durable": store.durable,  # a reader reports the flag stored on disk
            "generation": store.generation,
            "meta": store.meta,
        }
        disk_bytes = store.disk_usage()
        usage = store.folder_usage()
    meta = described["meta"] if isinstance(described["meta"], dict) else {}
    arrays: list[dict[str, Any]] = [
        {"key": a.key, "dtype": _dtype_name(a.dtype), "shape": list(a.shape), "nbytes": a.nbytes}
        for a in infos
    ]
    described.update(
        step=meta.get("step", _optimizer(meta).get("steps")),
        writer=_writer(meta),
        formats=_formats(meta),
        arrays=arrays,
        parameters=_parameters(arrays, _optimizer(meta)),
        nbytes=sum(a["nbytes"] for a in arrays),
        disk_bytes=disk_bytes,
        folders=[{"path": path, "disk_bytes": used} for path, used in usage.items()],
        committed=_commit_time(meta, folder),
    )
    return described


def _optimizer(meta: dict[str, Any]) -> dict[str, Any]:
    entry = meta.get(OPTIMIZER_META)
    return entry if isinstance(entry, dict) else {}


def _writer(meta: dict[str, Any]) -> dict[str, Any] | None:
    """Who made the commit: the optimizer's record, when a SwapOptimizer did."""
    entry = _optimizer(meta)
    if not entry:
        return None
    return {
        "by": "SwapOptimizer",
        "optimizer": entry.get("optimizer"),
        "steps": entry.get("steps"),
        "rank": entry.get("rank", 0),
        "world_size": entry.get("world_size", 1),
        "named": any(entry.get("names") or []),
    }


def _formats(meta: dict[str, Any]) -> dict[str, str] | None:
    """How an optimizer's folder stores moments and masters (``state_precision``, ``master``;
    folders written before compact state hold fp32)."""
    entry = _optimizer(meta)
    if not entry:
        return None
    return {k: str(entry.get(k, "fp32")) for k in ("state_precision", "master")}


def _commit_time(meta: dict[str, Any], folder: Path) -> str:
    recorded = _optimizer(meta).get("time")
    if isinstance(recorded, str):
        return recorded
    stamp = (folder / "zarr.json").stat().st_mtime  # the root document is rewritten per commit
    return datetime.datetime.fromtimestamp(stamp, datetime.timezone.utc).isoformat(
        timespec="seconds"
    )


def _parameters(arrays: list[dict[str, Any]], entry: dict[str, Any]) -> list[dict[str, Any]]:
    """Arrays grouped by key prefix (one parameter each), in natural order of the prefixes.

    For an optimizer's folder the parameter's name comes from the commit (positional keys
    ``p<i>`` of named parameters, or shortened names, show the real name).
    """
    names = dict(zip(entry.get("keys") or [], entry.get("names") or [], strict=False))
    groups: dict[str, list[dict[str, Any]]] = {}
    for array in arrays:
        prefix, _, _leaf = array["key"].rpartition("/")
        if entry and prefix == OPTIMIZER_GROUP:
            continue  # the optimizer's scalars, not a parameter
        groups.setdefault(prefix or array["key"], []).append(array)
    return [
        {
            "key": prefix,
            "name": names.get(prefix) or prefix,
            "arrays": [a["key"].rpartition("/")[2] for a in members],
            "shape": members[0]["shape"],
            "nbytes": sum(a["nbytes"] for a in members),
        }
        for prefix, members in sorted(groups.items(), key=lambda item: natural_key(item[0]))
    ]


def _shape(shape: list[int]) -> str:
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def print_text(described: dict[str, Any], stream: Any, *, every_array: bool = False) -> None:
    """The summary, then one line per parameter (or per array with ``every_array``)."""
    for label, value in _summary(described):
        print(f"{label:<12}{value}", file=stream)
    print(file=stream)
    if every_array:
        rows = [["key", "dtype", "shape", "bytes"]]
        rows += [
            [a["key"], a["dtype"], _shape(a["shape"]), format_size(a["nbytes"])]
            for a in described["arrays"]
        ]
    else:
        rows = [["parameter", "shape", "arrays", "bytes"]]
        rows += [
            [p["name"], _shape(p["shape"]), " ".join(p["arrays"]), format_size(p["nbytes"])]
            for p in described["parameters"]
        ]
    _table(rows, stream)


def _summary(described: dict[str, Any]) -> Iterable[tuple[str, str]]:
    mode = "durable" if described["durable"] else "scratch: durable=False, written in place"
    yield "store", f"{described['path']} ({mode})"
    writer = described["writer"]
    if writer is not None:
        naming = "parameter names" if writer["named"] else "positional keys p<i>"
        yield (
            "written by",
            (
                f"{writer['by']} ({writer['optimizer']}), step {writer['steps']}, rank "
                f"{writer['rank']} of {writer['world_size']}; keys: {naming}"
            ),
        )
    formats = described.get("formats")
    if formats:
        yield "formats", ", ".join(f"{k}={v}" for k, v in formats.items())
    shown = described["step"] is None or writer is not None  # the writer's line has the step
    step = "" if shown else f", step {described['step']}"
    yield "commit", f"generation {described['generation']}{step}, {described['committed']}"
    yield (
        "tensors",
        (
            f"{len(described['arrays'])} arrays in {len(described['parameters'])} parameters, "
            f"{format_size(described['nbytes'])}; {format_size(described['disk_bytes'])} on disk"
        ),
    )
    if len(described["folders"]) > 1:
        yield (
            "folders",
            ", ".join(f"{f['path']} {format_size(f['disk_bytes'])}" for f in described["folders"]),
        )
    largest = sorted(described["parameters"], key=lambda p: -p["nbytes"])[:LARGEST]
    if largest:
        yield "largest", ", ".join(f"{p['name']} {format_size(p['nbytes'])}" for p in largest)
    other = {k: v for k, v in (described["meta"] or {}).items() if k != OPTIMIZER_META}
    if other:
        yield "meta", json.dumps(other, sort_keys=True)


def _table(rows: list[list[str]], stream: Any) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        cells = [row[i].ljust(widths[i]) for i in range(3)]
        print("  ".join([*cells, row[3].rjust(widths[3])]).rstrip(), file=stream)


def run(args: argparse.Namespace) -> int:
    """Print the description; 0 on success."""
    described = collect(args.dir)
    if args.json:
        print(json.dumps(described, indent=2, default=str))
    else:
        print_text(described, sys.stdout, every_array=args.all)
    return 0
