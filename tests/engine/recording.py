"""A CPU stand-in of the engine's transfer layer that records the order of what happens.

:class:`RecordingTransfers` has the interface of :class:`tierswap.engine.Transfers` and behaves
like a GPU's copy engine: a copy runs later, on its own thread, after a short delay. A tensor
copied to the "device" holds garbage (NaN) until its copy has run, so a step that does not wait
for it computes garbage; a tensor copied back holds the bytes only once its future completes.
Every copy issued, event waited for, event recorded and copy finished is appended to ``log``;
tests add what they see (a step starting and ending, a disk write) with :meth:`note`, then check
the order with the functions below. It also counts the bytes of the "device" tensors it made that
are still alive (``device_bytes``, ``peak_device_bytes``): memory a GPU could not reuse yet.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future

import torch

from tierswap.engine import ToDevice, ToHost

__all__ = [
    "Op",
    "RecordingTransfers",
    "copies_issued_ahead",
    "steps_after_their_copies",
    "writes_after_landing",
]


@dataclasses.dataclass(frozen=True)
class Op:
    """One entry of the log: ``kind``, the copy's number (0 for noted ops), data pointers."""

    kind: str
    copy: int
    ptrs: tuple[int, ...]


def ptrs_of(tensors: Iterable[torch.Tensor]) -> tuple[int, ...]:
    return tuple(t.data_ptr() for t in tensors if t.numel())


def _garbage_like(tensor: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(tensor)
    return out.fill_(float("nan") if out.is_floating_point() else 90)


class RecordingTransfers:
    """Copies between two regions of CPU memory, as a GPU's copy engine would: later, after
    ``delay`` seconds each, one at a time (``delay=None``: at once, when issued).

    Kinds logged: ``h2d`` (copy issued: host ptr, device ptr; after ``upload_memory`` when its
    target was allocated for uploads), ``allocating`` (memory allocated for uploads),
    ``h2d_done``, ``wait`` (the compute stream waits for a copy's event: device ptr), ``record``
    (an event recorded on the compute stream before a copy back: device ptr), ``d2h`` (copy
    back issued: device ptr, host ptr), ``d2h_done`` (the bytes landed: host ptr).
    """

    moves = True

    def __init__(self, delay: float | None = 0.001) -> None:
        self.device = torch.device("cpu")
        self.log: list[Op] = []
        self._delay = delay
        self._lock = threading.Lock()
        self._numbers = itertools.count(1)
        self._queue: queue.SimpleQueue[tuple[Callable[[], object], Op, Future[None]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._copy_engine, daemon=True)
        self._thread.start()
        #: Bytes of the device tensors made by :meth:`to_device` still referenced, and the most.
        self.device_bytes = self.peak_device_bytes = 0
        self._bytes_lock = threading.RLock()  # (a finalizer may run inside a section)

    def _made(self, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        with self._bytes_lock:
            self.device_bytes += nbytes
            self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)
        weakref.finalize(tensor, self._freed, nbytes)

    def _freed(self, nbytes: int) -> None:
        with self._bytes_lock:
            self.device_bytes -= nbytes

    def note(self, kind: str, ptrs: tuple[int, ...] = (), copy: int = 0) -> None:
        with self._lock:
            self.log.append(Op(kind, copy, ptrs))

    def kinds(self) -> list[str]:
        with self._lock:
            return [op.kind for op in self.log]

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    # ------------------------------------------------------------------ the interface
    def to_device(
        self,
        host_tensor: torch.Tensor,
        device_tensor: torch.Tensor | None = None,
        *,
        upload_memory: bool = False,
    ) -> ToDevice:
        number = next(self._numbers)
        if upload_memory:  # a GPU's copy would not wait for the compute stream
            self.note("upload_memory", (), number)
        if device_tensor is None:
            device_tensor = _garbage_like(host_tensor)
            self._made(device_tensor)
        else:  # what a GPU's buffer holds before its copy runs (autograd records no copy)
            with torch.no_grad():
                device_tensor.fill_(float("nan") if device_tensor.is_floating_point() else 90)
        target = device_tensor
        self.note("h2d", (host_tensor.data_ptr(), device_tensor.data_ptr()), number)
        done = self._later(
            lambda: target.copy_(host_tensor),
            Op("h2d_done", number, (device_tensor.data_ptr(),)),
        )
        return ToDevice(device_tensor, number, done)

    def allocating(self) -> contextlib.AbstractContextManager[None]:
        self.note("allocating")
        return contextlib.nullcontext()

    def ready(self, copy: ToDevice) -> torch.Tensor:
        copy.done.result()  # the compute stream waits for the copy's event
        self.note("wait", (copy.device_tensor.data_ptr(),), copy.h2d_event)
        return copy.device_tensor

    def to_host(
        self, device_tensor: torch.Tensor, host_tensor: torch.Tensor | None = None
    ) -> ToHost:
        number = next(self._numbers)
        self.note("record", (device_tensor.data_ptr(),), number)
        host = (
            host_tensor
            if host_tensor is not None
            else torch.empty(device_tensor.numel(), dtype=device_tensor.dtype)
        )
        self.note("d2h", (device_tensor.data_ptr(), host.data_ptr()), number)
        done = self._later(
            lambda: host.copy_(device_tensor.reshape(-1)),
            Op("d2h_done", number, (host.data_ptr(),)),
        )
        return ToHost(host, done)

    # ------------------------------------------------------------------ the copy engine
    def _later(self, copy: Callable[[], object], finished: Op) -> Future[None]:
        done: Future[None] = Future()
        if self._delay is None:
            self._run(copy, finished, done)
        else:
            self._queue.put((copy, finished, done))
        return done

    def _copy_engine(self) -> None:
        while (item := self._queue.get()) is not None:
            time.sleep(self._delay or 0.0)
            self._run(*item)

    def _run(self, copy: Callable[[], object], finished: Op, done: Future[None]) -> None:
        try:
            with torch.no_grad():  # a copy engine knows nothing of autograd
                copy()
        except BaseException as exc:
            done.set_exception(exc)
            return
        with self._lock:
            self.log.append(finished)
        done.set_result(None)


# ---------------------------------------------------------------------- checks of a log
def steps_after_their_copies(log: list[Op]) -> list[str]:
    """Violations: a ``step`` op using a copied tensor whose copy was not waited for before."""
    return _used_before(
        log, ("h2d", "wait", "step"), "a step used copies {} before waiting for them"
    )


def writes_after_landing(log: list[Op]) -> list[str]:
    """Violations: a ``write`` op of a host tensor whose copy back had not landed."""
    return _used_before(log, ("d2h", "d2h_done", "write"), "wrote {} before its copy back landed")


def _used_before(log: list[Op], kinds: tuple[str, str, str], message: str) -> list[str]:
    """Violations of one ordering: ``kinds`` are (a copy issued into ``ptrs[1]``, that copy
    done, an op using ``ptrs``); a use of a pointer whose latest copy is not done is one,
    described by ``message`` with the late pointers."""
    issued, done, use = kinds
    latest: dict[int, int] = {}  # destination ptr -> the latest copy into it
    finished: set[int] = set()
    problems = []
    for index, op in enumerate(log):
        if op.kind == issued:
            latest[op.ptrs[1]] = op.copy
        elif op.kind == done:
            finished.add(op.copy)
        elif op.kind == use:
            late = [p for p in op.ptrs if p in latest and latest[p] not in finished]
            if late:
                problems.append(f"op {index}: {message.format(late)}")
    return problems


def copies_issued_ahead(log: list[Op]) -> tuple[int, int]:
    """How many steps that use copies (the first step left out) had every copy they use issued
    before the step ahead of them ended, and how many such steps there were."""
    issued: dict[int, int] = {}  # device ptr -> position of the latest h2d into it
    ends: list[int] = []  # positions of the ``stepped`` ops
    ahead = total = 0
    for index, op in enumerate(log):
        if op.kind == "h2d":
            issued[op.ptrs[1]] = index
        elif op.kind == "stepped":
            ends.append(index)
        elif op.kind == "step" and ends:
            copied = [issued[p] for p in op.ptrs if p in issued]
            if copied:
                total += 1
                ahead += max(copied) < ends[-1]
    return ahead, total
