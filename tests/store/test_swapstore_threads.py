"""SwapStore's concurrency rules (see the class docstring), each checked with threads."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

import tierswap as ts
from tests.store.faults import finishes, inject
from tierswap.errors import StoreClosedError
from tierswap.store import _journal as journal
from tierswap.store import swapstore


class _Overlap:
    """Wraps a function and records how many calls ran at once (each lasts ``hold`` s)."""

    def __init__(self, fn, hold: float = 0.2) -> None:
        self.fn, self.hold = fn, hold
        self.running = self.most = 0
        self.lock = threading.Lock()

    def __call__(self, *args, **kwargs):
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            time.sleep(self.hold)
            return self.fn(*args, **kwargs)
        finally:
            with self.lock:
                self.running -= 1


def _run_together(*fns) -> list[BaseException]:
    """Start ``fns`` in threads at the same instant; return what they raised."""
    barrier, errors = threading.Barrier(len(fns)), []

    def run(fn) -> None:
        barrier.wait()
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads), "threads did not finish (deadlock?)"
    return errors


def test_two_commits_run_one_after_the_other(
    store_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    overlap = _Overlap(journal.commit_durable)
    monkeypatch.setattr(journal, "commit_durable", overlap)
    with ts.SwapStore(store_path) as store:
        store.put("x", torch.ones(10))
        assert _run_together(store.commit, store.commit) == []
        assert overlap.most == 1
        assert store.generation == 2
        assert store.verify() == []


def test_close_waits_for_a_commit_in_flight(
    store_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ts.SwapStore(store_path)
    store.put("x", torch.ones(10))
    closed_during: list[bool] = []
    real = journal.commit_durable

    def slow_commit(*args, **kwargs):
        time.sleep(0.3)
        closed_during.append(store._closed)
        return real(*args, **kwargs)

    monkeypatch.setattr(journal, "commit_durable", slow_commit)
    committer = threading.Thread(target=store.commit)
    committer.start()
    time.sleep(0.1)  # the commit is running
    store.close()
    committer.join(10)
    assert closed_during == [False]
    with ts.SwapStore(store_path) as store:
        assert store.generation == 1
        assert torch.equal(store.get("x"), torch.ones(10))
        assert store.verify() == []
    assert not (store_path / ".tierswap" / "staging").exists()


def test_commit_after_close_raises_instead_of_running(store_path: Path) -> None:
    store = ts.SwapStore(store_path)
    store.close()
    with pytest.raises(StoreClosedError):
        store.commit()


@pytest.mark.parametrize("durable", [True, False])
def test_puts_of_one_key_never_overlap(
    store_path: Path, durable: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_chunk_bytes_for = swapstore.chunk_bytes_for

    def slow_chunk_bytes_for(*args):  # widens any gap between "no put pending" and "mine"
        time.sleep(0.02)
        return real_chunk_bytes_for(*args)

    monkeypatch.setattr(swapstore, "chunk_bytes_for", slow_chunk_bytes_for)
    with ts.SwapStore(store_path, chunk_bytes="4KiB", durable=durable) as store:
        in_flight: dict[str, int] = {}
        most = [0]
        lock = threading.Lock()
        real = store._puts.submit

        def counting(meta, source):
            with lock:
                in_flight[meta.key] = in_flight.get(meta.key, 0) + 1
                most[0] = max(most[0], in_flight[meta.key])

            def done(_f) -> None:
                with lock:
                    in_flight[meta.key] -= 1

            written = real(meta, source)
            written.add_done_callback(done)
            return written

        store._puts.submit = counting
        values = [torch.full((3000,), float(i)) for i in range(8)]
        for _ in range(5):
            errors = _run_together(*(lambda v=v: store.put("x", v) for v in values))
            assert errors == []
        assert most[0] == 1
        assert any(torch.equal(store.get("x"), v) for v in values)
        assert store.verify() == []


def test_keys_and_contains_agree_about_a_put_in_flight(store_path: Path) -> None:
    with ts.SwapStore(store_path) as store:
        release = threading.Event()
        faulty = inject(store, gate={"write_file": release})
        future = store.put_async("x", torch.ones(10))
        assert faulty.entered["write_file"].wait(5)
        assert "x" in store
        assert store.keys() == ["x"]
        assert len(store) == 1
        release.set()
        future.result()
        assert "x" in store
        assert store.keys() == ["x"]


def test_keys_and_contains_drop_a_failed_first_put(store_path: Path) -> None:
    with ts.SwapStore(store_path) as store:
        inject(store, fail={"write_file": {1}})
        with pytest.raises(OSError, match="Input/output"):
            store.put("x", torch.ones(10))
        assert "x" not in store
        assert store.keys() == []


def test_verify_runs_beside_puts_and_deletes(store_path: Path) -> None:
    with ts.SwapStore(store_path, chunk_bytes="4KiB") as store:
        for i in range(20):
            store.put(f"k{i}", torch.full((2000,), float(i)))
        store.commit()
        stop = threading.Event()
        problems: list[list[str]] = []

        def churn() -> None:
            i = 0
            while not stop.is_set():
                store.put(f"n{i % 7}", torch.ones(2000))
                if i % 3 == 0 and f"n{(i - 3) % 7}" in store:
                    store.delete(f"n{(i - 3) % 7}")
                i += 1

        def check() -> None:
            try:
                for _ in range(10):
                    problems.append(store.verify())
            finally:
                stop.set()

        assert _run_together(churn, check) == []
        assert problems
        assert all(p == [] for p in problems)


def test_operations_wait_out_a_commit_and_then_see_it(
    store_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(journal, "commit_durable", _Overlap(journal.commit_durable, 0.2))
    with ts.SwapStore(store_path) as store:
        store.put("x", torch.ones(10))
        committer = threading.Thread(target=store.commit)
        committer.start()
        time.sleep(0.05)
        store.put("x", torch.zeros(10))  # waits for the commit, then replaces x
        assert finishes(committer.join) is None
        assert store.generation == 1
        assert torch.equal(store.get("x"), torch.zeros(10))
