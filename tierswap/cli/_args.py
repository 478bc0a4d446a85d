"""argparse converters: sizes and comma-separated lists, with messages that say the fix."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from tierswap.config import parse_size
from tierswap.errors import ConfigError

__all__ = ["choice_list", "int_list", "positive_int", "size", "size_list"]


def size(text: str) -> int:
    """A size such as ``1GiB`` or ``4096`` (bytes)."""
    try:
        return parse_size(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _items(text: str) -> list[str]:
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise argparse.ArgumentTypeError(f"{text!r} has an empty item; write e.g. 1,2,4")
    return items


def size_list(text: str) -> list[int]:
    """Comma-separated sizes, e.g. ``1MiB,8MiB``; duplicates dropped, order kept."""
    return list(dict.fromkeys(size(item) for item in _items(text)))


def positive_int(text: str) -> int:
    """An int >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


def int_list(text: str) -> list[int]:
    """Comma-separated ints in 1..256, e.g. ``1,2,4,8`` (thread counts)."""
    values = [positive_int(item) for item in _items(text)]
    for value in values:
        if value > 256:
            raise argparse.ArgumentTypeError(f"{value} threads is over the limit of 256")
    return list(dict.fromkeys(values))


def choice_list(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """A converter for comma-separated names from ``choices``."""

    def convert(text: str) -> list[str]:
        items = _items(text)
        unknown = [item for item in items if item not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(unknown)}; choose from {','.join(choices)}"
            )
        return list(dict.fromkeys(items))

    convert.__name__ = "list"
    return convert
