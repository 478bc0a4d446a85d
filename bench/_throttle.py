"""A slower disk for benchmarks: this process and its children under a cgroup blkio throttle.

The compact formats and several drives pay where the disk, not the CPU, bounds the step. A
fast NVMe drive on a small VM is CPU-bound instead, so the benches can cap the disk's
bandwidth the way the kernel does for a container: a cgroup (v1 ``blkio`` hierarchy) with
``blkio.throttle.read_bps_device`` and ``write_bps_device`` on the drive that holds a folder.
The throttle applies to direct I/O, which is all the store, fio and DeepSpeed's aio do for
data; buffered writes are not throttled by cgroup v1, so page-cache traffic is not what this
measures. Needs root and the v1 blkio controller mounted at /sys/fs/cgroup/blkio; on a cgroup
v2 machine run the whole command under ``systemd-run --scope -p "IOReadBandwidthMax=<dev>
<bps>" -p "IOWriteBandwidthMax=<dev> <bps>"`` instead.

``bench/e2e.py --throttle`` uses it; any other command runs under it from the shell, one
``--cap`` per drive (each folder's whole disk gets its own read and write cap):

    python bench/_throttle.py --cap /a 250MB,250MB --cap /b 125MB,125MB -- tierswap bench ...
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tierswap.config import parse_size

BLKIO = Path("/sys/fs/cgroup/blkio")


def whole_disk(folder: Path) -> str:
    """``major:minor`` of the block device under ``folder``, the whole disk for a partition."""
    dev = os.stat(folder).st_dev
    node = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if os.major(dev) == 0 or not node.exists():
        raise SystemExit(f"--throttle: {folder} is not on a block device (tmpfs, overlay?)")
    if (node / "partition").exists():
        node = node.resolve().parent  # throttles apply to whole disks, not partitions
    return (node / "dev").read_text().strip()


def _current_blkio_group() -> Path:
    """This process's blkio cgroup folder (v1), to come back to."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "blkio" in controllers.split(","):
            return BLKIO / path.lstrip("/")
    raise SystemExit("--throttle: this process has no cgroup v1 blkio group")


def _caps(caps: Sequence[tuple[Path, int, int]]) -> dict[str, tuple[int, int]]:
    """Read and write caps per ``major:minor``; two folders of one disk must agree."""
    by_device: dict[str, tuple[int, int]] = {}
    for folder, read_bps, write_bps in caps:
        device = whole_disk(folder)
        if by_device.setdefault(device, (read_bps, write_bps)) != (read_bps, write_bps):
            raise SystemExit(f"--throttle: two different caps for disk {device} ({folder})")
    return by_device


@contextlib.contextmanager
def throttled(caps: Sequence[tuple[Path, int, int]]) -> Iterator[dict[str, tuple[int, int]]]:
    """Run the body (and every process it starts) with each folder's disk capped, bytes/s.

    ``caps`` holds (folder, read cap, write cap). Yields the caps per ``major:minor``. The
    cgroup is removed on the way out, also after an error; a child still running then keeps
    it alive until it ends (rmdir fails quietly).
    """
    if not (BLKIO / "blkio.throttle.read_bps_device").exists():
        raise SystemExit(
            "--throttle needs the cgroup v1 blkio controller at /sys/fs/cgroup/blkio "
            "(on cgroup v2: systemd-run --scope -p IOReadBandwidthMax=... instead)"
        )
    devices = _caps(caps)
    home = _current_blkio_group()
    group = BLKIO / f"tierswap-bench-{os.getpid()}"
    try:
        group.mkdir()
    except PermissionError as exc:
        raise SystemExit(f"--throttle needs root to create a cgroup: {exc}") from exc
    try:
        for device, (read_bps, write_bps) in devices.items():
            (group / "blkio.throttle.read_bps_device").write_text(f"{device} {read_bps}\n")
            (group / "blkio.throttle.write_bps_device").write_text(f"{device} {write_bps}\n")
        (group / "cgroup.procs").write_text(f"{os.getpid()}\n")
        try:
            yield devices
        finally:
            (home / "cgroup.procs").write_text(f"{os.getpid()}\n")
    finally:
        with contextlib.suppress(OSError):
            group.rmdir()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run a command with the disks under some folders capped (cgroup v1 blkio)."
    )
    parser.add_argument(
        "--cap", nargs=2, action="append", required=True, metavar=("FOLDER", "READ,WRITE"),
        help="cap FOLDER's whole disk at READ and WRITE bytes/s, e.g. /mnt/a 250MB,250MB",
    )  # fmt: skip
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command to run (put it after --)")
    try:
        caps = [(Path(folder), *rates(value)) for folder, value in args.cap]
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    with throttled(caps) as devices:
        for device, (read_bps, write_bps) in devices.items():
            print(f"disk {device} capped: read {read_bps / 1e6:.0f} MB/s, "
                  f"write {write_bps / 1e6:.0f} MB/s", file=sys.stderr)  # fmt: skip
        return subprocess.run(command, check=False).returncode


def rates(value: str) -> tuple[int, int]:
    """``"250MB,125MB"`` -> (250e6, 125e6): a read and a write cap, any tierswap size."""
    try:
        read, write = (parse_size(part) for part in value.split(","))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"{value!r}: want READ,WRITE sizes per second, e.g. 500MB,500MB"
        ) from exc
    return read, write


if __name__ == "__main__":
    sys.exit(main())
