"""This process's peak resident set size, for the benches' child processes.

``resource.getrusage(RUSAGE_SELF).ru_maxrss`` is not it in a child: exec carries the RSS of
the process that spawned it into that figure (a parent of 600 MiB makes a 10 MiB child report
626 MiB). ``VmHWM`` in ``/proc/self/status`` is the child's own high-water mark; ``ru_maxrss``
stays the fallback where ``/proc`` is missing. Imports nothing beyond the standard library, so
the DeepSpeed children's interpreter can use it too.
"""

from __future__ import annotations

import resource
import sys


def _status_bytes(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` in bytes, or ``None`` without ``/proc``."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def current_rss() -> int:
    """Bytes: this process's resident set size now (0 where ``/proc`` is missing)."""
    return _status_bytes("VmRSS") or 0


def file_rss() -> int:
    """Bytes: the file-backed part of the resident set now (``RssFile``: mapped libraries'
    code and data pages, clean and shared; 0 where ``/proc`` is missing)."""
    return _status_bytes("RssFile") or 0


def peak_rss() -> int:
    """Bytes: the highest resident set size of this process so far."""
    peak = _status_bytes("VmHWM")
    if peak is not None:
        return peak
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB elsewhere
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
