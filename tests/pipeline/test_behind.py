"""Work behind the pipeline's caller: one thread each, settled once."""

from __future__ import annotations

import threading

import pytest

from tierswap.pipeline._behind import Behind


def _settle_from_two_threads(
    behind: Behind,
) -> tuple[list[BaseException | None], list[threading.Thread]]:
    """Two threads settling ``behind`` at once: what each raised (``None``), the threads."""
    outcomes: list[BaseException | None] = []

    def settle() -> None:
        try:
            behind.settle()
        except BaseException as exc:
            outcomes.append(exc)
        else:
            outcomes.append(None)

    threads = [threading.Thread(target=settle) for _ in range(2)]
    for thread in threads:
        thread.start()
    return outcomes, threads


@pytest.mark.parametrize("fails", [False, True])
def test_work_ends_once_when_two_threads_settle_it(fails) -> None:
    go = threading.Event()
    ends: list[tuple[BaseException | None, float]] = []
    names: list[str] = []

    def work() -> str:
        names.append(threading.current_thread().name)
        assert go.wait(timeout=30)
        if fails:
            raise OSError("the commit failed")
        return "done"

    behind = Behind()
    future = behind.start(work, lambda error, at: ends.append((error, at)))
    outcomes, threads = _settle_from_two_threads(behind)
    go.set()
    for thread in threads:
        thread.join(timeout=30)
    assert names == ["tierswap-behind"]
    assert len(ends) == 1  # ``ended`` ran once
    assert (ends[0][0] is not None) is fails
    raised = [o for o in outcomes if o is not None]
    assert len(raised) == (1 if fails else 0)  # the failure is raised once
    assert len(outcomes) == 2
    if not fails:
        assert future.result() == "done"
    behind.settle()  # nothing left


def test_start_settles_the_work_before() -> None:
    ends: list[BaseException | None] = []
    behind = Behind()
    behind.start(lambda: 1, lambda error, at: ends.append(error))
    behind.start(lambda: 2, lambda error, at: ends.append(error))
    assert ends == [None]
    behind.settle()
    assert ends == [None, None]
