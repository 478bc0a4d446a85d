"""The optimizer's view of the swap space: keyed tensors in a TierCache over a SwapStore.

Everything the optimizer keeps outside the model goes through here. Keys are
``p<i>/<state name>`` for per-element state, ``p<i>/master`` for master weights and
``p<i>/param`` for the committed copy of parameters that have no master. Small values (step
counters, scalars, hyper-parameters) travel as one pickled blob under :data:`SMALL_KEY`.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import tempfile
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from tierswap._lifetime import close_at_exit
from tierswap.optim.distributed import rank_swap_dir

__all__ = ["SMALL_KEY", "StateBackend", "resolve_swap_dir"]

SMALL_KEY = "optim/small"
META_KEY = "tierswap.optim"


def resolve_swap_dir(swap_dir: str | Path | None) -> tuple[Path, bool]:
    """The folder to use and whether it is a temporary one to remove at close.

    Under an initialised ``torch.distributed`` process group each rank gets ``rank-<r>``.
    """
    if swap_dir is None:
        return Path(tempfile.mkdtemp(prefix="tierswap-optim-")), True
    return rank_swap_dir(swap_dir), False


def _open_cache(
    path: Path, *, host_budget: int, device_budget: int, policy: Any, durable: bool, resume: bool
) -> tuple[Any, Any]:
    """Open the store and the cache over it (a seam the tests may replace)."""
    from tierswap.cache import TierCache
    from tierswap.store import SwapStore

    store = SwapStore(path, mode="a" if resume else "w", durable=durable)
    try:
        cache = TierCache(
            store, device_budget=device_budget, host_budget=host_budget, policy=policy
        )
    except BaseException:
        store.close()
        raise
    return store, cache


class StateBackend:
    """Keyed optimizer tensors over one swap folder.

    Parameters
    ----------
    swap_dir:
        Folder of the store; ``None`` makes a temporary one, removed by :meth:`close`.
    tier:
        ``"device"`` or ``"host"``: where tensors are fetched to be stepped.
    """

    def __init__(
        self,
        swap_dir: str | Path | None,
        *,
        tier: str,
        host_budget: int,
        device_budget: int,
        policy: Any,
        durable: bool,
        resume: bool,
    ) -> None:
        self.path, temporary = resolve_swap_dir(swap_dir)
        self.tier = tier
        self._cleanup = (
            weakref.finalize(self, shutil.rmtree, str(self.path), True) if temporary else None
        )
        try:
            self.store, self.cache = _open_cache(
                self.path,
                host_budget=host_budget,
                device_budget=device_budget,
                policy=policy,
                durable=durable,
                resume=resume,
            )
        except BaseException:
            if self._cleanup is not None:
                self._cleanup()
            raise
        self.known: set[str] = set(self.store.keys()) if resume else set()
        self._closed = False
        # Write-behind: evictions of stepped partitions run here while the next one steps.
        self._writer = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tierswap-writeback")
        self._evicting: list[Future[None]] = []
        close_at_exit(self)

    # -- tensors --------------------------------------------------------------------------
    @contextlib.contextmanager
    def hold(self, keys: Sequence[str]) -> Iterator[dict[str, torch.Tensor]]:
        """Pin ``keys`` at the step tier for the duration of the block; yields key -> tensor.

        The tensors may be updated in place; call :meth:`mark_dirty` for those that were.
        """
        with contextlib.ExitStack() as stack:
            yield {key: stack.enter_context(self.cache.pinned(key, self.tier)) for key in keys}

    def mark_dirty(self, key: str) -> None:
        self.cache.mark_dirty(key)

    def put(self, key: str, tensor: torch.Tensor) -> None:
        """Add or replace ``key`` (the cache copies ``tensor``)."""
        self.cache.put(key, tensor)
        self.known.add(key)

    def read(self, key: str) -> torch.Tensor:
        """A CPU copy of ``key``'s current value."""
        with self.cache.pinned(key, self.tier) as tensor:
            return tensor.detach().to("cpu", copy=True)

    def delete(self, key: str) -> None:
        if key in self.known:
            self.cache.delete(key)
            self.known.discard(key)

    def evict_behind(self, keys: Sequence[str]) -> None:
        """Start writing ``keys`` down and dropping them from memory; returns at once.

        Call :meth:`settle` before touching these keys again.
        """
        self._evicting += [self._writer.submit(self.cache.evict, key) for key in keys]

    def settle(self) -> None:
        """Wait for the evictions started by :meth:`evict_behind` (re-raising their errors)."""
        pending, self._evicting = self._evicting, []
        for future in pending:
            future.result()

    def prefetch(self, keys: Sequence[str]) -> None:
        keys = [k for k in keys if k in self.known]
        if keys:
            self.cache.prefetch(keys, tier=self.tier)

    # -- persistence ----------------------------------------------------------------------
    def commit(
        self, params: dict[str, torch.Tensor], small: dict[str, Any], meta: dict[str, Any]
    ) -> int:
        """Write ``params`` and ``small`` to the store, flush the cache, commit atomically."""
        self.settle()
        # All parameter writes in flight at once; the tensors are not modified until they end.
        writes = [self.store.put_async(key, tensor.detach()) for key, tensor in params.items()]
        for write in writes:
            write.result()
        buffer = io.BytesIO()
        torch.save(small, buffer)
        self.store.put(SMALL_KEY, torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8))
        self.cache.flush()
        return self.store.commit({META_KEY: meta})

    def committed_meta(self) -> dict[str, Any] | None:
        """The optimizer's metadata of the last commit, or ``None`` for a fresh folder."""
        meta = self.store.meta or {}
        return meta.get(META_KEY)

    def load_small(self) -> dict[str, Any]:
        blob = self.store.get(SMALL_KEY)
        return torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=True)

    def load_param(self, key: str, out: torch.Tensor) -> None:
        out.copy_(self.store.get(key))

    def stats(self) -> dict[str, Any]:
        stats = self.cache.stats()
        return stats.as_dict() if hasattr(stats, "as_dict") else dict(stats)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.settle()
            self._writer.shutdown()
            self.cache.close()
        finally:
            self.store.close()
            if self._cleanup is not None:
                self._cleanup()
