"""Region reads and writes: an element range of a stored tensor, a chunk at a time.

Only the chunks a region covers are read or written, so a tensor larger than memory can be
streamed a slice at a time. A region write replaces whole chunk files (durable: new staged
files, committed like a put; scratch: overwritten in place), reading and re-checking a chunk
first only where the region covers it partly (see :mod:`tierswap.store._chunks`).

Region operations wait only for the writes (and a scratch store's in-place write for the
reads) of the chunks they touch, and for a put of the key in flight.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import torch

from tierswap.errors import InvalidTensorError, RegionError
from tierswap.io import gather
from tierswap.store._chunks import ChunkFiles
from tierswap.store._gate import Gate
from tierswap.store._index import Chunk, Discard, Entry, StoreIndex
from tierswap.store._layout import ArrayMeta
from tierswap.store._staging import ChunkTargets, unlink_all
from tierswap.store._tensors import as_cpu_contiguous, prepare_out

__all__ = ["RegionClaim", "RegionIO", "check_region"]


def check_region(meta: ArrayMeta, start: int, stop: int, dtype: torch.dtype | None = None) -> range:
    """The chunk indices of elements ``[start, stop)``; raises for a bad region or dtype."""
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (start, stop))
    if not ints or not 0 <= start <= stop <= meta.numel:
        raise RegionError(
            f"region [{start!r}, {stop!r}) of key {meta.key!r} is not within its {meta.numel} "
            f"elements; pass ints with 0 <= start <= stop <= {meta.numel}"
        )
    if dtype is not None and dtype != meta.dtype:
        raise InvalidTensorError(
            f"key {meta.key!r} holds {meta.dtype}, not {dtype}; convert the tensor first"
        )
    return meta.chunk_span(start, stop)


class RegionClaim:
    """A region read or write of ``key``'s chunks (:attr:`entry` and :attr:`span` once taken).

    It waits while a put of the key or a write of one of its chunks is in flight, and an
    in-place write (``in_place``: a scratch store's) also while a read of one of them is.
    """

    def __init__(
        self,
        index: StoreIndex,
        key: str,
        bounds: tuple[int, int],
        discard: Discard,
        *,
        write: bool,
        dtype: torch.dtype | None = None,
        in_place: bool = False,
    ) -> None:
        self._index, self._key, self._bounds, self._discard = index, key, bounds, discard
        self._write, self._dtype, self._in_place = write, dtype, in_place
        self.span = range(0)
        self._entry: Entry | None = None
        self._doomed: list[Path] = []

    @property
    def entry(self) -> Entry:
        if self._entry is None:
            raise RuntimeError("the region claim was not taken")
        return self._entry

    def _chunks(self, span: range) -> list[Chunk]:
        return [(self._key, i) for i in span]

    def _span(self, entry: Entry) -> range:
        return check_region(entry.meta, *self._bounds, self._dtype)

    def busy(self) -> bool:
        chunks = self._chunks(self._span(self._index.lookup(self._key)))
        in_place_write = self._write and self._in_place
        return self._index.chunks_busy(self._key, chunks, in_place_write=in_place_write)

    def take(self) -> None:
        entry = self._index.lookup(self._key)
        span = self._span(entry)
        if self._write:
            self._index.add_region_write(self._key, self._chunks(span))
        else:
            self._index.add_read(entry, self._chunks(span))
        self._entry, self.span = entry, span

    def give_back(self) -> None:
        chunks = self._chunks(self.span)
        if self._write:
            self._doomed = self._index.drop_region_write(self.entry, chunks)
        else:
            self._doomed = self._index.drop_read(self.entry, chunks)

    def settle(self) -> None:
        self._discard(self._doomed)


class RegionIO:
    """Region reads and writes of one store, ordered by its gate.

    Parameters
    ----------
    gate, index:
        The store's gate and the index it guards.
    chunks:
        The store's data path (its engine runs the chunk reads and writes).
    targets:
        Where new chunk files go and what becomes of superseded ones.
    durable:
        Whether a write stages new files (``True``) or overwrites chunks in place.

    Thread safety: every method may be called from any thread (see :class:`Gate`).
    """

    def __init__(
        self,
        gate: Gate,
        index: StoreIndex,
        chunks: ChunkFiles,
        targets: ChunkTargets,
        *,
        durable: bool,
    ) -> None:
        self._gate, self._index, self._chunks, self._targets = gate, index, chunks, targets
        self._durable = durable

    def read(
        self, key: str, start: int, stop: int, out: torch.Tensor | None
    ) -> Future[torch.Tensor]:
        """Start reading elements ``[start, stop)`` of ``key`` into ``out`` (or a new tensor)."""
        claim = RegionClaim(self._index, key, (start, stop), self._targets.discard, write=False)
        with self._gate.shared(claim) as section:
            entry, chunks = claim.entry, self._chunks
            out = prepare_out(entry.meta, out, region=stop - start)
            refs = [entry.ref(i) for i in claim.span]
            reads = gather(
                [
                    chunks.submit(ref.folder, chunks.read_region, entry.meta, ref, start, out)
                    for ref in refs
                ]
            )
            return section.finish_with(reads, out)

    def write(self, key: str, start: int, tensor: torch.Tensor) -> Future[None]:
        """Start overwriting elements ``[start, start + tensor.numel())`` of ``key``."""
        source = as_cpu_contiguous(tensor)
        source = source if source.dim() == 1 else source.reshape(-1)  # (an op: lets the GIL go)
        stop = start + source.numel() if isinstance(start, int) else start
        claim = RegionClaim(
            self._index,
            key,
            (start, stop),
            self._targets.discard,
            write=True,
            dtype=source.dtype,
            in_place=not self._durable,
        )
        with self._gate.shared(claim) as section:
            entry, span = claim.entry, claim.span
            news: list[Path] = []
            try:
                done = self._submit_write(entry, span, start, source, news)
            except BaseException:
                if self._durable:
                    unlink_all(news)
                raise
            return section.finish(done, lambda finished: self._install(entry, span, news, finished))

    def _submit_write(
        self, entry: Entry, span: range, start: int, source: torch.Tensor, news: list[Path]
    ) -> Future[list[int]]:
        """Start the chunk writes (appending each new file to ``news``); a future of CRCs."""
        batch, chunks, futures = self._targets.batch(), self._chunks, []
        for i in span:
            new, recycled = (
                self._targets.write_target(entry.meta, batch, i)
                if self._durable
                else (entry.files[i], True)  # scratch: in place
            )
            news.append(new)
            ref = entry.ref(i)
            futures.append(
                chunks.submit(
                    ref.folder, chunks.write_region, entry.meta, ref, (new, recycled), start, source
                )
            )
        return gather(futures)

    def _install(
        self, entry: Entry, span: range, news: list[Path], done: Future[list[int]]
    ) -> None:
        """Record a finished region write in the index, or undo a failed one and raise."""
        error = done.exception()
        if error is not None:
            if self._durable:
                unlink_all(news)
            raise error
        written = list(zip(span, news, done.result(), strict=True))
        with self._gate.locked():
            self._index.install_region(entry, written, staged=self._durable)
