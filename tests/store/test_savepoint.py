"""SwapStore savepoints: region writes keep the versions they replace until released."""

from __future__ import annotations

import pytest
import torch

import tierswap as ts
from tierswap.errors import ConfigError, SavepointError

CHUNK = 4096  # bytes: 1024 fp32 elements per chunk


@pytest.fixture
def store(tmp_path):
    with ts.SwapStore(tmp_path / "s", chunk_bytes=CHUNK) as s:
        s.put("a", torch.arange(4096, dtype=torch.float32))
        s.put("b", torch.zeros(10))
        s.commit()
        yield s


def test_rollback_returns_chunks_to_the_savepoint(store):
    before = store.get("a")
    store.put_region("a", 0, torch.full((2048,), 7.0))  # staged before the savepoint
    staged = store.get("a")
    store.savepoint()
    store.put_region("a", 0, torch.full((3072,), 9.0))
    store.put_region("a", 0, torch.full((1024,), 5.0))  # a chunk rewritten twice
    store.rollback("a", 0, 2048)  # chunks 0 and 1: back to the staged 7s
    now = store.get("a")
    assert torch.equal(now[:2048], staged[:2048])
    assert torch.equal(now[2048:3072], torch.full((1024,), 9.0))  # not rolled back
    store.rollback("a", 2048, 3072)  # chunk 2: back to its committed version
    assert torch.equal(store.get("a"), staged)
    store.release_savepoint()
    store.commit()
    assert torch.equal(store.get("a"), staged)
    assert not torch.equal(staged, before)


def test_rollback_covers_whole_chunks(store):
    store.savepoint()
    store.put_region("a", 1000, torch.full((100,), 3.0))  # spans chunks 0 and 1
    store.rollback("a", 1010, 1011)  # chunk 0 only
    now = store.get("a")
    assert torch.equal(now[:1024], torch.arange(1024, dtype=torch.float32))
    assert torch.equal(now[1024:1100], torch.full((76,), 3.0))


def test_release_keeps_the_writes_and_reclaims_the_versions(store):
    store.savepoint()
    store.put_region("a", 0, torch.ones(4096))
    store.release_savepoint()
    with pytest.raises(SavepointError, match="no savepoint"):
        store.rollback("a")
    assert torch.equal(store.get("a"), torch.ones(4096))
    store.savepoint()
    store.put_region("a", 0, torch.full((4096,), 2.0))
    store.commit()  # a commit ends the savepoint
    with pytest.raises(SavepointError):
        store.rollback("a")
    assert torch.equal(store.get("a"), torch.full((4096,), 2.0))


def test_the_versions_survive_recycling_and_reopen_clean(tmp_path, store):
    store.savepoint()
    for value in range(4):  # each rewrite stages a new file; the saved one is never reused
        store.put_region("a", 0, torch.full((4096,), float(value)))
    store.rollback("a")
    assert torch.equal(store.get("a"), torch.arange(4096, dtype=torch.float32))
    store.put_region("a", 0, torch.full((4096,), 8.0))
    store.close()  # uncommitted: the folder keeps its last commit
    with ts.SwapStore(tmp_path / "s", chunk_bytes=CHUNK) as again:
        assert torch.equal(again.get("a"), torch.arange(4096, dtype=torch.float32))
        assert again.verify() == []


def test_a_key_put_or_deleted_since_cannot_roll_back(store):
    store.savepoint()
    store.put("b", torch.ones(10))
    with pytest.raises(SavepointError, match="put or deleted"):
        store.rollback("b")
    store.delete("b")
    with pytest.raises(SavepointError, match="put or deleted"):
        store.rollback("b")
    store.put_region("a", 0, torch.ones(10))
    store.rollback("a")  # other keys still can
    assert torch.equal(store.get("a"), torch.arange(4096, dtype=torch.float32))


def test_a_scratch_store_has_no_savepoint(tmp_path):
    with ts.SwapStore(tmp_path / "s", durable=False) as s, pytest.raises(ConfigError):
        s.savepoint()
