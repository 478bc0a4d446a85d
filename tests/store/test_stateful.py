"""Hypothesis state machine: the store against a dict model of committed and current state."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import hypothesis.strategies as st
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import tierswap as ts

KEYS = ["a", "b/c", "b/d", "e/f/g", "h"]
DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8]


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    numel = draw(st.sampled_from([0, 1, 7, 1024, 1025, 3000]))
    seed = draw(st.integers(0, 2**16))
    raw = torch.randint(
        0,
        256,
        (numel * dtype.itemsize,),
        dtype=torch.uint8,
        generator=torch.Generator().manual_seed(seed),
    )
    value = (raw % 2).bool() if dtype == torch.bool else raw.view(dtype)
    return value.reshape(draw(st.sampled_from([(numel,), (1, numel)])))


def _bits(value: torch.Tensor) -> bytes:
    return value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="tierswap-stateful-"))
        self.durable = True
        self.store = self._open()
        self.committed: dict[str, torch.Tensor] = {}
        self.current: dict[str, torch.Tensor] = {}

    def _open(self) -> ts.SwapStore:
        return ts.SwapStore(self.dir / "s", chunk_bytes="4KiB", io=ts.IOConfig(block_bytes=4096))

    @rule(key=st.sampled_from(KEYS), value=tensors())
    def put(self, key: str, value: torch.Tensor) -> None:
        self.store.put(key, value)
        self.current[key] = value.clone()

    @precondition(lambda self: self.current)
    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.current)))
        self.store.delete(key)
        del self.current[key]

    @rule()
    def commit(self) -> None:
        self.store.commit()
        self.committed = dict(self.current)

    @rule()
    def reopen(self) -> None:
        self.store.close()
        self.store = self._open()
        self.current = dict(self.committed)

    @rule()
    def crash_and_reopen(self) -> None:
        """Abandon the store as a killed process would, then reopen it."""
        self.store._engine.close()
        self.store._folder.unlock()
        self.store._closed = True
        self.store = self._open()
        self.current = dict(self.committed)

    @invariant()
    def matches_model(self) -> None:
        assert self.store.keys() == sorted(self.current)
        for key, value in self.current.items():
            got = self.store.get(key)
            assert got.dtype == value.dtype
            assert got.shape == value.shape
            assert _bits(got) == _bits(value), key  # bitwise: random bytes include NaNs

    @invariant()
    def spare_room_counts_the_arrays(self) -> None:
        """The spare pool's room, kept up to date key by key, is what a walk over the
        current and committed arrays gives."""
        index = self.store._index

        def chunk_bytes(arrays) -> int:
            return sum(meta.nchunks * meta.chunk_bytes for meta in arrays.values())

        walked = max(chunk_bytes(index.current()), chunk_bytes(index.committed))
        assert index.spare_room() == [walked]

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)


StoreMachine.TestCase.settings = settings(
    max_examples=25,
    stateful_step_count=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestStoreMachine = StoreMachine.TestCase
