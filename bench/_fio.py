"""fio's sequential O_DIRECT bandwidth of a folder: the disk's ceiling, for the benches' I/O
bounds (the bytes a run moved at this bandwidth)."""

from __future__ import annotations

from pathlib import Path

from tierswap.cli import FioEngine, run_trial, which


def fio_bandwidth(folder: Path, nbytes: int) -> dict[str, float] | None:
    """fio's write and read bandwidth (bytes/s) over ``nbytes`` in ``folder``, or ``None``
    where fio is not installed."""
    binary = which("fio")
    if binary is None:
        return None
    sample, _ = run_trial(FioEngine(nbytes, binary=binary), folder)
    return {"write": sample.write_bps, "read": sample.read_bps}


def required_fio_bandwidth(folder: Path, nbytes: int) -> dict[str, float]:
    """:func:`fio_bandwidth`, for a bench whose report needs it: exits without fio."""
    bandwidth = fio_bandwidth(folder, nbytes)
    if bandwidth is None:
        raise SystemExit("fio is needed for the I/O bound: apt-get install fio")
    return bandwidth
