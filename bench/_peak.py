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


def peak_rss() -> int:
    """Bytes: the highest resident set size of this process so far."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB elsewhere
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
