"""Host <-> device copies ordered by events: the engine's one transfer path.

On CUDA both directions run on side streams, so copies overlap the compute stream's work:
:meth:`Transfers.to_device` issues the copy on the *upload* stream and the consumer's
:meth:`Transfers.ready` makes the compute stream wait for its event (the GPU waits, the calling
thread does not); a copy into memory the compute stream had waits for that stream's work, unless
the memory was allocated for uploads (:meth:`Transfers.allocating`: a streamed parameter's, so
that its copy runs while the module before it computes); :meth:`Transfers.to_host` makes the
*download* stream wait for the compute work queued so far, copies there, and returns at once
with a future of the moment the bytes have landed (the write-behind waits for it, never the
caller). Every copy also has a future of the moment it has read its source, so a host buffer
returns to a pool only when no copy reads it. No copy is recorded by autograd, whatever the
caller's grad mode: a commit at ``close()`` runs with grad mode on, and reading a view of a
parameter made under ``no_grad`` after a step changed the parameter in place would raise there.

:class:`CudaTransfers` (one per GPU; a daemon thread completes the futures as the events are
reached), :class:`PassThrough` (the CPU: nothing moves) and test stand-ins with the same
interface implement :class:`Transfers`; :func:`transfers_for` picks one for a device."""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
from collections.abc import Hashable, Iterator, Mapping
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

import torch

from tierswap.engine._pool import allocate
from tierswap.io import gather

K = TypeVar("K", bound=Hashable)

__all__ = [
    "CudaTransfers",
    "PassThrough",
    "ToDevice",
    "ToHost",
    "Transfers",
    "completed",
    "to_host_all",
    "transfers_for",
]


@dataclasses.dataclass(frozen=True)
class ToDevice:
    """A host-to-device copy in flight.

    ``device_tensor`` holds the bytes once ``h2d_event`` is reached: pass this object to
    :meth:`Transfers.ready` before using it. ``done`` completes when the copy has read the host
    buffer, which may then be reused."""

    device_tensor: torch.Tensor
    h2d_event: Any
    done: Future[None]


@dataclasses.dataclass(frozen=True)
class ToHost:
    """A device-to-host copy in flight: ``host_tensor`` holds the bytes once ``done`` completes
    (and the device tensor's memory may then be reused)."""

    host_tensor: torch.Tensor
    done: Future[None]


class Transfers(Protocol):
    """Moves tensors between host memory and one compute device.

    ``device`` is where :meth:`to_device` puts tensors; ``moves`` is ``False`` when host and
    device are the same memory (nothing is copied, every future is complete), which lets a front
    end skip the device's bookkeeping. Thread safety: :meth:`to_device`, :meth:`ready` and
    :meth:`to_host` are called from the thread that queues the compute work (the ordering they
    give is that of its current stream), in any grad mode: no copy is recorded by autograd; the
    futures they return complete on any thread."""

    device: torch.device
    moves: bool

    def to_device(
        self,
        host_tensor: torch.Tensor,
        device_tensor: torch.Tensor | None = None,
        *,
        upload_memory: bool = False,
    ) -> ToDevice:
        """Start copying ``host_tensor`` to the device: into ``device_tensor`` (same shape and
        dtype), or a new tensor when ``None``. A ``device_tensor`` the compute stream may still
        use waits for the work queued there so far; one allocated inside :meth:`allocating`
        (``upload_memory``) does not, so its copy overlaps that work."""
        ...

    def allocating(self) -> contextlib.AbstractContextManager[None]:
        """A context in which device memory is allocated for uploads: an upload into it
        (``to_device(..., upload_memory=True)``) need not wait for the compute stream."""
        ...

    def ready(self, copy: ToDevice) -> torch.Tensor:
        """The copied tensor, ordered after its copy for the compute work queued from now on."""
        ...

    def to_host(
        self, device_tensor: torch.Tensor, host_tensor: torch.Tensor | None = None
    ) -> ToHost:
        """Start copying ``device_tensor`` (1-D view) into ``host_tensor`` (a new pinned buffer
        when ``None``), after the compute work queued so far."""
        ...


def completed() -> Future[None]:
    """A future that is already done: the handle of a copy that needed no waiting."""
    future: Future[None] = Future()
    future.set_result(None)
    return future


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``b`` already holds ``a`` (else a copy, which may also cast, is needed)."""
    return a is b or (a.dtype == b.dtype and a.device == b.device and a.data_ptr() == b.data_ptr())


def _copy_now(value: torch.Tensor, host_tensor: torch.Tensor | None) -> ToHost:
    """``value`` as the 1-D tensor to write: copied into ``host_tensor`` when that is other
    memory, else itself (a synchronous copy: nothing to wait for)."""
    # detach and view only where needed: each is an op, which lets the GIL go
    value = value.detach() if value.requires_grad else value
    flat = value if value.dim() == 1 else value.view(-1)
    if host_tensor is None or _same_memory(value, host_tensor):
        return ToHost(flat, completed())
    with torch.no_grad():
        host_tensor.copy_(flat)
    return ToHost(host_tensor, completed())


class PassThrough:
    """The transfer layer of a device that is host memory (the CPU): nothing moves.

    :meth:`to_device` hands the host tensor back; :meth:`to_host` copies only when the work put
    its result in other memory than the buffer to write (a new tensor), synchronously."""

    moves = False

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device if device is not None else torch.device("cpu")

    def to_device(
        self,
        host_tensor: torch.Tensor,
        device_tensor: torch.Tensor | None = None,
        *,
        upload_memory: bool = False,
    ) -> ToDevice:
        if device_tensor is None or _same_memory(host_tensor, device_tensor):
            return ToDevice(host_tensor, None, completed())
        with torch.no_grad():
            device_tensor.copy_(host_tensor)
        return ToDevice(device_tensor, None, completed())

    def allocating(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def ready(self, copy: ToDevice) -> torch.Tensor:
        return copy.device_tensor

    def to_host(
        self, device_tensor: torch.Tensor, host_tensor: torch.Tensor | None = None
    ) -> ToHost:
        return _copy_now(device_tensor, host_tensor)


class _EventWaiter:
    """Completes a future for each CUDA event once the event is reached.

    One daemon thread waits for the events in the order they were queued (each copy stream
    records them in order, so waiting in order delays no future by more than the other stream's
    copy). Callbacks of the futures (the write-behind starting a store write) run on it. It holds
    ``keep`` (the source of a copy) until the event is reached, so that memory a copy still reads
    is not freed."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[tuple[Any, Future[None], object]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def when_reached(self, event: Any, keep: object = None) -> Future[None]:
        future: Future[None] = Future()
        self._queue.put((event, future, keep))
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
        return future

    def _loop(self) -> None:
        while True:
            event, future, keep = self._queue.get()
            try:
                event.synchronize()
            except BaseException as exc:  # a failed device: whoever waits for the copy raises
                future.set_exception(exc)
            else:
                future.set_result(None)
            del event, future, keep  # nothing outlives its copy while the queue is empty


class CudaTransfers:
    """Copies between pinned host memory and one GPU on two side streams, ordered by events.

    Uploads run on one stream and downloads on another, so slice k+1's upload never queues behind
    slice k's download (which waits for step k). Memory rules of the caching allocator: an
    uploaded tensor is allocated on the upload stream and marked used by the compute stream in
    :meth:`ready`; a downloaded tensor is marked used by the download stream, so neither is
    reused before the streams that touch it are past it. Thread safety: as :class:`Transfers`;
    one instance per GPU is shared (:func:`transfers_for`)."""

    moves = True

    def __init__(self, device: torch.device) -> None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        self._upload = torch.cuda.Stream(device=self.device)
        self._download = torch.cuda.Stream(device=self.device)
        self._waiter = _EventWaiter(f"tierswap-cuda{index}-events")

    @property
    def streams(self) -> tuple[Any, Any]:
        """The upload and download side streams (for profiling: events recorded on them time
        the copies)."""
        return self._upload, self._download

    def to_device(
        self,
        host_tensor: torch.Tensor,
        device_tensor: torch.Tensor | None = None,
        *,
        upload_memory: bool = False,
    ) -> ToDevice:
        if device_tensor is not None and not upload_memory:  # the compute stream's memory,
            self._upload.wait_stream(torch.cuda.current_stream(self.device))  # maybe in use
        with torch.cuda.stream(self._upload), torch.no_grad():
            if device_tensor is None:
                device_tensor = torch.empty_like(host_tensor, device=self.device)
            device_tensor.copy_(host_tensor, non_blocking=True)
        h2d_event = self._upload.record_event()
        return ToDevice(
            device_tensor, h2d_event, self._waiter.when_reached(h2d_event, keep=host_tensor)
        )

    @contextlib.contextmanager
    def allocating(self) -> Iterator[None]:
        """Allocations inside come from the upload stream's pool of the caching allocator:
        memory that no work of that stream uses any more, and, once :meth:`ready` has marked
        it used by the compute stream too, freed only when that stream is past its uses."""
        with torch.cuda.stream(self._upload):
            yield

    def ready(self, copy: ToDevice) -> torch.Tensor:
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(copy.h2d_event)  # the GPU waits; this thread goes on
        copy.device_tensor.record_stream(compute)
        return copy.device_tensor

    def to_host(
        self, device_tensor: torch.Tensor, host_tensor: torch.Tensor | None = None
    ) -> ToHost:
        if device_tensor.device.type != "cuda":
            return _copy_now(device_tensor, host_tensor)
        step_event = torch.cuda.current_stream(self.device).record_event()
        self._download.wait_event(step_event)  # after the step that made the value
        if host_tensor is None:
            host_tensor = allocate((device_tensor.numel(),), device_tensor.dtype)
        with torch.cuda.stream(self._download), torch.no_grad():
            host_tensor.copy_(device_tensor.detach().view(-1), non_blocking=True)
        device_tensor.record_stream(self._download)
        d2h_event = self._download.record_event()
        return ToHost(host_tensor, self._waiter.when_reached(d2h_event))


_CUDA: dict[int, CudaTransfers] = {}
_CUDA_LOCK = threading.Lock()


def transfers_for(device: torch.device) -> Transfers:
    """The transfer layer for ``device``: the shared :class:`CudaTransfers` of a GPU, else
    :class:`PassThrough`."""
    if device.type != "cuda":
        return PassThrough(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _CUDA_LOCK:
        if index not in _CUDA:
            _CUDA[index] = CudaTransfers(torch.device("cuda", index))
        return _CUDA[index]


def to_host_all(
    transfers: Transfers, host: Mapping[K, torch.Tensor], tensors: Mapping[K, torch.Tensor]
) -> tuple[dict[K, torch.Tensor], Future[Any]]:
    """Start copying ``tensors`` into ``host``'s buffers of the same keys (new buffers for the
    others): the host tensors, and a future of the moment they all hold their bytes."""
    copies = {key: transfers.to_host(t, host.get(key)) for key, t in tensors.items()}
    return {key: c.host_tensor for key, c in copies.items()}, gather(
        [c.done for c in copies.values()]
    )
