"""Closing what users leave open when the interpreter exits.

Caches and optimizers have I/O threads in flight; left open at exit, a helper thread can touch
torch while the runtime is torn down, which aborts the process. ``threading``'s at-exit hooks run
before the interpreter joins its threads (plain ``atexit`` runs after, when the store's pools no
longer take work; concurrent.futures uses the same hook).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import threading
import weakref
from typing import Protocol

__all__ = ["close_at_exit"]


class _Closable(Protocol):
    def close(self) -> None: ...


_OPEN: weakref.WeakValueDictionary[int, _Closable] = weakref.WeakValueDictionary()
_ORDER = itertools.count()


def close_at_exit(obj: _Closable) -> None:
    """Close ``obj`` at exit if it is still alive (and not closed) by then.

    Objects close newest first, so an owner (an optimizer's backend) closes before the cache it
    created earlier. Holds only a weak reference.
    """
    _OPEN[next(_ORDER)] = obj


def _close_open() -> None:
    for order in sorted(_OPEN.keys(), reverse=True):
        obj = _OPEN.get(order)
        if obj is not None:
            with contextlib.suppress(Exception):
                obj.close()


getattr(threading, "_register_atexit", atexit.register)(_close_open)
