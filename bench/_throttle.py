"""A slower disk for benchmarks: this process and its children under a cgroup blkio throttle.

The compact formats and several drives pay where the disk, not the CPU, bounds the step. A
fast NVMe drive on a small VM is CPU-bound instead, so the benches can cap the disk's
bandwidth the way the kernel does for a container: a cgroup (v1 ``blkio`` hierarchy) with
``blkio.throttle.read_bps_device`` and ``write_bps_device`` on the drive that holds the swap
folder. The throttle applies to direct I/O, which is all the store, fio and DeepSpeed's aio
do for data; buffered writes are not throttled by cgroup v1, so page-cache traffic is not
what this measures. Needs root and the v1 blkio controller mounted at /sys/fs/cgroup/blkio;
on a cgroup v2 machine run the whole command under ``systemd-run --scope -p
"IOReadBandwidthMax=<dev> <bps>" -p "IOWriteBandwidthMax=<dev> <bps>"`` instead.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

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


@contextlib.contextmanager
def throttled(folder: Path, read_bps: int, write_bps: int) -> Iterator[str]:
    """Run the body (and every process it starts) with ``folder``'s disk capped in bytes/s.

    Yields the device's ``major:minor``. The cgroup is removed on the way out, also after an
    error; a child still running then keeps it alive until it ends (rmdir fails quietly).
    """
    if not (BLKIO / "blkio.throttle.read_bps_device").exists():
        raise SystemExit(
            "--throttle needs the cgroup v1 blkio controller at /sys/fs/cgroup/blkio "
            "(on cgroup v2: systemd-run --scope -p IOReadBandwidthMax=... instead)"
        )
    device = whole_disk(folder)
    home = _current_blkio_group()
    group = BLKIO / f"tierswap-bench-{os.getpid()}"
    try:
        group.mkdir()
    except PermissionError as exc:
        raise SystemExit(f"--throttle needs root to create a cgroup: {exc}") from exc
    try:
        (group / "blkio.throttle.read_bps_device").write_text(f"{device} {read_bps}\n")
        (group / "blkio.throttle.write_bps_device").write_text(f"{device} {write_bps}\n")
        (group / "cgroup.procs").write_text(f"{os.getpid()}\n")
        try:
            yield device
        finally:
            (home / "cgroup.procs").write_text(f"{os.getpid()}\n")
    finally:
        with contextlib.suppress(OSError):
            group.rmdir()
