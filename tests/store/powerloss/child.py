"""The traced programs: ``python -m tests.store.powerloss.child SCENARIO BASE OUT [--planted]``.

Each scenario works only under ``BASE`` (empty at start), leaves markers in the trace
(``commit-start/G`` before a commit, ``commit-done/G`` once it returned, ``snapshot-done/NAME/G``)
and writes what each generation must hold to ``OUT`` (JSON, outside ``BASE``):

- ``store``: one folder, O_DIRECT where the filesystem has it: commits that add arrays and
  groups, replace whole tensors (recycling superseded chunk files as spares), write regions,
  delete arrays, and a snapshot by hard links in the middle;
- ``buffered``: the same with buffered I/O (``fdatasync`` per file, ``fsync`` per folder);
- ``folders``: the same over a folder list (``SwapStore([home, second])``);
- ``optimizer``: a SwapOptimizer trains a small model, committing every step, with a snapshot.

``--reopen`` only opens a store scenario's folders as a writer (rolling a journal forward) and
closes them: the recovery, traced from a crash state to check a second power cut during it.

``--planted`` runs a test-only variant of the store whose journal write renames its file into
place before the barrier that makes its data durable: the ordering bug the harness must find.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from tests.optim.models import batch_for_step, make_models, train_step
from tests.store.powerloss.trace import marker
from tierswap import IOConfig
from tierswap.optim import SwapOptimizer
from tierswap.store import SwapStore, _journal

#: The optimizer scenario's settings; the checker resumes with the same.
OPTIM_KWARGS: dict[str, Any] = {"host_budget": 8192, "commit_every": 1, "lr": 1e-2}
CHUNK = 4096


def tensor_digest(t: torch.Tensor) -> str:
    raw = (
        t.contiguous().view(-1).view(torch.uint8)
        if t.numel()
        else torch.empty(0, dtype=torch.uint8)
    )
    return hashlib.sha256(f"{t.dtype}{list(t.shape)}".encode() + raw.numpy().tobytes()).hexdigest()


def store_digest(store: SwapStore) -> dict[str, str]:
    """What a reader must find: every key's dtype, shape and bytes."""
    return {key: tensor_digest(store.get(key)) for key in sorted(store.keys())}


def _values(gen: int, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float64) * 0.25 + gen * 1000).to(dtype)


def edit(store: SwapStore, gen: int) -> None:
    """The changes of commit ``gen``: each kind of change the store makes, over the commits."""
    if gen == 1:
        store.put("a", _values(1, 3 * CHUNK // 4))  # three chunks
        store.put("b/x", _values(1, 100, torch.bfloat16))
        store.put("c", torch.arange(2000, dtype=torch.int64))
    elif gen % 4 == 2:
        store.put("a", _values(gen, 3 * CHUNK // 4))  # whole chunks replaced: spares recycled
        store.put(f"d{gen}/e/f", _values(gen, 1500))  # a new array in new groups
    elif gen % 4 == 3:
        store.put_region("a", 1000, _values(gen, 300))  # one chunk of three rewritten
        store.delete("b/x") if "b/x" in store else store.put("b/x", _values(gen, 7))
        if f"d{gen - 5}/e/f" in store:
            store.delete(f"d{gen - 5}/e/f")  # an array and its groups removed
    elif gen % 4 == 0:
        store.put("c", torch.arange(2000, dtype=torch.int64) * gen)
        store.put("a", _values(gen, 3 * CHUNK // 4))
    else:
        store.put_region("c", 700, torch.full((600,), gen, dtype=torch.int64))
        store.put("b/x", _values(gen, 100, torch.bfloat16))


def store_args(scenario: str, base: Path) -> tuple[Any, Path, IOConfig]:
    """A store scenario's folders under ``base``: (what SwapStore takes, the home, its I/O)."""
    if scenario == "folders":
        return [base / "home", base / "second"], base / "home", IOConfig()
    io = IOConfig(direct="off") if scenario == "buffered" else IOConfig()
    return base / "run", base / "run", io


def run_store(scenario: str, base: Path, out: dict[str, Any], commits: int) -> None:
    paths, _home, io = store_args(scenario, base)
    with SwapStore(paths, chunk_bytes=CHUNK, io=io) as store:
        for gen in range(1, commits + 1):
            edit(store, gen)
            marker(f"commit-start/{gen}")
            assert store.commit({"gen": gen}) == gen
            marker(f"commit-done/{gen}")
            out["generations"][gen] = store_digest(store)
            if gen == 3:
                store.snapshot(base / "snap3")  # hard links to gen 3's chunk files
                marker(f"snapshot-done/snap3/{gen}")


def run_optimizer(base: Path, out: dict[str, Any], steps: int) -> None:
    _, model = make_models()
    with SwapOptimizer(
        model.parameters(), torch.optim.AdamW, swap_dir=base / "run", **OPTIM_KWARGS
    ) as opt:
        for step in range(steps):
            marker(f"commit-start/{step + 1}")
            train_step(model, opt, batch_for_step(step))
            marker(f"commit-done/{step + 1}")
            if step == 2:
                opt.snapshot(base / "snap3")
                marker("snapshot-done/snap3/3")


def reopen(scenario: str, base: Path, out: dict[str, Any]) -> None:
    """Open a store scenario's folders as a writer after a crash (which rolls a journal
    forward) and close them: the recovery whose own crash states the harness checks."""
    paths, _home, io = store_args(scenario, base)
    with SwapStore(paths, chunk_bytes=CHUNK, io=io) as store:
        out["generation"] = store.generation
        marker(f"recovered/{store.generation}")


@contextlib.contextmanager
def planted() -> Iterator[None]:
    """The journal renamed into place before its data is synced: a power cut between the two
    can leave a journal of zeros (or empty) under the committed name."""

    def rename_first(path: Path, data: bytes, *, sync: bool = True) -> None:
        tmp = path.with_name(path.name + ".partial")
        with open(tmp, "wb") as fh:
            fh.write(data)
            os.replace(tmp, path)
            if sync:
                fh.flush()
                os.fdatasync(fh.fileno())
        if sync:
            _journal.fsync_dir(path.parent)

    original: Callable[..., None] = _journal.atomic_write_bytes
    _journal.atomic_write_bytes = rename_first  # type: ignore[assignment]
    try:
        yield
    finally:
        _journal.atomic_write_bytes = original  # type: ignore[assignment]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("scenario", choices=["store", "buffered", "folders", "optimizer"])
    p.add_argument("base", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--commits", type=int, default=8)
    p.add_argument("--planted", action="store_true")
    p.add_argument("--reopen", action="store_true", help="only open the folders (a recovery)")
    args = p.parse_args()
    out: dict[str, Any] = {"generations": {}}
    with planted() if args.planted else contextlib.nullcontext():
        if args.reopen:
            reopen(args.scenario, args.base, out)
        elif args.scenario == "optimizer":
            run_optimizer(args.base, out, args.commits)
        else:
            run_store(args.scenario, args.base, out, args.commits)
    args.out.write_text(json.dumps(out))


if __name__ == "__main__":
    main()
