"""The optimizer's view of the swap space: a SwapStore and the pipeline that streams it.

Everything the optimizer keeps outside the model goes through here. Keys are
``p<i>/<state name>`` for per-element state, ``p<i>/master`` for master weights and
``p<i>/param`` for the committed copy of parameters that have no master. Small values (step
counters, scalars, hyper-parameters) travel as one pickled blob under :data:`SMALL_KEY`.
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tierswap._lifetime import close_at_exit
from tierswap.engine import Transfers
from tierswap.optim.distributed import rank_swap_dir
from tierswap.pipeline import Ended, Pipeline, Region
from tierswap.store import check_apart, replace_with_snapshot

if TYPE_CHECKING:
    from tierswap.store import StorePaths, SwapStore

__all__ = ["SMALL_KEY", "StateBackend", "resolve_swap_dir"]

SMALL_KEY = "optim/small"
META_KEY = "tierswap.optim"


def resolve_swap_dir(swap_dir: StorePaths | None) -> tuple[list[Path], bool]:
    """The folders to use (one, or one per drive, the home first) and whether the folder is a
    temporary one to remove at close.

    Under an initialised ``torch.distributed`` process group each rank gets ``rank-<r>`` (in
    each folder of a list).
    """
    if swap_dir is None:
        return [Path(tempfile.mkdtemp(prefix="tierswap-optim-"))], True
    if isinstance(swap_dir, (str, os.PathLike)):
        return [rank_swap_dir(swap_dir)], False
    return rank_swap_dir(swap_dir), False


def _open_store(folders: list[Path], *, durable: bool, resume: bool, chunk_bytes: int) -> SwapStore:
    """Open the swap folders' store."""
    from tierswap.store import SwapStore

    return SwapStore(folders, mode="a" if resume else "w", durable=durable, chunk_bytes=chunk_bytes)


class StateBackend:
    """The optimizer's tensors in one swap folder, streamed through a :class:`Pipeline`.

    Parameters
    ----------
    swap_dir:
        Folder of the store, or a list of folders (one per drive); ``None`` makes a temporary
        one, removed by :meth:`close`.
    budget:
        Host bytes of the pipeline (resident slices and slices in flight).
    chunk_bytes:
        Chunk size of new arrays: slices split parameters at multiples of it.
    device_budget, device:
        Bytes of the device tier (slices resident there) and where its tensors live.
    transfers, work_on_device:
        How slices move between host and device, and whether they step there
        (see :class:`~tierswap.pipeline.Pipeline`).
    """

    def __init__(
        self,
        swap_dir: StorePaths | None,
        *,
        budget: int,
        durable: bool,
        resume: bool,
        chunk_bytes: int,
        device_budget: int = 0,
        device: torch.device | None = None,
        transfers: Transfers | None = None,
        work_on_device: bool = False,
    ) -> None:
        self.folders, temporary = resolve_swap_dir(swap_dir)
        self.path = self.folders[0]  # the home
        self._cleanup = (
            weakref.finalize(self, shutil.rmtree, str(self.path), True) if temporary else None
        )
        self._durable, self._chunk_bytes = durable, chunk_bytes
        self._pipeline_settings = (budget, device_budget, device, transfers, work_on_device)
        self.closed = False
        try:
            self._open(resume)
        except BaseException:
            if self._cleanup is not None:
                self._cleanup()
            raise
        close_at_exit(self)

    def _open(self, resume: bool) -> None:
        """Open the store on the folders and a pipeline on it."""
        self.store = _open_store(
            self.folders, durable=self._durable, resume=resume, chunk_bytes=self._chunk_bytes
        )
        budget, device_budget, device, transfers, work_on_device = self._pipeline_settings
        self.pipeline = Pipeline(
            self.store,
            budget,
            device_budget=device_budget,
            device=device,
            transfers=transfers,
            work_on_device=work_on_device,
        )
        self.known: set[str] = set(self.store.keys()) if resume else set()

    def reopen_from(self, source: Path, chunk_bytes: int) -> None:
        """Replace the folders' contents by the snapshot at ``source`` (hard links where the
        filesystem allows) and reopen on it, as a resume would; new arrays get chunks of
        ``chunk_bytes``. A temporary folder stays this backend's, removed at :meth:`close`.

        Checks that ``source`` lies apart from the folders before anything changes. When the
        replacement fails the backend is closed (the folders keep what the failure left: the
        old commit, or the snapshot's).
        """
        for folder in self.folders:
            check_apart(source, folder)
        try:
            self.pipeline.release()
            self.pipeline.drain()
        finally:
            self.store.close()
        self._chunk_bytes = chunk_bytes
        try:
            replace_with_snapshot(source, self.folders)
            self._open(resume=True)
        except BaseException:
            self.closed = True
            if self._cleanup is not None:
                self._cleanup()
            raise

    # -- tensors --------------------------------------------------------------------------
    def create(
        self,
        key: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        chunk_bytes: int | None = None,
    ) -> None:
        """A stored array of zeros (sparse: no data written) for state made by a first step;
        ``chunk_bytes``: its own chunk size (``None``: the store's)."""
        self.pipeline.settle()  # not in a commit behind the caller
        self.store.create(key, shape, dtype, chunk_bytes=chunk_bytes)
        self.known.add(key)

    def put_many(
        self, tensors: dict[str, torch.Tensor], chunk_bytes: dict[str, int] | None = None
    ) -> None:
        """Add or replace several keys whole, all or none (a failed write changes none);
        ``chunk_bytes``: the chunk size of the keys that do not take the store's."""
        self.pipeline.evict()
        self.store.put_many(tensors, chunk_bytes=chunk_bytes)
        self.known.update(tensors)

    def put_regions_async(self, writes: dict[Region, torch.Tensor]) -> Future[Any]:
        """Start writing regions through the pipeline's disk (ordered with its reads and
        write-behinds); the tensors must not change until the future is done."""
        return self.pipeline.write(writes)

    # -- speculation: a savepoint of the store -------------------------------------------
    def savepoint(self) -> None:
        """Keep the stored state as it is once the writes in flight reach the store, so that
        :meth:`roll_back` can return regions to it (:meth:`tierswap.SwapStore.savepoint`)."""
        self.pipeline.drain()
        self.store.savepoint()

    def roll_back(self, regions: Iterable[Region]) -> None:
        """Return ``regions`` (whole chunks) to the savepoint, after the writes in flight;
        reads started ahead go (they may hold the bytes rolled back)."""
        self.pipeline.drain()
        self.pipeline.release()
        for region in regions:
            self.store.rollback(region.key, region.start, region.stop)

    def release_savepoint(self) -> None:
        """Forget the savepoint (its versions become spare files)."""
        self.store.release_savepoint()

    def read(self, key: str) -> torch.Tensor:
        """A CPU copy of ``key``'s stored value (call ``pipeline.flush()`` first)."""
        return self.store.get(key)

    def read_region(self, region: Region) -> torch.Tensor:
        """A CPU copy of a region's stored value (call ``pipeline.flush()`` first)."""
        return self.store.get_region(region.key, region.start, region.stop)

    def delete(self, key: str) -> None:
        if key in self.known:
            self.pipeline.evict()
            self.store.delete(key)
            self.known.discard(key)

    # -- persistence ----------------------------------------------------------------------
    def commit(self, small: dict[str, Any], meta: dict[str, Any]) -> int:
        """Flush resident slices, write ``small``, commit atomically."""
        self.pipeline.flush()
        return self._record(_serialized(small), meta)

    def commit_behind(self, small: dict[str, Any], meta: dict[str, Any], ended: Ended) -> None:
        """:meth:`commit`, returning once the resident slices' writes have started: the
        pipeline ends it behind the caller (:meth:`~tierswap.pipeline.Pipeline.flush_behind`,
        which calls ``ended``), and its next call (any method of this backend that reaches the
        store) waits for it, and raises its failure."""
        blob = _serialized(small)
        self.pipeline.flush_behind(lambda: self._record(blob, meta), ended)

    def _record(self, small: torch.Tensor, meta: dict[str, Any]) -> int:
        """Put the serialized ``small`` and commit the store with ``meta``."""
        self.store.put(SMALL_KEY, small)
        return self.store.commit({META_KEY: meta})

    def committed_meta(self) -> dict[str, Any] | None:
        """The optimizer's metadata of the last commit, or ``None`` for a fresh folder."""
        self.pipeline.settle()  # a commit behind the caller holds the newest
        meta = self.store.meta or {}
        committed: dict[str, Any] | None = meta.get(META_KEY)
        return committed

    def load_small(self) -> dict[str, Any]:
        blob = self.store.get(SMALL_KEY)
        small: dict[str, Any] = torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=True)
        return small

    def stats(self) -> dict[str, Any]:
        """What each tier holds and served: the device and host tiers' ledgers (used, budget,
        hits, misses, bytes in and out), the store's disk traffic, the seconds spent waiting
        for reads."""
        return self.pipeline.stats().as_dict()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            try:
                self.pipeline.settle()  # a commit behind the caller ends first
            finally:
                self.pipeline.release()
                self.pipeline.drain()
        finally:
            self.store.close()
            if self._cleanup is not None:
                self._cleanup()


def _serialized(small: dict[str, Any]) -> torch.Tensor:
    """``small`` as the bytes the store keeps under ``SMALL_KEY``."""
    buffer = io.BytesIO()
    torch.save(small, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
