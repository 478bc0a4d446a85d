"""``tierswap bench`` end to end on a few MiB: output, JSON, plot, tune file, refusals, Ctrl-C."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tierswap.cli import bench, main
from tierswap.cli._engines import AiofilesEngine
from tierswap.config import IOConfig
from tierswap.errors import BenchmarkError

SMALL = ["--size", "4MiB", "--block-size", "1MiB,2MiB", "--threads", "1,2", "--repeat", "2"]


@pytest.fixture
def no_fio(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "which", lambda _tool: None)


def _bench(folder: Path, *extra: str) -> int:
    return main(["bench", "--dir", str(folder), *SMALL, "--drop-cache", "fadvise", *extra])


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("tierswap-bench"))


@pytest.mark.usefixtures("no_fio")
def test_bench_all_engines_json_plot_tune(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    args = ["--json", str(out / "r.json"), "--plot", str(out / "p.png"), "--tune", str(out / "t")]
    assert _bench(tmp_path, *args) == 0
    text = capsys.readouterr().out
    assert "tierswap bench" in text
    assert "fio: not installed" in text
    data = json.loads((out / "r.json").read_text())
    assert data["fio"] is None
    assert data["cache_drop"] == "fadvise"
    measured = {(r["engine"], r["block_bytes"], r["threads"]) for r in data["results"]}
    skipped = {(r["engine"], r["block_bytes"], r["threads"]) for r in data["skipped"]}
    engines = ("direct", "buffered", "aiofiles", "zarr")
    assert measured | skipped == {(e, b << 20, t) for e in engines for b in (1, 2) for t in (1, 2)}
    assert all(r["engine"] == "direct" for r in data["skipped"])  # only O_DIRECT may be refused
    for result in data["results"]:
        assert len(result["write"]["samples_gbps"]) == 2
        assert result["read"]["min_gbps"] <= result["read"]["median_gbps"]
        assert result["write"]["ratio_to_fio"] is None
    assert (out / "p.png").read_bytes().startswith(b"\x89PNG")
    tuned = IOConfig.from_file(out / "t")
    assert tuned.block_bytes in (1 << 20, 2 << 20)
    assert tuned.threads in (1, 2)
    assert _leftovers(tmp_path) == []


@pytest.mark.usefixtures("no_fio")
def test_bench_store_engines_report_what_ran(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert _bench(tmp_path, "--engine", "buffered,direct", "--repeat", "1", "--json", str(out)) == 0
    notes = {r["engine"]: r["note"] for r in json.loads(out.read_text())["results"]}
    assert notes["buffered"] == "buffered + fadvise"
    assert notes.get("direct", "O_DIRECT") == "O_DIRECT"


@pytest.mark.usefixtures("no_fio")
def test_json_to_stdout_replaces_the_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _bench(tmp_path, "--engine", "aiofiles", "--repeat", "1", "--json", "-") == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["engine"] for r in data["results"]] == ["aiofiles"] * 4


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")
def test_bench_with_fio_reports_ratios(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    narrow = ["--engine", "aiofiles", "--block-size", "1MiB", "--threads", "1", "--repeat", "1"]
    assert _bench(tmp_path, *narrow, "--json", str(out)) == 0
    data = json.loads(out.read_text())
    if data["fio"] is None:  # fio installed but the folder refuses O_DIRECT
        assert data["fio_note"].startswith("failed:")
        return
    assert data["fio"]["write"]["median_gbps"] > 0
    fio_write = data["fio"]["write"]["median_gbps"]
    first = data["results"][0]["write"]
    assert first["ratio_to_fio"] == pytest.approx(first["median_gbps"] / fio_write, rel=1e-3)


def test_refuses_without_twice_the_size_free(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage._replace(free=6 << 20))
    assert _bench(tmp_path) == 2
    err = capsys.readouterr().err
    assert "tierswap bench: error:" in err
    assert "needs 2 x --size = 8.00 MiB" in err
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--block-size", "1000"], "not a multiple of 4096"),
        (["--engine", "zarr", "--tune", "t.json"], "add direct or buffered"),
        (["--size", "100"], "below 4KiB"),
    ],
)
def test_bad_settings_are_refused_before_any_io(
    tmp_path: Path, extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _bench(tmp_path, *extra) == 2
    assert message in capsys.readouterr().err


def test_missing_dir_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _bench(tmp_path / "absent") == 2
    assert "is not a folder" in capsys.readouterr().err


@pytest.mark.usefixtures("no_fio")
def test_ctrl_c_removes_the_bench_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[Path] = []

    def write_then_interrupt(self: AiofilesEngine, folder: Path) -> float:
        (folder / "data.bin").write_bytes(os.urandom(1 << 20))
        seen.append(folder)
        raise KeyboardInterrupt

    monkeypatch.setattr(AiofilesEngine, "write", write_then_interrupt)
    assert _bench(tmp_path, "--engine", "zarr,aiofiles") == 130
    assert "interrupted" in capsys.readouterr().err
    assert seen
    assert not seen[0].exists()
    assert _leftovers(tmp_path) == []


def test_help_explains_every_option() -> None:
    env = {**os.environ, "PYTHONPATH": str(Path.cwd())}
    cmd = [sys.executable, "-m", "tierswap", "bench", "--help"]
    text = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    for option in ("--dir", "--size", "--block-size", "--threads", "--engine", "--repeat"):
        assert option in text
    for option in ("--json", "--plot", "--tune", "--drop-cache", "--no-fio"):
        assert option in text
    assert "TIERSWAP_CONFIG" in text


@pytest.mark.usefixtures("no_fio")
def test_an_engine_that_cannot_run_is_skipped_not_fatal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def refuse(self: AiofilesEngine, folder: Path) -> float:
        raise BenchmarkError("aiofiles cannot run here")

    monkeypatch.setattr(AiofilesEngine, "write", refuse)
    out = tmp_path / "r.json"
    args = ["--engine", "aiofiles,buffered", "--threads", "1", "--repeat", "1", "--json", str(out)]
    assert _bench(tmp_path, *args) == 0
    assert "skipped aiofiles 1 MiB x1: aiofiles cannot run here" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert {r["engine"] for r in data["results"]} == {"buffered"}
    assert [s["reason"] for s in data["skipped"]] == ["aiofiles cannot run here"] * 2


def test_a_failing_fio_leaves_the_rest_of_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "fio"
    fake.write_text("#!/bin/sh\necho 'fio: engine libaio not loadable' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(bench, "which", lambda _tool: str(fake))
    out = tmp_path / "r.json"
    narrow = ["--engine", "buffered", "--block-size", "1MiB", "--threads", "1", "--repeat", "2"]
    assert _bench(tmp_path, *narrow, "--json", str(out)) == 0
    data = json.loads(out.read_text())
    assert data["fio"] is None
    assert data["fio_note"].startswith("failed: ")
    assert "libaio not loadable" in data["fio_note"]
    assert len(data["results"][0]["write"]["samples_gbps"]) == 2
