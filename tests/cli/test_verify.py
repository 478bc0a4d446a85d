"""``tierswap verify``: exit 0 only when intact; a flipped byte or a truncated file is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tierswap.cli import main
from tierswap.store import SwapStore


@pytest.fixture
def committed_store(tmp_path: Path) -> Path:
    path = tmp_path / "s"
    with SwapStore(path, chunk_bytes="64KiB") as store:
        store.put("a/weight", torch.randn(100, 300))  # two chunks
        store.put("b", torch.arange(1000))
        store.commit({"step": 1})
    return path


def _chunk_files(store: Path, key: str) -> list[Path]:
    folder = store / key
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != "zarr.json")


def test_intact_store_exits_0(committed_store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(committed_store)]) == 0
    assert "intact: 2 arrays" in capsys.readouterr().out


def test_flipped_byte_is_named(committed_store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    chunk = _chunk_files(committed_store, "a/weight")[1]
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0x01
    chunk.write_bytes(data)
    assert main(["verify", str(committed_store)]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED" in out
    assert "'a/weight'" in out
    assert "chunk 1" in out
    assert "'b'" not in out


def test_truncated_file_is_named(committed_store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    chunk = _chunk_files(committed_store, "b")[0]
    chunk.write_bytes(chunk.read_bytes()[:1000])
    assert main(["verify", str(committed_store), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["intact"] is False
    assert len(data["problems"]) == 1
    assert "'b'" in data["problems"][0]
    assert "chunk 0" in data["problems"][0]


def test_damaged_metadata_is_damage_not_usage(
    committed_store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (committed_store / "zarr.json").write_text("{not json")
    assert main(["verify", str(committed_store)]) == 1
    assert "store metadata" in capsys.readouterr().out


def test_not_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(tmp_path / "absent")]) == 2
    assert "is not a folder" in capsys.readouterr().err
