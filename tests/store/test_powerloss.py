"""Power loss, not only kill -9: every disk state a power cut may leave between sync barriers
recovers to a commit, bit for bit (the harness is in :mod:`tests.store.powerloss`).

The default run checks a few commits of each scenario; the slow suite checks over twenty
commits under both persistence models, a longer training run, and power cuts during twenty
recoveries of each scenario.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.store.powerloss.check import Recording, Report, check_all, check_recoveries, record
from tests.store.powerloss.trace import can_trace

_CANNOT_TRACE = can_trace()
pytestmark = pytest.mark.skipif(_CANNOT_TRACE is not None, reason=str(_CANNOT_TRACE))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, int], Recording]:
    """A scenario's recording, made once per module: each check rewrites its folder whole."""
    cache: dict[tuple[str, int], Recording] = {}

    def get(scenario: str, commits: int) -> Recording:
        if (scenario, commits) not in cache:
            work = tmp_path_factory.mktemp(scenario)
            cache[scenario, commits] = record(scenario, work, commits=commits)
        return cache[scenario, commits]

    return get


def _all_recover(rec: Recording, report: Report, name: str) -> None:
    print(report.summary(name))
    assert not report.failures, "\n".join(report.failures[:10])
    assert report.generations == set(range(rec.commits + 1)), "some commits never checked"
    assert report.journal_states > 0, "no state caught a commit after its commit point"


@pytest.mark.parametrize(
    ("scenario", "commits", "model"),
    [
        pytest.param("store", 3, "ext4", marks=pytest.mark.slow),
        ("store", 3, "reorder"),  # the harsher model: writes reordered within barriers
        pytest.param("buffered", 3, "ext4", marks=pytest.mark.slow),
        ("folders", 3, "ext4"),
    ],
)  # make test keeps the store and the folders once each; the slow suite runs every pairing
def test_every_crash_state_recovers(
    recorded: Callable[[str, int], Recording], scenario: str, commits: int, model: str
) -> None:
    rec = recorded(scenario, commits)
    report = check_all(rec, model=model, randoms=2)  # the slow suite draws 8 per crash point
    _all_recover(rec, report, f"{scenario}/{model}")
    assert report.states >= 50 * commits  # every barrier of every commit, many states each


def test_training_run_recovers_from_every_crash_state(tmp_path) -> None:
    rec = record("optimizer", tmp_path, commits=3)
    report = check_all(rec, randoms=2, every=8)
    _all_recover(rec, report, "optimizer")


# the buffered variants of the next two take 35 s together: the slow suite runs them
_STORE_FAST = ["store", pytest.param("buffered", marks=pytest.mark.slow)]


@pytest.mark.parametrize("scenario", _STORE_FAST)
def test_a_power_cut_during_recovery_recovers_too(
    recorded: Callable[[str, int], Recording], scenario: str
) -> None:
    """States caught after a commit point are recovered by the reopen, which rolls the journal
    forward; a second power cut at any barrier of that roll-forward still recovers the same
    generation."""
    rec = recorded(scenario, 3)
    report = check_recoveries(rec, journals=1, randoms=2)
    print(report.summary(f"recovery/{scenario}"))
    assert not report.failures, "\n".join(report.failures[:10])
    assert report.journal_states == 1
    assert report.states >= 20


@pytest.mark.parametrize("scenario", _STORE_FAST)
def test_harness_finds_a_rename_before_its_data_barrier(tmp_path, scenario: str) -> None:
    """A store variant whose journal is renamed into place before its data is synced: some
    crash states leave a journal of no bytes under the committed name, and the harness says so."""
    rec = record(scenario, tmp_path, commits=2, planted=True)
    report = check_all(rec, randoms=2)
    print(report.summary(f"planted/{scenario}"))
    assert report.failures
    assert any("journal" in failure and "damaged" in failure for failure in report.failures)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize(
    ("scenario", "model"),
    [("store", "ext4"), ("store", "reorder"), ("buffered", "ext4"), ("buffered", "reorder"),
     ("folders", "ext4"), ("folders", "reorder")],
)  # fmt: skip
def test_twenty_commits_every_crash_state_recovers(tmp_path, scenario: str, model: str) -> None:
    rec = record(scenario, tmp_path, commits=20)
    report = check_all(rec, model=model)
    _all_recover(rec, report, f"{scenario}/{model}")


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_long_training_run_recovers_from_every_crash_state(tmp_path) -> None:
    rec = record("optimizer", tmp_path, commits=8)
    report = check_all(rec)
    _all_recover(rec, report, "optimizer")


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("scenario", ["store", "buffered", "folders"])
@pytest.mark.parametrize("model", ["ext4", "reorder"])
def test_power_cuts_during_twenty_recoveries(tmp_path, scenario: str, model: str) -> None:
    rec = record(scenario, tmp_path, commits=8)
    report = check_recoveries(rec, model=model, journals=20)
    print(report.summary(f"recovery/{scenario}/{model}"))
    assert not report.failures, "\n".join(report.failures[:10])
    assert report.journal_states == 20
