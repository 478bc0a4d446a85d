"""Fixtures for the cache tests: a store, and wrappers that log or gate its I/O."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tierswap.errors import KeyNotFoundError, StoreClosedError

try:
    from tierswap.store import SwapStore
except ImportError:  # pragma: no cover - until the store lands on main
    SwapStore = None


class LoggingStore:
    """Wraps a store; logs each read (``get``/``get_async``) and write, and can gate reads.

    ``gate`` (a threading.Event) when set to a cleared event makes every read wait for it
    inside the I/O pool, so tests can hold a read in flight.
    """

    def __init__(self, store: Any) -> None:
        self._store = store
        self.log: list[tuple[str, str]] = []  # ("read" | "write", key) in the order started
        self.gate: threading.Event | None = None
        self.on_io: Any = None  # called (kind, key) at the start of every read and write
        self._lock = threading.Lock()

    def _note(self, kind: str, key: str) -> None:
        with self._lock:
            self.log.append((kind, key))
        if self.on_io is not None:
            self.on_io(kind, key)

    def get_async(self, key: str, out: torch.Tensor | None = None) -> Any:
        self._note("read", key)
        gate = self.gate
        if gate is None:
            return self._store.get_async(key, out=out)
        return self._store.executor.submit(self._gated_get, gate, key, out)

    def _gated_get(self, gate: threading.Event, key: str, out: torch.Tensor | None) -> Any:
        gate.wait(timeout=60)
        return self._store.get(key, out=out)

    def get(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
        self._note("read", key)
        return self._store.get(key, out=out)

    def put_async(self, key: str, tensor: torch.Tensor) -> Any:
        self._note("write", key)
        return self._store.put_async(key, tensor)

    def put(self, key: str, tensor: torch.Tensor) -> None:
        self._note("write", key)
        self._store.put(key, tensor)

    def reads(self) -> list[str]:
        with self._lock:
            return [k for kind, k in self.log if kind == "read"]

    def __contains__(self, key: object) -> bool:
        return key in self._store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


class FakeStore:
    """An in-memory store that follows the SwapStore contract (temporary stand-in)."""

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.executor = ThreadPoolExecutor(4, thread_name_prefix="fake-io")
        self._data: dict[str, torch.Tensor] = {}
        self._inflight: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._stats = {"bytes_read": 0, "bytes_written": 0, "reads": 0, "writes": 0}

    def put(self, key: str, tensor: torch.Tensor) -> None:
        self.put_async(key, tensor).result()

    def put_async(self, key: str, tensor: torch.Tensor) -> Any:
        with self._lock:
            prev = self._inflight.get(key)
            fut = self.executor.submit(self._do_put, prev, key, tensor)
            self._inflight[key] = fut
        return fut

    def _do_put(self, prev: Any, key: str, tensor: torch.Tensor) -> None:
        if prev is not None:
            prev.result()
        copy = tensor.detach().to("cpu", copy=True).contiguous()
        with self._lock:
            self._data[key] = copy
            self._stats["bytes_written"] += copy.numel() * copy.element_size()
            self._stats["writes"] += 1

    def get(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
        with self._lock:
            prev = self._inflight.get(key)
        if prev is not None:
            prev.result()
        with self._lock:
            if self._closed:
                raise StoreClosedError("closed")
            if key not in self._data:
                raise KeyNotFoundError(f"no key {key!r}")
            value = self._data[key]
            self._stats["bytes_read"] += value.numel() * value.element_size()
            self._stats["reads"] += 1
        if out is None:
            return value.clone()
        out.copy_(value)
        return out

    def get_async(self, key: str, out: torch.Tensor | None = None) -> Any:
        return self.executor.submit(self.get, key, out)

    def delete(self, key: str) -> None:
        with self._lock:
            if key not in self._data:
                raise KeyNotFoundError(f"no key {key!r}")
            del self._data[key]

    def info(self, key: str) -> Any:
        from types import SimpleNamespace

        with self._lock:
            if key not in self._data:
                raise KeyNotFoundError(f"no key {key!r}")
            v = self._data[key]
        return SimpleNamespace(
            key=key, dtype=v.dtype, shape=tuple(v.shape), nbytes=v.numel() * v.element_size()
        )

    def keys(self) -> list[str]:
        with self._lock:
            return sorted(self._data)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def commit(self, meta: dict | None = None) -> int:
        return 0

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._stats)

    def close(self) -> None:
        self._closed = True
        self.executor.shutdown(wait=True)


@pytest.fixture
def store(tmp_path: Any) -> Iterator[Any]:
    """A fresh store in a temporary folder (scratch mode, small chunks)."""
    if SwapStore is None:
        s = FakeStore()
        yield s
        s.close()
        return
    with SwapStore(tmp_path / "swap", mode="w", durable=False, chunk_bytes="64KiB") as s:
        yield s


@pytest.fixture
def logged(store: Any) -> LoggingStore:
    return LoggingStore(store)
