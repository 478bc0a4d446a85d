"""A store on several folders against one folder, in one run, interleaved.

Times ``SwapStore.put`` + ``commit`` (durable) and ``get`` of one ``--size`` tensor for each
layout, ``--rounds`` times, the layouts interleaved within each round so that drift on a shared
machine spreads over all of them; the page cache is dropped (``--drop-cache``) before each read.

- ``one folder``: ``SwapStore(D/one)``, today's layout;
- ``N folders, one disk``: ``SwapStore([D/f0, D/f1, ...])``: the chunks striped over folders of
  the same disk, each folder with its own I/O queue. On one disk this cannot be faster; it
  shows what the striping costs (the target: within 5% of one folder);
- ``two drives`` (``--other B``): one folder on the disk of ``--dir`` and one in ``B``, on
  another drive or a tmpfs (``/dev/shm``: the two folders' engines differ, O_DIRECT and
  buffered); equal weights, so the slower drive sets the pace;
- ``two drives, weighted`` (``--other B --weights F``): the same with the folders weighted by
  the tune file ``F`` of ``tierswap bench --dir A --dir B --tune F``, so that each drive gets
  chunks in proportion to its bandwidth.

On real drives, ``tierswap bench --dir A --dir B --tune F`` measures each drive, then the
striped store against each drive alone. Drives of different speeds can be imitated on one
machine by capping each with ``bench/_throttle.py`` (docs/benchmarks.md, "Several drives").

    python bench/several_folders.py --dir /nvme/tmp --size 512MiB --rounds 2 --other /dev/shm
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tierswap import IOConfig, SwapStore
from tierswap.cli import check_free_space, drop_page_cache, random_source, size_arg
from tierswap.io import aligned_empty

KEY = "bench/tensor"
GB = 1e9


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dir", type=Path, default=Path(), help="folder on the disk to measure")
    p.add_argument("--size", type=size_arg, default="512MiB", help="bytes per trial")
    p.add_argument("--rounds", type=int, default=2, help="trials per layout (interleaved)")
    p.add_argument("--folders", type=int, default=2, help="folders on the one disk")
    p.add_argument("--other", type=Path, help="a folder on a second drive, or a tmpfs")
    p.add_argument("--weights", type=Path, help="tune file of tierswap bench --dir A --dir B")
    p.add_argument("--drop-cache", default="fadvise", choices=("auto", "drop_caches", "fadvise"))
    return p.parse_args(argv)


Layout = tuple[Callable[[], list[Path]], IOConfig | None]


def layouts(root: Path, args: argparse.Namespace) -> dict[str, Layout]:
    """Layout name -> (a function making fresh store folders for one trial, the IO settings)."""
    made: dict[str, Layout] = {
        "one folder": (lambda: [Path(tempfile.mkdtemp(dir=root)) / "store"], None),
        f"{args.folders} folders, one disk": (
            lambda: [Path(tempfile.mkdtemp(dir=root)) / f"f{i}" for i in range(args.folders)],
            None,
        ),
    }
    if args.other is not None:

        def two_drives() -> list[Path]:
            return [
                Path(tempfile.mkdtemp(dir=root)) / "disk",
                Path(tempfile.mkdtemp(prefix="tierswap-bench-", dir=args.other)) / "other",
            ]

        made["two drives"] = (two_drives, None)
        if args.weights is not None:
            made["two drives, weighted"] = (two_drives, IOConfig.from_file(args.weights))
    return made


def trial(
    folders: list[Path], io: IOConfig | None, src: torch.Tensor, dst: torch.Tensor, drop: str
) -> tuple[float, float]:
    """(write, read) bytes per second of put + commit and get, the folders removed after."""
    try:
        with SwapStore(folders if len(folders) > 1 else folders[0], mode="w", io=io) as store:
            start = time.perf_counter()
            store.put(KEY, src)
            store.commit()
            write = src.numel() / (time.perf_counter() - start)
        for folder in folders:
            drop_page_cache(folder, drop)  # type: ignore[arg-type]
        with SwapStore(folders[0], mode="r", io=io) as store:
            start = time.perf_counter()
            store.get(KEY, out=dst)
            read = dst.numel() / (time.perf_counter() - start)
        assert torch.equal(src, dst)
    finally:
        for folder in folders:
            shutil.rmtree(folder.parent, ignore_errors=True)
    return write, read


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_free_space(args.dir, args.size)
    src = random_source(args.size)
    dst = aligned_empty((args.size,), torch.uint8, pin=False)
    root = Path(tempfile.mkdtemp(prefix="tierswap-bench-", dir=args.dir))
    rates: dict[str, list[tuple[float, float]]] = {}
    try:
        made = layouts(root, args)
        for _ in range(args.rounds):
            for name, (make, io) in made.items():
                rates.setdefault(name, []).append(trial(make(), io, src, dst, args.drop_cache))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base = [statistics.median(r[i] for r in rates["one folder"]) for i in (0, 1)]
    print(f"{args.size / 2**20:.0f} MiB put+commit / get, median of {args.rounds}, GB/s")
    print(f"{'layout':<22}{'write':>8}{'read':>8}{'write/one':>11}{'read/one':>10}  samples")
    for name, samples in rates.items():
        med = [statistics.median(s[i] for s in samples) for i in (0, 1)]
        shown = ", ".join(f"{w / GB:.2f}/{r / GB:.2f}" for w, r in samples)
        print(
            f"{name:<22}{med[0] / GB:>8.2f}{med[1] / GB:>8.2f}"
            f"{med[0] / base[0]:>10.2f}x{med[1] / base[1]:>9.2f}x  {shown}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
