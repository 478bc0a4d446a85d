"""--plot: a PNG with one column per engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierswap.cli._measure import Sample, Setting
from tierswap.cli._plot import plot_report
from tierswap.cli._report import BenchReport, Result
from tierswap.errors import ConfigError

pytest.importorskip("matplotlib")


def _results() -> list[Result]:
    return [
        Result(Setting(engine, block << 20, threads), [Sample(1e9 * block, 2e9), Sample(1e9, 1e9)])
        for engine in ("direct", "zarr")
        for block in (1, 8)
        for threads in (1, 4)
    ]


def test_plot_writes_a_png(tmp_path: Path) -> None:
    fio = Result(Setting("fio", 8 << 20), [Sample(2e9, 2e9)])
    path = tmp_path / "p.png"
    plot_report(BenchReport("/d", 1 << 20, 2, "fadvise", _results(), fio), path)
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(data) > 10_000


def test_plot_without_samples_is_refused(tmp_path: Path) -> None:
    empty = [Result(Setting("direct", 1 << 20, 1), skipped="no O_DIRECT")]
    with pytest.raises(ConfigError, match="nothing to draw"):
        plot_report(BenchReport("/d", 1 << 20, 1, "-", empty), tmp_path / "p.png")
