"""Where chunks go in a store on several folders: the weighted stripe, and the weights that
``IOConfig`` (a ``tierswap bench --tune`` file) gives each folder."""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path

import pytest
import torch

from tierswap.config import IOConfig
from tierswap.errors import ConfigError
from tierswap.store._layout import ArrayMeta, locate, qualify, split_qualified
from tierswap.store._placement import PATTERN_SLOTS, Placement, folder_weights


def test_one_folder_places_nothing() -> None:
    assert Placement([1.0]).folders("k", 10) == ()


@pytest.mark.parametrize("weights", [[1, 1], [3, 1], [1, 2, 1], [10, 1, 1], [0.7, 0.3]])
def test_the_pattern_follows_the_weights_and_interleaves(weights: list[float]) -> None:
    placement = Placement(weights)
    counts = Counter(placement.pattern)
    total = sum(weights)
    for folder, weight in enumerate(weights):
        assert counts[folder] == pytest.approx(len(placement.pattern) * weight / total, abs=1)
    most = max(counts.values())
    longest_run = max(len(list(run)) for _f, run in itertools.groupby(placement.pattern))
    assert longest_run <= 2 * -(-most // (len(placement.pattern) - most))  # spread, not blocks


def test_consecutive_chunks_alternate_and_keys_start_apart() -> None:
    placement = Placement([1.0, 1.0])
    placed = placement.folders("model.layers.0/exp_avg", 8)
    assert len(placed) == 8
    assert all(a != b for a, b in itertools.pairwise(placed))
    firsts = Counter(placement.folders(f"p{i}/exp_avg", 1)[:1] or (0,) for i in range(200))
    assert min(firsts.values()) > 60  # one-chunk keys land on both folders


def test_placement_is_a_pure_function_of_key_and_weights() -> None:
    assert Placement([2, 1]).folders("a/b", 50) == Placement([2, 1]).folders("a/b", 50)
    assert len(Placement([1] * 5).pattern) <= PATTERN_SLOTS + 5


def test_qualified_paths_name_the_folder() -> None:
    roots = [Path("/home"), Path("/d1"), Path("/d2")]
    assert qualify(0, "k/c/0") == "k/c/0"
    assert split_qualified(qualify(2, "k/c/3")) == (2, "k/c/3")
    assert locate(roots, qualify(1, "k/c/0")) == Path("/d1/k/c/0")
    meta = ArrayMeta("k", torch.uint8, (3 * 4096,), 4096, folders=(0, 2, 1))
    assert [meta.folder_of(i) for i in range(3)] == [0, 2, 1]
    assert meta.chunk_qualified(0) == "k/c/0"
    assert meta.chunk_qualified(1) == ".tierswap/folder-2/k/c/1"


def test_weights_match_folders_by_path_then_filesystem(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    assert folder_weights([a, b], {}) == [1.0, 1.0]
    assert folder_weights([a / "run", b / "run"], {str(a): 2.0, str(b): 1.0}) == [2.0, 1.0]
    # a measured folder on the same filesystem stands in for an unmeasured one
    assert folder_weights([a / "run", tmp_path / "c"], {str(a): 2.0, str(b): 5.0}) == [2.0, 2.0]


def test_a_folder_without_a_weight_beside_measured_ones_is_refused(tmp_path: Path) -> None:
    measured = {"/proc": 1.0}  # another filesystem than tmp_path's
    with pytest.raises(ConfigError, match="tierswap bench --dir"):
        folder_weights([tmp_path / "a", tmp_path / "b"], measured)


def test_ioconfig_weights_round_trip_and_validation(tmp_path: Path) -> None:
    config = IOConfig(weights={"/b": 1.5, "/a": 2})
    assert config.weights == (("/a", 2.0), ("/b", 1.5))
    assert config.folder_weights == {"/a": 2.0, "/b": 1.5}
    config.to_file(tmp_path / "t.json")
    assert IOConfig.from_file(tmp_path / "t.json") == config
    assert "weights" not in IOConfig().to_dict()  # files without weights read as before
    for bad in ({"/a": 0}, {"/a": -1.0}, {"/a": float("nan")}, {"/a": "fast"}, 3):
        with pytest.raises(ConfigError, match="weight"):
            IOConfig(weights=bad)  # type: ignore[arg-type]
