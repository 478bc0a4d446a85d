"""SwapStore's error paths: a failure anywhere leaves the store as it was, or clearly damaged."""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch

import tierswap as ts
from tests.store.faults import finishes, inject
from tierswap.cli import main
from tierswap.errors import CorruptionError, StoreClosedError
from tierswap.store import _journal as journal


def _failing_second_rename(real_roll_forward):
    """A roll_forward whose second rename fails with EIO (the first one happens)."""

    def roll_forward(root, internal, plan, sync_dirs):
        real_replace, count = os.replace, [0]

        def replace(src, dst):
            count[0] += 1
            if count[0] == 2:
                raise OSError(errno.EIO, "Input/output error", str(dst))
            real_replace(src, dst)

        os.replace = replace
        try:
            real_roll_forward(root, internal, plan, sync_dirs)
        finally:
            os.replace = real_replace

    return roll_forward


# ---------------------------------------------------------------- item 1
def test_close_after_a_failed_roll_forward_keeps_the_new_commit(
    store_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ts.SwapStore(store_path, chunk_bytes="4KiB")
    store.put("a", torch.ones(3000))
    store.put("gone", torch.zeros(5))
    store.commit({"n": 1})
    new = {"a": torch.arange(3000.0), "b": torch.full((2000,), 7.0)}
    store.delete("gone")
    for key, value in new.items():
        store.put(key, value)
    monkeypatch.setattr(journal, "roll_forward", _failing_second_rename(journal.roll_forward))
    with pytest.raises(OSError, match="Input/output"):
        store.commit({"n": 2})
    monkeypatch.undo()
    with pytest.raises(StoreClosedError, match="reopen"):
        store.get("a")  # the store object no longer knows where its files are
    store.close()  # an ordinary close, not an abandon
    with ts.SwapStore(store_path) as store:
        assert store.verify() == []
        assert store.generation == 2
        assert store.meta == {"n": 2}
        assert store.keys() == sorted(new)
        for key, value in new.items():
            assert torch.equal(store.get(key), value)


# ---------------------------------------------------------------- item 2
def _staging_is_empty(store_path: Path) -> bool:
    staging = store_path / ".tierswap" / "staging"
    return not staging.exists() or not any(staging.iterdir())


@pytest.mark.parametrize("durable", [True, False])
def test_a_put_whose_submit_fails_leaves_the_store_as_it_was(
    store_path: Path, durable: bool
) -> None:
    with ts.SwapStore(store_path, chunk_bytes="4KiB", durable=durable) as store:
        store.put("x", torch.ones(3000))  # three chunks
        store.commit()
        inject(
            store,
            fail={"submit": {2, 4}},
            error=lambda: RuntimeError("cannot schedule new futures after shutdown"),
        )
        with pytest.raises(RuntimeError, match="cannot schedule"):
            store.put("x", torch.zeros(3000))
        with pytest.raises(RuntimeError, match="cannot schedule"):
            store.put("new", torch.zeros(3000))
        assert torch.equal(finishes(lambda: store.get("x")), torch.ones(3000))
        assert "new" not in store
        assert store.keys() == ["x"]
        assert finishes(store.commit) == 2
        store.put("x", torch.full((3000,), 2.0))  # the key is not stuck
        assert torch.equal(store.get("x"), torch.full((3000,), 2.0))
        assert finishes(store.commit) == 3
    assert _staging_is_empty(store_path)
    with ts.SwapStore(store_path) as store:
        assert torch.equal(store.get("x"), torch.full((3000,), 2.0))
        assert store.verify() == []


def test_a_put_whose_staging_folder_cannot_be_made_fails_cleanly(store_path: Path) -> None:
    with ts.SwapStore(store_path, chunk_bytes="4KiB") as store:
        store.put("x", torch.ones(10))
        store.commit()
        staging = store_path / ".tierswap" / "staging"
        staging.rmdir() if staging.exists() else None
        staging.write_bytes(b"")  # a file where the folder should be: mkdir fails
        try:
            with pytest.raises(OSError, match=r"exists|directory"):
                store.put("x", torch.zeros(10))
        finally:
            staging.unlink()
        assert torch.equal(finishes(lambda: store.get("x")), torch.ones(10))
        assert finishes(store.commit) == 2


# ---------------------------------------------------------------- item 3
def _io_threads() -> int:
    return sum(t.name.startswith("tierswap-io") for t in threading.enumerate())


@pytest.mark.parametrize("damage", ["newer format", "unreadable"])
def test_a_failed_open_releases_the_lock_and_the_threads(store_path: Path, damage: str) -> None:
    with ts.SwapStore(store_path) as store:
        store.put("x", torch.ones(10))
        store.commit()
    root = store_path / "zarr.json"
    good = root.read_bytes()
    if damage == "newer format":
        doc = json.loads(good)
        doc["attributes"]["tierswap"]["format"] = 99
        root.write_text(json.dumps(doc))
    else:
        root.write_bytes(b"{not json")
    threads = _io_threads()
    for _ in range(2):  # the second failed open must fail the same way, not as locked
        with pytest.raises(CorruptionError):
            ts.SwapStore(store_path)
    assert _io_threads() == threads
    root.write_bytes(good)
    with ts.SwapStore(store_path) as store:  # same process: no StoreLockedError
        assert torch.equal(store.get("x"), torch.ones(10))


# ---------------------------------------------------------------- item 4
def _damage_doc(store_path: Path, key: str, how: str) -> None:
    path = store_path / key / "zarr.json"
    doc = json.loads(path.read_text())
    attrs = doc["attributes"]["tierswap"]
    if how == "no shape":
        del doc["shape"]
    elif how == "chunk_bytes 0":
        attrs["chunk_bytes"] = 0
    elif how == "negative shape":
        attrs["shape"] = [-4, 3]
    elif how == "attributes not a dict":
        doc["attributes"] = [1, 2]
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize(
    "how", ["no shape", "chunk_bytes 0", "negative shape", "attributes not a dict"]
)
def test_bad_array_metadata_is_that_keys_damage(
    store_path: Path, how: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with ts.SwapStore(store_path) as store:
        store.put("bad", torch.ones(12))
        store.put("good", torch.arange(5))
        store.commit()
    _damage_doc(store_path, "bad", how)
    assert main(["verify", str(store_path)]) == 1
    assert "'bad'" in capsys.readouterr().out
    for mode in ("r", "a"):
        with ts.SwapStore(store_path, mode=mode) as store:
            assert store.keys() == ["bad", "good"]
            assert torch.equal(store.get("good"), torch.arange(5))
            with pytest.raises(CorruptionError, match="'bad'"):
                store.get("bad")
            assert [p for p in store.verify() if "'bad'" in p]
    with ts.SwapStore(store_path) as store:  # and it can be repaired by deleting it
        store.delete("bad")
        store.commit()
        assert store.verify() == []


# ---------------------------------------------------------------- item 5
def test_scratch_install_failing_midway_reports_the_key_damaged(
    store_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with ts.SwapStore(store_path, chunk_bytes="4KiB", durable=False) as store:
        store.put("x", torch.ones(3000))
        store.put("y", torch.ones(10))
        store.commit()
        real, count = os.replace, [0]

        def replace(src, dst):
            count[0] += 1
            if count[0] == 2:
                raise OSError(errno.EIO, "Input/output error", str(dst))
            real(src, dst)

        monkeypatch.setattr(os, "replace", replace)
        with pytest.raises(OSError, match="Input/output"):
            store.put("x", torch.zeros(3000))
        monkeypatch.undo()
        with pytest.raises(CorruptionError, match="failed midway"):
            store.get("x")  # not a checksum mismatch of new bytes under old checksums
        assert any("failed midway" in p for p in store.verify())
        assert "x" in store
        assert store.keys() == ["x", "y"]
        store.put("x", torch.full((3000,), 3.0))  # putting it again repairs it
        assert torch.equal(store.get("x"), torch.full((3000,), 3.0))
        assert store.verify() == []
    with ts.SwapStore(store_path) as store:
        assert torch.equal(store.get("x"), torch.full((3000,), 3.0))
        assert store.verify() == []


def test_scratch_get_during_a_put_of_the_same_key_reads_a_whole_version(
    store_path: Path,
) -> None:
    with ts.SwapStore(store_path, chunk_bytes="4KiB", durable=False) as store:
        store.put("x", torch.ones(3000))
        store.commit()
        release = threading.Event()
        faulty = inject(store, gate={"read_file": release})
        got: dict[str, object] = {}

        def read() -> None:
            try:
                got["value"] = store.get("x")
            except Exception as exc:
                got["value"] = exc

        reader = threading.Thread(target=read)
        reader.start()
        assert faulty.entered["read_file"].wait(5)  # the get's reads are in flight
        writer = threading.Thread(target=store.put, args=("x", torch.zeros(3000)))
        writer.start()
        time.sleep(0.3)  # give the put the time to replace the chunk files, if it may
        release.set()
        reader.join(10)
        writer.join(10)
        assert not reader.is_alive()
        assert not writer.is_alive()
        assert isinstance(got["value"], torch.Tensor), got["value"]
        assert torch.equal(got["value"], torch.ones(3000))
        assert torch.equal(store.get("x"), torch.zeros(3000))


# ---------------------------------------------------------------- put_many (for item 8)
@pytest.mark.parametrize("durable", [True, False])
def test_put_many_is_all_or_none(store_path: Path, durable: bool) -> None:
    with ts.SwapStore(store_path, chunk_bytes="4KiB", durable=durable) as store:
        store.put("a", torch.ones(3000))
        store.put("b", torch.ones(10))
        store.commit()
        new = {"a": torch.zeros(3000), "b": torch.zeros(20), "c": torch.zeros(5)}
        inject(store, fail={"write_file": {4}})
        with pytest.raises(OSError, match="Input/output"):
            store.put_many(new)
        assert store.keys() == ["a", "b"]
        assert torch.equal(store.get("a"), torch.ones(3000))
        assert torch.equal(store.get("b"), torch.ones(10))
        store.put_many(new)  # the fifth and later writes succeed
        for key, value in new.items():
            assert torch.equal(store.get(key), value)
        store.commit()
        assert store.verify() == []
    assert _staging_is_empty(store_path)
