"""Commit planning and crash recovery at every step of a commit, deterministically."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import tierswap as ts
from tierswap.store import _journal as journal
from tierswap.store._layout import ArrayMeta
from tierswap.store._plan import plan_changes


def _meta(key: str, nbytes: int) -> ArrayMeta:
    return ArrayMeta(key, torch.uint8, (nbytes,), 4096, (0,) * (-(-nbytes // 4096)))


def test_plan_changes_groups_and_disjoint_unlinks() -> None:
    committed = {"a/b": _meta("a/b", 3 * 4096), "x": _meta("x", 10)}
    current = {"a": _meta("a", 4096), "x": _meta("x", 10)}
    plan, documents = plan_changes(
        committed, current, {"a": ["s/0"]}, generation=2, meta={}, durable=True
    )
    docs = {rel: json.loads(data) for rel, data in documents}
    assert docs["a/zarr.json"]["node_type"] == "array"
    assert docs["zarr.json"]["attributes"]["tierswap"]["generation"] == 2
    assert plan.generation == 2
    assert plan.moves == (("s/0", "a/c/0"),)
    # the old group's a/zarr.json is a rename target now, so it must not be unlinked
    assert "a/zarr.json" not in plan.unlinks
    assert {"a/b/c/0", "a/b/c/1", "a/b/c/2", "a/b/zarr.json"} <= set(plan.unlinks)
    assert plan.rmdirs[:2] == ("a/b/c", "a/b")
    assert plan.recycle == ()  # no spare names given: nothing is kept


def test_plan_shrinking_array_unlinks_extra_chunks() -> None:
    committed = {"k": _meta("k", 3 * 4096)}
    current = {"k": _meta("k", 4096)}
    plan, _docs = plan_changes(
        committed, current, {"k": ["s/0"]}, generation=1, meta={}, durable=True
    )
    assert plan.unlinks == ("k/c/1", "k/c/2")


def test_plan_recycles_only_replaced_whole_committed_chunks() -> None:
    committed = {"k": _meta("k", 2 * 4096 + 10), "small": _meta("small", 10)}
    current = {
        "k": _meta("k", 4 * 4096),
        "small": _meta("small", 4096),
        "new": _meta("new", 4096),
    }
    changed = {"k": ["s/0", None, "s/2", "s/3"], "small": ["s/4"], "new": ["s/5"]}
    names = iter(f"spare/f{i}" for i in range(10))
    plan, _docs = plan_changes(
        committed,
        current,
        changed,
        generation=3,
        meta={},
        durable=True,
        new_spare=lambda: next(names),
    )
    # k/c/0 was a whole committed chunk; k/c/2 was a padded edge chunk, k/c/3 did not exist;
    # small's only chunk was padded; new had none
    assert plan.recycle == (("k/c/0", "spare/f0"),)


class _CrashError(Exception):
    pass


def _crashing_roll_forward(after: int):
    """A roll_forward that performs ``after`` renames, then 'loses power'."""
    real_replace, real_roll_forward = os.replace, journal.roll_forward

    def roll_forward(root, internal, plan, sync_dirs):
        count = {"n": 0}

        def replace(src, dst):
            if count["n"] >= after:
                raise _CrashError
            count["n"] += 1
            real_replace(src, dst)

        os.replace = replace
        try:
            real_roll_forward(root, internal, plan, sync_dirs)
        finally:
            os.replace = real_replace

    return roll_forward


def _abandon(store: ts.SwapStore) -> None:
    """Drop a store object as a killed process would: no cleanup beyond releasing the lock."""
    store._engine.close()
    store._folder.unlock()
    store._closed = True


@pytest.mark.parametrize("after", [0, 1, 3, 100])
def test_crash_after_commit_point_rolls_forward(store_path: Path, monkeypatch, after: int) -> None:
    old = {"a/x": torch.ones(3000), "gone": torch.zeros(5)}
    new = {"a/x": torch.arange(10.0), "b": torch.full((9000,), 7.0)}
    store = ts.SwapStore(store_path, chunk_bytes="4KiB")
    for key, value in old.items():
        store.put(key, value)
    store.commit({"n": 1})
    store.delete("gone")
    for key, value in new.items():
        store.put(key, value)
    monkeypatch.setattr(journal, "roll_forward", _crashing_roll_forward(after), raising=True)
    if after < 100:
        with pytest.raises(_CrashError):
            store.commit({"n": 2})
    else:
        store.commit({"n": 2})
    monkeypatch.undo()
    _abandon(store)
    # A reader opened now already sees the new commit, reading through the journal.
    with ts.SwapStore(store_path, mode="r") as reader:
        assert reader.generation == 2
        assert reader.keys() == sorted(new)
        for key, value in new.items():
            assert torch.equal(reader.get(key), value)
    with ts.SwapStore(store_path) as writer:  # the writer finishes the roll-forward
        assert writer.meta == {"n": 2}
        assert writer.keys() == sorted(new)
        for key, value in new.items():
            assert torch.equal(writer.get(key), value)
        assert writer.verify() == []
    assert not (store_path / ".tierswap" / "journal.json").exists()
    assert not (store_path / "gone").exists()


def test_crash_before_commit_point_keeps_old_state(store_path: Path, monkeypatch) -> None:
    store = ts.SwapStore(store_path)
    store.put("x", torch.ones(4))
    store.commit()
    store.put("x", torch.zeros(4))
    store.put("y", torch.zeros(4))

    def crash(*_args, **_kwargs):
        raise _CrashError

    monkeypatch.setattr(journal, "write_journal", crash)
    with pytest.raises(_CrashError):
        store.commit()
    monkeypatch.undo()
    _abandon(store)
    with ts.SwapStore(store_path) as store:
        assert store.keys() == ["x"]
        assert torch.equal(store.get("x"), torch.ones(4))
        assert store.generation == 1
    assert not (store_path / ".tierswap" / "staging").exists()


def test_roll_forward_is_idempotent(tmp_path: Path) -> None:
    root = tmp_path
    internal = root / ".tierswap"
    (internal / "staging").mkdir(parents=True)
    (internal / "staging" / "1").write_bytes(b"new")
    (root / "old").write_bytes(b"old")
    plan = journal.CommitPlan(
        generation=1, moves=((".tierswap/staging/1", "k/c/0"),), unlinks=("old",), rmdirs=()
    )
    for _ in range(2):
        journal.write_journal(internal, plan)
        journal.roll_forward(root, internal, plan, lambda dirs: None)
    assert (root / "k" / "c" / "0").read_bytes() == b"new"
    assert not (root / "old").exists()
    assert journal.read_journal(internal) is None


def test_damaged_journal_is_reported(tmp_path: Path) -> None:
    internal = tmp_path / ".tierswap"
    internal.mkdir()
    (internal / "journal.json").write_text("{")
    with pytest.raises(ts.errors.CorruptionError, match="journal"):
        journal.read_journal(internal)


def test_roll_forward_moves_replaced_chunks_aside_once(tmp_path: Path) -> None:
    """A recycled chunk: the old version moves to the spare folder, exactly once."""
    root = tmp_path
    internal = root / ".tierswap"
    (internal / "staging").mkdir(parents=True)
    (internal / "staging" / "1").write_bytes(b"new")
    (root / "k" / "c").mkdir(parents=True)
    (root / "k" / "c" / "0").write_bytes(b"old")
    plan = journal.CommitPlan(
        generation=2,
        moves=((".tierswap/staging/1", "k/c/0"),),
        recycle=(("k/c/0", ".tierswap/spare/f0"),),
    )
    journal.write_journal(internal, plan)
    real_replace = os.replace
    calls = {"n": 0}

    def crash_second(src, dst):  # power lost between moving the old aside and the new in
        calls["n"] += 1
        if calls["n"] == 2:
            raise _CrashError
        real_replace(src, dst)

    os.replace = crash_second
    try:
        with pytest.raises(_CrashError):
            journal.roll_forward(root, internal, plan, lambda dirs: None)
    finally:
        os.replace = real_replace
    assert not (root / "k" / "c" / "0").exists()
    for _ in range(2):  # the next writer rolls forward; doing it twice changes nothing more
        journal.write_journal(internal, plan)
        journal.roll_forward(root, internal, plan, lambda dirs: None)
    assert (root / "k" / "c" / "0").read_bytes() == b"new"
    assert (internal / "spare" / "f0").read_bytes() == b"old"
    assert journal.CommitPlan.from_json(plan.to_json()) == plan
