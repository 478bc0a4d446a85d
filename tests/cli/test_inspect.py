"""``tierswap inspect``: arrays, commit, disk use, durable or scratch; works beside a writer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tierswap.cli import main
from tierswap.optim import SwapOptimizer
from tierswap.store import SwapStore


def _make_store(path: Path, *, durable: bool = True) -> None:
    with SwapStore(path, durable=durable, chunk_bytes="64KiB") as store:
        store.put("model/w/exp_avg", torch.randn(100, 300))
        store.put("model/b", torch.zeros(10, dtype=torch.bfloat16))
        store.put("scalar", torch.tensor(3, dtype=torch.int64))
        store.commit({"step": 7})


def _inspect_json(path: Path, capsys: pytest.CaptureFixture[str]) -> dict:
    assert main(["inspect", str(path), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_lists_arrays_commit_and_disk_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _make_store(tmp_path / "s")
    data = _inspect_json(tmp_path / "s", capsys)
    assert data["generation"] == 1
    assert data["meta"] == {"step": 7}
    assert data["step"] == 7
    assert data["durable"] is True
    assert data["arrays"] == [
        {"key": "model/b", "dtype": "bfloat16", "shape": [10], "nbytes": 20},
        {"key": "model/w/exp_avg", "dtype": "float32", "shape": [100, 300], "nbytes": 120_000},
        {"key": "scalar", "dtype": "int64", "shape": [], "nbytes": 8},
    ]
    assert data["nbytes"] == 120_028
    with SwapStore(tmp_path / "s", mode="r") as store:
        assert data["disk_bytes"] == store.disk_usage() >= 120_028


def test_text_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _make_store(tmp_path / "s", durable=False)
    assert main(["inspect", str(tmp_path / "s")]) == 0
    text = capsys.readouterr().out
    assert "scratch" in text
    assert "generation 2, step 7, " in text  # a scratch store commits again at close
    assert "tensors     3 arrays in 3 parameters, 117.21 KiB" in text
    assert 'meta        {"step": 7}' in text
    assert "model/w    (100, 300)  exp_avg  117.19 KiB" in text  # one line per parameter
    assert main(["inspect", str(tmp_path / "s"), "--all"]) == 0
    assert "model/w/exp_avg  float32   (100, 300)" in capsys.readouterr().out  # every array


def test_optimizer_folder_summary_groups_by_parameter_in_natural_order(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(12)])
    with SwapOptimizer(model.named_parameters(), swap_dir=tmp_path / "s") as opt:
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    data = _inspect_json(tmp_path / "s", capsys)
    names = [p["name"] for p in data["parameters"]]
    assert names[:4] == ["0.bias", "0.weight", "1.bias", "1.weight"]
    assert names.index("2.weight") < names.index("10.bias")  # natural, not text, order
    assert data["parameters"][1]["arrays"] == ["exp_avg", "exp_avg_sq", "param"]
    assert data["writer"] == {
        "by": "SwapOptimizer", "optimizer": "AdamW", "steps": 1, "rank": 0, "world_size": 1,
        "named": True,
    }  # fmt: skip
    assert main(["inspect", str(tmp_path / "s")]) == 0
    text = capsys.readouterr().out
    assert "written by  SwapOptimizer (AdamW), step 1, rank 0 of 1; keys: parameter names" in text
    assert "largest     " in text
    lines = text.splitlines()
    assert len(lines) < 40  # 24 parameters: one line each, after a short summary


def test_reader_beside_a_writer_sees_the_last_commit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _make_store(tmp_path / "s")
    with SwapStore(tmp_path / "s") as writer:  # holds the writer lock meanwhile
        writer.put("uncommitted", torch.ones(4))
        data = _inspect_json(tmp_path / "s", capsys)
        writer.commit({"step": 8})
        again = _inspect_json(tmp_path / "s", capsys)
    assert "uncommitted" not in [a["key"] for a in data["arrays"]]
    assert (data["generation"], again["generation"]) == (1, 2)
    assert again["meta"] == {"step": 8}
    assert "uncommitted" in [a["key"] for a in again["arrays"]]


def test_not_a_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(tmp_path / "absent")]) == 2
    assert "is not a folder" in capsys.readouterr().err
