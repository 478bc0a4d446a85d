"""Argument converters and the CLI's usage errors."""

from __future__ import annotations

import argparse

import pytest

from tierswap.cli import _args, main


def test_size_accepts_bytes_and_units() -> None:
    assert _args.size("4096") == 4096
    assert _args.size("8MiB") == 8 << 20
    assert _args.size_list("1MiB, 8MiB,1MiB") == [1 << 20, 8 << 20]


@pytest.mark.parametrize("text", ["12XB", "-5", "MiB"])
def test_size_rejects_garbage(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="size"):
        _args.size(text)


def test_int_lists() -> None:
    assert _args.int_list("1,2,4,2") == [1, 2, 4]
    for bad in ("0", "1,,2", "x", "300"):
        with pytest.raises(argparse.ArgumentTypeError):
            _args.int_list(bad)


def test_choice_list_names_the_unknown_item() -> None:
    convert = _args.choice_list(("direct", "zarr"))
    assert convert("zarr,direct") == ["zarr", "direct"]
    with pytest.raises(argparse.ArgumentTypeError, match="unknown hdf5; choose from direct,zarr"):
        convert("zarr,hdf5")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "--size", "lots"], "does not parse as a size"),
        (["bench", "--engine", "mmap"], "unknown mmap"),
        (["bench", "--threads", "0"], ">= 1"),
        (["bench", "--repeat", "-1"], ">= 1"),
        ([], "required"),
    ],
)
def test_usage_errors_exit_2_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err
