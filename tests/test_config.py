from __future__ import annotations

import pytest

from tierswap.config import IOConfig, format_size, parse_size, round_up
from tierswap.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (0, 0),
        (4096, 4096),
        ("4096", 4096),
        ("512MiB", 512 << 20),
        ("4GiB", 4 << 30),
        ("2GB", 2_000_000_000),
        ("1.5 KiB", 1536),
        ("8k", 8000),
    ],
)
def test_parse_size(text: int | str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "MiB", "4 parsecs", "-1", -5, 1.5, True, None])
def test_parse_size_rejects_with_named_value(bad: object) -> None:
    with pytest.raises(ConfigError, match="host_budget"):
        parse_size(bad, name="host_budget")  # type: ignore[arg-type]


def test_format_and_round_up() -> None:
    assert format_size(3 << 30) == "3.00 GiB"
    assert format_size(12) == "12 B"
    assert round_up(1) == 4096
    assert round_up(8192) == 8192
    assert round_up(0) == 0


def test_ioconfig_validates() -> None:
    assert IOConfig(block_bytes="1MiB").block_bytes == 1 << 20
    with pytest.raises(ConfigError, match="block_bytes"):
        IOConfig(block_bytes=1000)
    with pytest.raises(ConfigError, match="threads"):
        IOConfig(threads=0)
    with pytest.raises(ConfigError, match="inflight"):
        IOConfig(threads=8, inflight=2)
    with pytest.raises(ConfigError, match="direct"):
        IOConfig(direct="maybe")  # type: ignore[arg-type]


def test_ioconfig_file_round_trip(tmp_path, monkeypatch) -> None:
    config = IOConfig(block_bytes=4 << 20, threads=2, inflight=16, direct="off")
    path = tmp_path / "tune.json"
    config.to_file(path, measured={"write_gbps": 1.0})
    assert IOConfig.from_file(path) == config
    monkeypatch.setenv("TIERSWAP_CONFIG", str(path))
    assert IOConfig.default() == config
    path.write_text('{"io": {"threads": 2, "colour": "red"}}')
    with pytest.raises(ConfigError, match="colour"):
        IOConfig.from_file(path)
    with pytest.raises(ConfigError, match="cannot read"):
        IOConfig.from_file(tmp_path / "missing.json")
