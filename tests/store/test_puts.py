"""Whole-tensor writes: files written first, the key changed only once all of them are."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tierswap as ts
from tests.store.faults import inject


@pytest.mark.parametrize("durable", [True, False])
def test_a_written_put_carries_its_checksums_and_installs_its_files(
    store_path: Path, durable: bool
) -> None:
    with ts.SwapStore(store_path, chunk_bytes="4KiB", durable=durable) as store:
        store.put("x", torch.ones(3000))
        meta = store._index.lookup("x").meta
        written = store._puts.submit(meta, torch.full((3000,), 2.0))
        new_meta, paths = written.result()
        assert len(new_meta.crcs) == meta.nchunks == len(paths) == 3
        assert all(p.exists() for p in paths)
        assert torch.equal(store.get("x"), torch.ones(3000))  # not installed yet
        store._puts.install_written(written)
        assert torch.equal(store.get("x"), torch.full((3000,), 2.0))
        assert store.verify() == []


def test_a_failed_write_deletes_every_file_it_wrote(store_path: Path) -> None:
    with ts.SwapStore(store_path, chunk_bytes="4KiB") as store:
        store.put("x", torch.ones(3000))
        meta = store._index.lookup("x").meta
        inject(store, fail={"write_file": {2}})
        before = sorted(p for p in store_path.rglob("*") if p.is_file())
        written = store._puts.submit(meta, torch.zeros(3000))
        with pytest.raises(OSError, match="Input/output"):
            written.result()
        assert sorted(p for p in store_path.rglob("*") if p.is_file()) == before
        assert torch.equal(store.get("x"), torch.ones(3000))
