"""Results: the medians table, the JSON fields, the best setting and the tune file."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from tierswap.cli._measure import Sample, Setting, short_size
from tierswap.cli._report import (
    BenchReport,
    Result,
    best_result,
    print_table,
    write_json,
    write_tune_file,
)
from tierswap.config import IOConfig
from tierswap.errors import ConfigError

MiB = 1 << 20


def _result(engine: str, block: int, threads: int | None, *pairs: tuple[float, float]) -> Result:
    return Result(Setting(engine, block, threads), [Sample(w * 1e9, r * 1e9) for w, r in pairs])


def _report(with_fio: bool = True) -> BenchReport:
    results = [
        _result("direct", 8 * MiB, 4, (1.8, 1.6), (2.0, 1.4), (1.9, 1.5)),
        _result("direct", 1 * MiB, 1, (2.4, 0.4)),  # fast writes, slow reads: not balanced
        _result("buffered", 4 * MiB, 2, (1.0, 1.0)),
        _result("zarr", 8 * MiB, 4, (3.0, 3.0)),  # a baseline never wins --tune
        Result(Setting("direct", 16 * MiB, 8), skipped="O_DIRECT refused"),
    ]
    fio = _result("fio", 8 * MiB, None, (2.0, 1.6), (1.8, 1.4)) if with_fio else None
    return BenchReport("/disk", 64 * MiB, 3, "fadvise", results, fio, "" if with_fio else "x")


def test_short_size() -> None:
    assert short_size(8 * MiB) == "8 MiB"
    assert short_size(512 * 1024) == "512 KiB"
    assert short_size(3 * MiB // 2) == "1.5 MiB"
    assert short_size(100) == "100 B"


def test_json_fields_and_ratios(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    write_json(_report(), str(path), io.StringIO())
    data = json.loads(path.read_text())
    assert {"version", "dir", "size_bytes", "repeat", "cache_drop", "fio", "results"} <= set(data)
    assert data["size_bytes"] == 64 * MiB
    assert data["fio"]["write"]["median_gbps"] == pytest.approx(1.9)
    first = data["results"][0]
    assert (first["engine"], first["block_bytes"], first["threads"]) == ("direct", 8 * MiB, 4)
    assert first["write"]["median_gbps"] == pytest.approx(1.9)
    assert (first["write"]["min_gbps"], first["write"]["max_gbps"]) == (1.8, 2.0)
    assert first["write"]["samples_gbps"] == [1.8, 2.0, 1.9]
    assert first["write"]["ratio_to_fio"] == pytest.approx(1.0)
    assert first["read"]["ratio_to_fio"] == pytest.approx(1.5 / 1.5)
    assert len(data["results"]) == 4
    assert data["skipped"] == [
        {"engine": "direct", "block_bytes": 16 * MiB, "threads": 8, "reason": "O_DIRECT refused"}
    ]


def test_json_without_fio_has_null_ratios() -> None:
    out = io.StringIO()
    write_json(_report(with_fio=False), "-", out)
    data = json.loads(out.getvalue())
    assert data["fio"] is None
    assert data["results"][0]["read"]["ratio_to_fio"] is None


def test_table_rows_show_median_range_and_ratio() -> None:
    rows = _report().rows()
    assert rows[0] == [
        "direct",
        "8 MiB",
        "4",
        "1.90 (1.80-2.00)",
        "1.00x",
        "1.50 (1.40-1.60)",
        "1.00x",
    ]
    assert rows[-1][0] == "fio"
    assert rows[-1][2] == "-"
    assert _report(with_fio=False).rows()[0][4] == "-"
    out = io.StringIO()
    print_table(_report(), out)
    text = out.getvalue()
    assert "1.90 (1.80-2.00)" in text
    assert "skipped direct 16 MiB x8: O_DIRECT refused" in text


def test_best_is_the_balanced_tierswap_setting() -> None:
    best = best_result(_report())
    assert (best.setting.engine, best.setting.block_bytes, best.setting.threads) == (
        "direct",
        8 * MiB,
        4,
    )
    only_baselines = BenchReport("/d", MiB, 1, "fadvise", [_result("zarr", MiB, 1, (1.0, 1.0))])
    with pytest.raises(ConfigError, match="add direct or buffered"):
        best_result(only_baselines)


def test_tune_file_round_trips_into_ioconfig(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tune.json"
    written = write_tune_file(_report(), path)
    assert written == IOConfig(block_bytes=8 * MiB, threads=4, direct="auto")
    assert IOConfig.from_file(path) == written
    monkeypatch.setenv("TIERSWAP_CONFIG", str(path))
    assert IOConfig.default() == written
    measured = json.loads(path.read_text())["measured"]
    assert measured["engine"] == "direct"
    assert measured["write_gbps"] == pytest.approx(1.9)


def test_tune_file_for_a_buffered_winner_turns_direct_off(tmp_path: Path) -> None:
    report = BenchReport("/d", MiB, 1, "fadvise", [_result("buffered", 2 * MiB, 64, (1, 1))])
    config = write_tune_file(report, tmp_path / "t.json")
    assert config.direct == "off"
    assert config.threads == 64
    assert config.inflight >= 64
