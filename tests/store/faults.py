"""A fault-injecting wrapper around the store's I/O engine, for the error-path tests."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from tierswap.io import IOEngine


class FaultyEngine:
    """Delegates to an :class:`IOEngine`; chosen calls of chosen methods fail or wait.

    ``fail={"write_file": {2}}`` makes the second ``write_file`` call raise ``error()``;
    ``gate={"read_file": event}`` makes every ``read_file`` call wait for ``event`` first
    (``entered[name]`` is set when the first such call arrives).
    """

    def __init__(
        self,
        inner: IOEngine,
        *,
        fail: dict[str, set[int]] | None = None,
        error: Callable[[], BaseException] = lambda: OSError(5, "Input/output error"),
        gate: dict[str, threading.Event] | None = None,
    ) -> None:
        self.inner = inner
        self.fail = fail or {}
        self.error = error
        self.gate = gate or {}
        self.entered = {name: threading.Event() for name in self.gate}
        self.calls: Counter[str] = Counter()
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name not in self.fail and name not in self.gate:
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.calls[name] += 1
                n = self.calls[name]
            if name in self.gate:
                self.entered[name].set()
                assert self.gate[name].wait(10), f"{name} gate never opened"
            if n in self.fail.get(name, ()):
                raise self.error()
            return attr(*args, **kwargs)

        return call


def inject(store: Any, **kwargs: Any) -> FaultyEngine:
    """Put a :class:`FaultyEngine` between ``store`` and its engine; returns it."""
    faulty = FaultyEngine(store._engine, **kwargs)
    store._engine = faulty
    store._chunks.engine = faulty  # the data path's reads and writes go through it too
    return faulty


def finishes(fn: Callable[[], Any], timeout: float = 10.0) -> Any:
    """Run ``fn`` in a daemon thread; fail the test (not hang it) when it does not finish."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # re-raised in the test's thread
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{fn} did not finish within {timeout} s (deadlock?)"
    if "error" in box:
        raise box["error"]
    return box.get("value")
