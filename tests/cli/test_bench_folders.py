"""``tierswap bench --dir A --dir B``: each folder measured, a striped store against each folder
alone, and a tune file whose weights a store on those folders uses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tierswap as ts
from tierswap.cli import bench, main
from tierswap.config import IOConfig

NARROW = ["--size", "4MiB", "--block-size", "1MiB", "--threads", "1,2", "--repeat", "2"]


@pytest.fixture(autouse=True)
def no_fio(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "which", lambda _tool: None)


def _drives(tmp_path: Path) -> list[Path]:
    drives = [tmp_path / "a", tmp_path / "b"]
    for drive in drives:
        drive.mkdir()
    return drives


def test_several_dirs_measure_each_then_the_striped_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = _drives(tmp_path)
    out, tune = tmp_path / "r.json", tmp_path / "t.json"
    args = ["bench", "--dir", str(a), "--dir", str(b), *NARROW, "--engine", "buffered,zarr"]
    args += ["--drop-cache", "fadvise", "--json", str(out), "--tune", str(tune)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert text.count("tierswap bench") == 2  # one table per folder
    assert "striped / sum" in text
    data = json.loads(out.read_text())
    assert [d["dir"] for d in data["dirs"]] == [str(a.resolve()), str(b.resolve())]
    several = data["several"]
    assert several["engine"] == "buffered"  # zarr is not tierswap's: never the tuned engine
    assert [f["dir"] for f in several["folders"]] == [str(a.resolve()), str(b.resolve())]
    assert all(f["write_gbps"] > 0 and f["weight"] > 0 for f in several["folders"])
    assert several["striped"]["read_gbps"] > 0
    assert several["scaling"]["write"] > 0
    config = IOConfig.from_file(tune)
    assert config.folder_weights == {f["dir"]: f["weight"] for f in several["folders"]}
    assert config.threads == several["threads"]
    assert not [p for d in (a, b) for p in d.iterdir()]  # the bench folders are gone
    with ts.SwapStore([a / "run", b / "run"], io=config, chunk_bytes="4KiB") as store:
        store.put("k", torch.zeros(64 * 1024, dtype=torch.int32))
        store.commit()
        assert all(used > 0 for used in store.folder_usage().values())


def test_a_folder_given_twice_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, _b = _drives(tmp_path)
    assert main(["bench", "--dir", str(a), "--dir", f"{a}/.", *NARROW]) == 2
    assert "given twice" in capsys.readouterr().err


def test_several_dirs_without_a_tierswap_engine_measure_each_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = _drives(tmp_path)
    args = ["bench", "--dir", str(a), "--dir", str(b), *NARROW, "--engine", "zarr"]
    assert main([*args, "--drop-cache", "fadvise", "--repeat", "1"]) == 0
    text = capsys.readouterr().out
    assert text.count("tierswap bench") == 2
    assert "striped" not in text
