"""What the project's threaded state machines (engine, pipeline, cache faults) share: the
faults their store doubles inject, the region store double of the engine and pipeline
machines, and their Hypothesis settings."""

from __future__ import annotations

import dataclasses
import errno
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from hypothesis import HealthCheck, settings

from tierswap import SwapStore

__all__ = ["ArmedFaults", "FlakyStore", "InjectedFault", "Put", "raise_", "threaded_settings"]


def threaded_settings(max_examples: int, steps: int) -> settings:
    """Settings of a state machine whose rules start threads."""
    return settings(
        max_examples=max_examples,
        stateful_step_count=steps,
        deadline=None,
        # threads make replays inexact: shrinking one failure, not each, keeps a failing run short
        report_multiple_bugs=False,
        suppress_health_check=[HealthCheck.too_slow],
    )


class InjectedFault(OSError):  # noqa: N818 (a fault the test injects, named as such)
    """A failure a store double injects: which call (``kind``: ``"read"``, ``"write"``, or a
    kind of its own) and how (``mode``: ``"raise"`` from the call, ``"fail"`` a failed future,
    ``"late"`` the data landed, then the error)."""

    def __init__(self, code: int, kind: str, mode: str, key: str) -> None:
        super().__init__(code, f"injected {kind} failure ({mode}) of {key!r}")
        self.kind = kind
        self.mode = mode


class ArmedFaults:
    """The fault of the next read and of the next write of a store double: armed by the test,
    consumed by the first call of its kind that starts after (whatever its key), and kept in
    :attr:`fired`. A kind other than ``"read"`` takes the write fault. Thread-safe."""

    def __init__(self) -> None:
        self.read_fault: str | None = None
        self.write_fault: str | None = None
        self.fired: list[InjectedFault] = []
        self._lock = threading.Lock()

    def arm(self, kind: str, mode: str) -> None:
        """Fail the next read (``kind="read"``) or write the way ``mode`` says."""
        with self._lock:
            if kind == "read":
                self.read_fault = mode
            else:
                self.write_fault = mode

    def disarm(self) -> None:
        with self._lock:
            self.read_fault = self.write_fault = None

    def _take(self, kind: str, key: str) -> InjectedFault | None:
        """The fault armed for this call of ``kind``, consumed and recorded, or ``None``."""
        with self._lock:
            if kind == "read":
                mode, self.read_fault = self.read_fault, None
            else:
                mode, self.write_fault = self.write_fault, None
            if mode is None:
                return None
            fault = InjectedFault(errno.EIO if kind == "read" else errno.ENOSPC, kind, mode, key)
            self.fired.append(fault)
            return fault


def raise_(error: BaseException) -> Any:
    raise error


@dataclasses.dataclass(frozen=True)
class Put:
    """A region write a store double was asked for: its bytes then, and its injected fault
    (``None``: it lands)."""

    key: str
    start: int
    data: torch.Tensor
    fault: InjectedFault | None


class FlakyStore(ArmedFaults):
    """A :class:`~tierswap.SwapStore` whose region I/O runs on one FIFO worker after a delay,
    and whose next read or write fails when armed. It logs every write it is asked for
    (:attr:`puts`), with a copy of the bytes the caller hands it then: the store writes the
    caller's tensor later, so a caller that changes it too early shows.

    One worker keeps the real store's order: a read runs after the writes started before it.
    Thread-safe: writes may start on any thread (those that land copies from the device).
    """

    def __init__(self, inner: SwapStore) -> None:
        super().__init__()
        self.inner = inner
        self.delay = 0.0
        self.puts: list[Put] = []  # every write asked for, in order
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="flaky-store")

    def info(self, key: str) -> Any:
        return self.inner.info(key)

    def stats(self) -> dict[str, int]:
        return self.inner.stats()

    def get_region_async(
        self, key: str, start: int, stop: int, out: torch.Tensor | None = None
    ) -> Future[torch.Tensor]:
        fault = self._take("read", key)
        if fault is not None and fault.mode == "raise":
            raise fault
        if fault is not None:
            return self._later(lambda: raise_(fault))
        return self._later(lambda: self.inner.get_region(key, start, stop, out=out))

    def put_region_async(self, key: str, start: int, tensor: torch.Tensor) -> Future[None]:
        fault = self._take("write", key)
        with self._lock:
            self.puts.append(Put(key, start, tensor.clone(), fault))
        if fault is not None and fault.mode == "raise":
            raise fault
        if fault is not None and fault.mode == "fail":
            return self._later(lambda: raise_(fault))
        if fault is not None:  # late: the data lands, then the error is reported
            return self._later(lambda: (self.inner.put_region(key, start, tensor), raise_(fault)))
        return self._later(lambda: self.inner.put_region(key, start, tensor))

    def _later(self, call: Callable[[], Any]) -> Future[Any]:
        delay = self.delay

        def run() -> Any:
            time.sleep(delay)
            return call()

        return self._worker.submit(run)

    # whole items: the machine moves regions only
    def get_async(self, key: str, out: torch.Tensor | None = None) -> Future[torch.Tensor]:
        raise NotImplementedError

    def put_async(self, key: str, tensor: torch.Tensor) -> Future[None]:
        raise NotImplementedError

    def put(self, key: str, tensor: torch.Tensor) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._worker.shutdown(wait=True)
