"""Fixtures for the cache tests: a store, and wrappers that log or gate its I/O."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest
import torch

from tierswap.store import SwapStore


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
        result: Future[torch.Tensor] = Future()

        def gated() -> None:
            gate.wait(timeout=60)
            try:
                result.set_result(self._store.get(key, out=out))
            except BaseException as exc:
                result.set_exception(exc)

        threading.Thread(target=gated, daemon=True).start()
        return result

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


@pytest.fixture
def store(tmp_path: Any) -> Iterator[Any]:
    """A fresh store in a temporary folder (scratch mode, small chunks)."""
    with SwapStore(tmp_path / "swap", mode="w", durable=False, chunk_bytes="64KiB") as s:
        yield s


@pytest.fixture
def logged(store: Any) -> LoggingStore:
    return LoggingStore(store)
