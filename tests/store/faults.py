"""Fault injection for the error-path tests, at the store's I/O seam.

:class:`FaultyEngine` wraps a store's :class:`~tierswap.io.IOEngine` (whole-file calls and the
jobs run on its pool fail or wait); :class:`ShortIO` stands in for the ``os`` module of the
engine's own module, so that its ``pwritev`` / ``preadv`` move fewer bytes than asked, as a
drive may.
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any, Literal

import pytest

from tierswap.config import ALIGN
from tierswap.io import IOEngine
from tierswap.io import _engine as engine_module


class FaultyEngine:
    """Delegates to an :class:`IOEngine`; chosen calls of chosen methods or jobs fail or wait.

    ``fail={"write_file": {2}}`` makes the second ``write_file`` call raise ``error()``;
    ``gate={"read_file": event}`` makes every ``read_file`` call wait for ``event`` first
    (``entered[name]`` is set when the first such call arrives). A name may also be that of a
    function run through :meth:`submit` (``"fdatasync_path"``, ``"fsync_dir"`` of a commit's
    syncs, the store's ``"write"``, ``"read"``...): that job fails or waits on the worker
    thread that runs it, as a failing drive would make it. ``calls[name]`` counts the calls.
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
        self.failed: Counter[str] = Counter()
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name not in self.fail and name not in self.gate:
            return attr
        return self._wrap(name, attr)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Any:
        job = getattr(fn, "__name__", "")
        if job in self.fail or job in self.gate:
            fn = self._wrap(job, fn)
        return self.__getattr__("submit")(fn, *args)

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.calls[name] += 1
                n = self.calls[name]
            if name in self.gate:
                self.entered[name].set()
                assert self.gate[name].wait(10), f"{name} gate never opened"
            if n in self.fail.get(name, ()):
                with self._lock:
                    self.failed[name] += 1
                raise self.error()
            return fn(*args, **kwargs)

        return call


def inject(store: Any, **kwargs: Any) -> FaultyEngine:
    """Put a :class:`FaultyEngine` between ``store`` and its (home folder's) engine; returns it.

    The data path's reads and writes and the commit's per-file syncs go through it.
    """
    faulty = FaultyEngine(store._engine, **kwargs)
    _swap_engine(store, faulty)
    return faulty


def remove(store: Any) -> None:
    """Undo :func:`inject`: the store talks to its own engine again."""
    engine = store._engine
    while isinstance(engine, FaultyEngine):
        engine = engine.inner
    _swap_engine(store, engine)


def _swap_engine(store: Any, engine: Any) -> None:
    store._engine = engine
    store._chunks.engine = engine  # the data path's reads and writes
    store._commits._sync._engine = engine  # a commit's fdatasync / fsync jobs


#: How a chosen ``pwritev`` / ``preadv`` call misbehaves: ``"short"`` moves part of the bytes
#: asked for (a multiple of the page under O_DIRECT, as a drive moves whole sectors) and returns
#: that count; ``"stuck"`` moves nothing and returns 0, on that call and every later one until
#: :meth:`ShortIO.disarm` (a drive that stopped accepting or returning bytes).
ShortMode = Literal["short", "stuck"]


class ShortIO:
    """Stands in for ``os`` in the engine's module: chosen calls of ``pwritev`` / ``preadv``
    are short; every other name is the real ``os``'s.

    ``ShortIO({"pwritev": {3: "short"}, "preadv": {1: "stuck"}})``; install it with
    :func:`short_io`. ``calls[name]`` counts the calls, ``cut[name]`` those that moved fewer
    bytes than asked (a ``"short"`` call that cannot be cut, a request of one page under
    O_DIRECT, moves everything and is not counted). Thread safe.
    """

    def __init__(self, plan: dict[str, dict[int, ShortMode]]) -> None:
        self.plan = plan
        self.calls: Counter[str] = Counter()
        self.cut: Counter[str] = Counter()
        self._stuck: set[str] = set()
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def disarm(self) -> None:
        """Every later call moves all its bytes."""
        with self._lock:
            self.plan = {}
            self._stuck.clear()

    def pwritev(self, fd: int, buffers: list[Any], offset: int) -> int:
        return self._call("pwritev", os.pwritev, fd, buffers, offset)

    def preadv(self, fd: int, buffers: list[Any], offset: int) -> int:
        return self._call("preadv", os.preadv, fd, buffers, offset)

    def _call(
        self, name: str, real: Callable[..., int], fd: int, buffers: list[Any], at: int
    ) -> int:
        with self._lock:
            self.calls[name] += 1
            mode = self.plan.get(name, {}).get(self.calls[name])
            if mode == "stuck":
                self._stuck.add(name)
            stuck = name in self._stuck
        view = memoryview(buffers[0]).cast("B")
        if stuck:
            self._count_cut(name)
            return 0
        keep = len(view) // 3  # buffered: any count
        if fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0):
            keep = len(view) // 2 - len(view) // 2 % ALIGN  # whole pages
        if mode != "short" or keep == 0:
            return real(fd, [view], at)
        self._count_cut(name)
        return real(fd, [view[:keep]], at)

    def _count_cut(self, name: str) -> None:
        with self._lock:
            self.cut[name] += 1


def short_io(monkeypatch: pytest.MonkeyPatch, plan: dict[str, dict[int, ShortMode]]) -> ShortIO:
    """Install a :class:`ShortIO` as the engine module's ``os`` (until the test ends)."""
    fake = ShortIO(plan)
    monkeypatch.setattr(engine_module, "os", fake)
    return fake


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
