"""The engine's one path to and from the store: reads into buffers a front end reserved, and
write-behind, with its error and ordering rules.

The :class:`~tierswap.Pipeline` reads and writes :class:`Region` s of stored arrays, the
:class:`~tierswap.TierCache` whole items (a plain key), both through a :class:`Disk`, where the
rules live once: a failed write-behind is kept and raised once (its callback hears of it too);
a write may wait for its bytes (``after``: a copy back from the device), and a read of bytes
such a write replaces waits until the store has the write; a write that cannot start counts as
failed once the writes of the same call that did start have ended.

A read of bytes that a write still in flight holds whole is *forwarded*: copied from that
write's tensor, which stays unchanged until the write ends, instead of read back from the
drive (a step that runs into the forward writes a slice's masters, and the forward reads them
a moment later). The newest write that overlaps the read decides: one that holds only part of
it sends the read to the store, which orders it after the write.

Private to :mod:`tierswap.engine`."""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

import torch

from tierswap.io import gather

if TYPE_CHECKING:
    from tierswap.store import ArrayInfo

__all__ = ["Disk", "Region", "StoreProtocol", "Target", "nbytes_of", "overlap"]


@dataclasses.dataclass(frozen=True)
class Region:
    """Elements ``[start, stop)`` of the flattened tensor stored under ``key``."""

    key: str
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


#: What a read or write names: a :class:`Region` of a stored array, or a key: the whole item
#: (read whole; written as the item, created or replaced with the tensor's shape).
Target = Region | str
#: Tensors to write, by what they replace: regions, or whole items.
Writes = Mapping[Region, torch.Tensor] | Mapping[str, torch.Tensor]


class StoreProtocol(Protocol):
    """What the engine needs from a store (a :class:`~tierswap.SwapStore`): array info, its
    traffic counters, reads and writes of regions and of whole items started asynchronously,
    and the synchronous write of an item (a write-through)."""

    def info(self, key: str) -> ArrayInfo: ...

    def stats(self) -> dict[str, int]: ...

    def get_async(self, key: str, out: torch.Tensor | None = None) -> Future[torch.Tensor]: ...

    def put_async(self, key: str, tensor: torch.Tensor) -> Future[None]: ...

    def put(self, key: str, tensor: torch.Tensor) -> None: ...

    def get_region_async(
        self, key: str, start: int, stop: int, out: torch.Tensor | None = None
    ) -> Future[torch.Tensor]: ...

    def put_region_async(self, key: str, start: int, tensor: torch.Tensor) -> Future[None]: ...


def overlap(a: Target, b: Target) -> bool:
    """Whether ``a`` and ``b`` share elements of one stored tensor."""
    if isinstance(a, str) or isinstance(b, str):
        return _key(a) == _key(b)
    return a.key == b.key and a.start < b.stop and b.start < a.stop


def _key(target: Target) -> str:
    return target if isinstance(target, str) else target.key


def _held_in(written: Target, tensor: torch.Tensor, target: Target) -> torch.Tensor | None:
    """The elements of ``target`` in ``tensor`` (written to ``written``), if it holds all of
    them."""
    if isinstance(written, str) or isinstance(target, str):
        return tensor if written == target else None
    if written.key != target.key or not written.start <= target.start < target.stop <= written.stop:
        return None
    return tensor.reshape(-1)[target.start - written.start : target.stop - written.start]


def nbytes_of(tensors: Mapping[Any, torch.Tensor]) -> int:
    """Bytes of the tensors of ``tensors``."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _start_write(store: StoreProtocol, target: Target, tensor: torch.Tensor) -> Future[None]:
    if isinstance(target, str):
        return store.put_async(target, tensor)
    return store.put_region_async(target.key, target.start, tensor)


def _start_all(
    start: Callable[[Any, torch.Tensor], Future[Any]], items: Mapping[Any, torch.Tensor]
) -> Future[Any]:
    """``start`` every item of ``items``; one future for all of them (its result raises the
    first failure once every one has ended). When one cannot even start, those started are
    waited for before the error is raised, so the caller may reuse the tensors at once."""
    futures: list[Future[Any]] = []
    try:
        for target, tensor in items.items():
            futures.append(start(target, tensor))
    except BaseException:
        gather(futures).exception()
        raise
    return gather(futures)


#: ``then(error)``: a write ended, ``error`` its failure or ``None``.
Then = Callable[[BaseException | None], None]


class Disk:
    """One front end's reads and write-behinds on ``store``.

    ``cv`` is the front end's condition: :attr:`in_flight` is read under it. A write's failure is
    recorded under it before the write's ``then`` runs (without it: ``then`` takes it as it
    needs), and the write stays in flight until ``then`` has returned. Reads and writes may be
    started from any thread; :meth:`wait` and :meth:`raise_errors` from the front end's callers."""

    def __init__(self, store: StoreProtocol, cv: threading.Condition) -> None:
        self.store, self._cv = store, cv
        self._futures: list[Future[Any]] = []  # writes not ended
        #: The writes handed to the store and not ended, by stored key: each write's target
        #: of that key and its tensor, in the order they were handed.
        self._writing: dict[str, list[tuple[Future[Any], Target, torch.Tensor]]] = {}
        self._pins: dict[Future[Any], int] = {}  # forwarded reads copying from each write
        self._forwarded = 0  # bytes of reads forwarded from writes in flight
        # writes waiting for their bytes (``after``): their targets, by the future of the
        # moment the store gets them
        self._unsent: dict[Future[None], tuple[Target, ...]] = {}
        self._errors: list[BaseException] = []
        self._baseline = store.stats()

    # ------------------------------------------------------------------ reads
    def read(self, target: Target, out: torch.Tensor | None = None) -> Future[torch.Tensor]:
        """Start reading ``target`` into ``out`` (a buffer whose bytes the caller reserved, or
        ``None``: the store allocates one). Waits first for writes still to be handed to the
        store that would replace bytes it reads; a read that a write in flight holds whole is
        copied from it (its bytes count in :meth:`traffic`). A read that cannot start raises
        here."""
        for handed in self.unsent_to((target,)):
            handed.exception()
        forwarded = self._forward(target, out)
        if forwarded is not None:
            return forwarded
        if isinstance(target, str):
            return self.store.get_async(target, out=out)
        return self.store.get_region_async(target.key, target.start, target.stop, out=out)

    def _forward(self, target: Target, out: torch.Tensor | None) -> Future[torch.Tensor] | None:
        """``target``'s values copied into ``out`` (a new tensor if ``None``) from the newest
        write in flight that overlaps it, if that write holds all of them (as many as ``out``
        holds, in its dtype); else ``None``. The write does not end (its tensor is not given
        back) during the copy."""
        with self._cv:
            found = self._newest_holding(target)
            if found is None:
                return None
            done, source = found
            if out is not None and (out.dtype != source.dtype or out.numel() != source.numel()):
                return None
            self._pins[done] = self._pins.get(done, 0) + 1
        try:
            with torch.no_grad():
                if out is None:
                    out = source.clone()
                else:
                    out.copy_(source.reshape(out.shape))
        finally:
            with self._cv:
                self._pins[done] -= 1
                self._cv.notify_all()
        with self._cv:
            self._forwarded += out.numel() * out.element_size()
        result: Future[torch.Tensor] = Future()
        result.set_result(out)
        return result

    def _newest_holding(self, target: Target) -> tuple[Future[Any], torch.Tensor] | None:
        """The newest write in flight that overlaps ``target`` and its elements of it, if it
        holds them all (one tensor of it). The caller holds the condition."""
        for done, written, tensor in reversed(self._writing.get(_key(target), ())):
            if overlap(written, target):
                source = _held_in(written, tensor, target)
                return None if source is None else (done, source)
        return None

    def read_all(self, reads: Mapping[Region, torch.Tensor]) -> Future[Any]:
        """Start every read of ``reads`` (region -> its buffer); one future for all of them
        (when one cannot start, as for writes: :func:`_start_all`)."""
        return _start_all(self.read, reads)

    # ------------------------------------------------------------------ write-behind
    @property
    def in_flight(self) -> bool:
        """Whether any write has not ended. The caller holds the condition."""
        return bool(self._futures)

    def write(
        self,
        writes: Writes,
        *,
        after: Future[Any] | None = None,
        then: Then | None = None,
        keep_errors: bool = True,
    ) -> Future[Any]:
        """Write ``writes`` behind the caller, once ``after`` (if given) completes, then call
        ``then(error)``. A failure is kept for :meth:`raise_errors` unless ``keep_errors`` is false
        (the caller hears of it through ``then`` or the future returned, which completes with the
        store's writes). The store gets the writes on the thread that completes ``after``, so the
        caller never waits for a copy back from the device; its tensors must stay unchanged until
        ``then`` runs."""
        done: Future[Any] = Future()
        with self._cv:
            self._futures.append(done)
        done.add_done_callback(lambda f: self._ended(f, writes, then, keep_errors))
        if after is None or after.done():
            self._hand(writes, after, done)
            return done
        handed: Future[None] = Future()
        with self._cv:
            self._unsent[handed] = tuple(writes)

        def hand(landed: Future[Any]) -> None:
            try:
                self._hand(writes, landed, done)
            finally:
                with self._cv:
                    del self._unsent[handed]
                handed.set_result(None)

        after.add_done_callback(hand)
        return done

    def _hand(self, writes: Writes, after: Future[Any] | None, done: Future[Any]) -> None:
        """Give ``writes`` to the store (``after`` has completed); ``done`` ends with them."""
        try:
            if after is not None:
                after.result()
            with self._cv:  # its bytes are there: reads of them may copy them from now on
                for target, tensor in writes.items():
                    self._writing.setdefault(_key(target), []).append((done, target, tensor))
            written = _start_all(functools.partial(_start_write, self.store), writes)
        except BaseException as exc:
            done.set_exception(exc)
            return
        written.add_done_callback(lambda w: _settle(done, w))

    def _ended(
        self, done: Future[Any], writes: Writes, then: Then | None, keep_errors: bool
    ) -> None:
        """Record a write's end: once no read copies from its tensors, reads stop copying
        from it; its failure first (for the ``raise_errors`` of whoever its ``then`` wakes),
        then ``then``, and only then the write leaves :attr:`in_flight`, so that :meth:`wait`
        (and a front end waiting for room) finds what ``then`` gave back."""
        error = done.exception()
        with self._cv:
            while self._pins.get(done):  # a forwarded read still copies its tensors
                self._cv.wait()
            self._pins.pop(done, None)
            for key in {_key(target) for target in writes}:
                left = [entry for entry in self._writing.get(key, ()) if entry[0] is not done]
                if left:
                    self._writing[key] = left
                else:
                    self._writing.pop(key, None)
            if error is not None and keep_errors:
                self._errors.append(error)
        try:
            if then is not None:
                then(error)
        finally:
            with self._cv:
                self._futures.remove(done)
                self._cv.notify_all()

    def put(self, key: str, tensor: torch.Tensor) -> None:
        """Write the item ``key`` now (a write-through; the caller waits), after any write of
        it still waiting for its bytes or in flight (reads copy from the newest write in
        flight: none may be older than this one). A failure raises here and is not kept."""
        for handed in self.unsent_to((key,)):
            handed.exception()
        with self._cv:
            while key in self._writing:
                self._cv.wait()  # each end notifies
        self.store.put(key, tensor)

    def unsent_to(self, reads: Iterable[Target]) -> list[Future[None]]:
        """Hand-overs to the store still to come of writes that overlap ``reads`` (a read
        started before would read the bytes those writes replace)."""
        wanted = tuple(reads)
        with self._cv:
            return [
                handed
                for handed, targets in self._unsent.items()
                if any(overlap(a, b) for a in targets for b in wanted)
            ]

    def wait(self) -> None:
        """Wait until every write started (also those started meanwhile) has ended."""
        with self._cv:
            while self._futures:
                self._cv.wait()  # each end notifies, once its ``then`` has returned

    def raise_errors(self) -> None:
        """Raise the first write failure not raised yet (and forget the others)."""
        with self._cv:
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    # ------------------------------------------------------------------ traffic
    def traffic(self) -> dict[str, int]:
        """What the store read and wrote since this disk was made: ``bytes_read`` and
        ``bytes_written`` (the bytes of each chunk file read or written: a region that covers
        part of a chunk may move the whole chunk), ``reads`` and ``writes`` (chunk files). The
        store's own counters, so they include any other user of the store; and
        ``bytes_forwarded``, this disk's reads copied from writes in flight (:meth:`read`)."""
        now = self.store.stats()
        with self._cv:
            forwarded = self._forwarded
        traffic = {name: now[name] - self._baseline.get(name, 0) for name in now}
        return {**traffic, "bytes_forwarded": forwarded}


def _settle(target: Future[Any], source: Future[Any]) -> None:
    """Complete ``target`` as ``source`` completed."""
    error = source.exception()
    if error is not None:
        target.set_exception(error)
    else:
        target.set_result(source.result())
