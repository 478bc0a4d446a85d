"""The store's gate on its own: sections are left on every path, exclusive runs alone."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from tierswap.store._gate import Gate


class _Claim:
    """Records what the gate does with it; ``busy_until`` makes it wait for an event."""

    def __init__(self, *, fail_take: bool = False, busy_until: threading.Event | None = None):
        self.fail_take, self.busy_until = fail_take, busy_until
        self.log: list[str] = []

    def busy(self) -> bool:
        return self.busy_until is not None and not self.busy_until.is_set()

    def take(self) -> None:
        if self.fail_take:
            raise KeyError("taken nothing")
        self.log.append("take")

    def give_back(self) -> None:
        self.log.append("give_back")

    def settle(self) -> None:
        self.log.append("settle")


def _exclusive_runs(gate: Gate) -> bool:
    """Whether an exclusive section could run now (it finishes within a short wait)."""
    done = threading.Event()

    def run() -> None:
        with gate.exclusive():
            done.set()

    threading.Thread(target=run, daemon=True).start()
    return done.wait(0.3)


def test_a_section_is_left_when_its_block_raises() -> None:
    gate, claim = Gate(lambda: None), _Claim()
    with pytest.raises(ValueError, match="boom"), gate.shared(claim):
        raise ValueError("boom")
    assert claim.log == ["take", "give_back", "settle"]
    assert _exclusive_runs(gate)


def test_a_failed_take_enters_nothing() -> None:
    gate, claim = Gate(lambda: None), _Claim(fail_take=True)
    with pytest.raises(KeyError), gate.shared(claim):
        pytest.fail("the block must not run")
    assert claim.log == []
    assert _exclusive_runs(gate)


def test_a_finished_section_is_left_before_its_result_is_set() -> None:
    gate, claim = Gate(lambda: None), _Claim()
    done: Future[int] = Future()
    with gate.shared(claim) as section:
        result = section.finish(done, lambda f: f.result() + 1)
    assert claim.log == ["take"]  # still in flight after the block
    assert not _exclusive_runs(gate)
    seen: list[list[str]] = []
    result.add_done_callback(lambda _f: seen.append(list(claim.log)))
    done.set_result(1)
    assert result.result() == 2
    assert seen == [["take", "give_back", "settle"]]


def test_a_failing_operation_still_leaves_its_section() -> None:
    gate, claim = Gate(lambda: None), _Claim()
    done: Future[int] = Future()
    with gate.shared(claim) as section:
        result = section.finish_with(done, "out")
    done.set_exception(OSError(5, "Input/output error"))
    with pytest.raises(OSError, match="Input/output"):
        result.result()
    assert claim.log == ["take", "give_back", "settle"]


def test_exclusive_waits_for_shared_and_holds_new_ones_back() -> None:
    gate = Gate(lambda: None)
    first = _Claim()
    with gate.shared(first):
        order: list[str] = []
        exclusive_in = threading.Event()
        release = threading.Event()

        def exclusive() -> None:
            with gate.exclusive():
                order.append("exclusive")
                exclusive_in.set()
                release.wait(5)

        thread = threading.Thread(target=exclusive, daemon=True)
        thread.start()
        assert not exclusive_in.wait(0.2)  # waits for the shared section in flight
    assert exclusive_in.wait(5)

    def second() -> None:
        with gate.shared(_Claim()):
            order.append("shared")

    later = threading.Thread(target=second, daemon=True)
    later.start()
    later.join(0.2)
    assert order == ["exclusive"]  # held back while the exclusive section runs
    release.set()
    later.join(5)
    thread.join(5)
    assert order == ["exclusive", "shared"]


def test_a_busy_claim_waits_and_every_wait_checks_the_store_open() -> None:
    closed = threading.Event()

    def check_open() -> None:
        if closed.is_set():
            raise RuntimeError("closed")

    gate, ready = Gate(check_open), threading.Event()
    claim = _Claim(busy_until=ready)
    errors: list[BaseException] = []

    def enter() -> None:
        try:
            with gate.shared(claim):
                pass
        except RuntimeError as exc:
            errors.append(exc)

    with gate.shared(_Claim()):  # its leave, after the close, wakes the waiter
        thread = threading.Thread(target=enter, daemon=True)
        thread.start()
        thread.join(0.2)
        assert thread.is_alive()  # waiting for the claim
        closed.set()
    thread.join(5)
    assert not thread.is_alive()
    assert [str(e) for e in errors] == ["closed"]
    assert claim.log == []
