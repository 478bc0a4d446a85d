"""The shared measurement helpers: statistics, free space, clean-up, cache dropping, trials."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tierswap.cli import _measure
from tierswap.cli._measure import Sample, Stats, bench_folder, check_free_space, run_trial
from tierswap.errors import ConfigError


def test_stats_median_min_max() -> None:
    assert Stats.of([3.0, 1.0, 2.0]) == Stats(2.0, 1.0, 3.0)
    assert Stats.of([1.0, 4.0]).median == 2.5
    with pytest.raises(ValueError, match="at least one"):
        Stats.of([])


def test_random_source_is_aligned_and_seeded() -> None:
    a = _measure.random_source(3 * 4096 + 5, seed=1)
    b = _measure.random_source(3 * 4096 + 5, seed=1)
    assert a.data_ptr() % 4096 == 0
    assert a.numel() == 3 * 4096 + 5
    assert bool((a == b).all())
    assert int(a.unique().numel()) > 200  # random, not zeros


def test_free_space_refusal_names_the_need(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage._replace(free=3 << 20))
    with pytest.raises(ConfigError, match=r"3.00 MiB free .* 2 x --size = 4.00 MiB"):
        check_free_space(tmp_path, 2 << 20)
    check_free_space(tmp_path, 1 << 20)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_bench_folder_is_removed_on_any_exit(tmp_path: Path, error: type[BaseException]) -> None:
    def fill_then_fail() -> None:
        with bench_folder(tmp_path) as root:
            (root / "big.bin").write_bytes(b"x" * 10000)
            raise error

    with pytest.raises(error):
        fill_then_fail()
    assert list(tmp_path.iterdir()) == []


def test_bench_folder_needs_a_folder(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a folder"), bench_folder(tmp_path / "nope"):
        pass


def _fill(folder: Path) -> Path:
    path = folder / "sub" / "f.bin"
    path.parent.mkdir()
    path.write_bytes(os.urandom(1 << 16))
    return path


def test_drop_cache_falls_back_to_fadvise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fill(tmp_path)
    unwritable = tmp_path / "no" / "drop_caches"  # parent missing: the write fails
    monkeypatch.setattr(_measure, "_DROP_CACHES", unwritable)
    assert _measure.drop_page_cache(tmp_path, "auto") == "fadvise"
    assert _measure.drop_page_cache(tmp_path, "fadvise") == "fadvise"
    with pytest.raises(ConfigError, match="--drop-cache fadvise"):
        _measure.drop_page_cache(tmp_path, "drop_caches")


def test_drop_cache_writes_1_to_drop_caches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fill(tmp_path)
    fake = tmp_path / "drop_caches"
    monkeypatch.setattr(_measure, "_DROP_CACHES", fake)
    assert _measure.drop_page_cache(tmp_path, "auto") == "drop_caches"
    assert fake.read_text() == "1\n"


class _FakeEngine:
    """Writes 1 MiB in 'seconds' it reports; remembers the folder it was given."""

    def __init__(self) -> None:
        self.folders: list[Path] = []

    def write(self, folder: Path) -> float:
        self.folders.append(folder)
        _fill(folder)
        return 2e9

    def read(self, folder: Path) -> float:
        assert (folder / "sub" / "f.bin").stat().st_size == 1 << 16
        return 1e9


def test_run_trial_measures_then_removes_its_folder(tmp_path: Path) -> None:
    engine = _FakeEngine()
    sample, method = run_trial(engine, tmp_path, "fadvise")
    assert sample == Sample(2e9, 1e9)
    assert method == "fadvise"
    assert engine.folders[0].parent == tmp_path
    assert not engine.folders[0].exists()
