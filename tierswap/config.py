"""Sizes and I/O settings: the leaf vocabulary every layer shares.

``parse_size`` accepts ints (bytes) and strings such as ``"512MiB"`` or ``"4GB"``.
``IOConfig`` holds the knobs of the I/O engine and, for stores on several folders, the measured
weight of each folder; ``tierswap bench --tune`` writes one to a JSON file that
``IOConfig.from_file`` (and the ``TIERSWAP_CONFIG`` environment variable) reads back.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from tierswap.errors import ConfigError

__all__ = ["ALIGN", "IOConfig", "format_size", "parse_size", "round_up"]

#: Alignment of O_DIRECT offsets, lengths and buffer addresses (a page; also zarr chunk unit).
ALIGN = 4096

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")

Size = int | str


def parse_size(value: Size, *, name: str = "size") -> int:
    """Return ``value`` in bytes; ints pass through, strings like ``"4GiB"`` are parsed."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} is not a size; pass bytes or a string like '4GiB'")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{name}={value} is negative; sizes are >= 0 bytes")
        return value
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ConfigError(
                f"{name}={value!r} does not parse as a size; "
                "use bytes or e.g. '512MiB', '4GiB', '2GB'"
            )
        return int(float(match.group(1)) * _UNITS[unit])
    raise ConfigError(f"{name}={value!r} has type {type(value).__name__}; pass an int or a str")


def format_size(nbytes: float) -> str:
    """Human-readable binary size, e.g. ``format_size(3 << 30) == '3.00 GiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024:
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.2f} TiB"


def round_up(n: int, multiple: int = ALIGN) -> int:
    """Smallest multiple of ``multiple`` that is >= ``n``."""
    return -(-n // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class IOConfig:
    """Settings of the I/O engine.

    Parameters
    ----------
    block_bytes:
        Size of one positional read or write request (a multiple of 4 KiB).
    threads:
        Worker threads in the I/O pool; each has one request in flight at a time.
    inflight:
        Most chunk requests queued or running at once; submitters block beyond it (backpressure).
    direct:
        ``"auto"`` probes O_DIRECT once per store and falls back to buffered I/O with
        ``posix_fadvise(DONTNEED)``; ``"on"`` requires it; ``"off"`` never uses it.
    weights:
        Folder -> weight (its measured bandwidth): a store on several folders spreads its
        chunks in proportion (a folder inside a measured one, or on the same filesystem,
        takes its weight). Empty: equal weights. A mapping, kept as sorted ``(folder, weight)``
        pairs; ``threads`` and ``inflight`` apply to each folder's own I/O queue.
    """

    block_bytes: int = 8 << 20
    threads: int = 8
    inflight: int = 64
    direct: Literal["auto", "on", "off"] = "auto"
    weights: Mapping[str, float] | tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        block = parse_size(self.block_bytes, name="block_bytes")
        object.__setattr__(self, "block_bytes", block)
        if block <= 0 or block % ALIGN:
            raise ConfigError(
                f"block_bytes={block} must be a positive multiple of {ALIGN}; try 8MiB"
            )
        if not isinstance(self.threads, int) or not 1 <= self.threads <= 256:
            raise ConfigError(f"threads={self.threads!r} must be an int in 1..256; try 4")
        if not isinstance(self.inflight, int) or self.inflight < self.threads:
            raise ConfigError(
                f"inflight={self.inflight!r} must be an int >= threads ({self.threads})"
            )
        if self.direct not in ("auto", "on", "off"):
            raise ConfigError(f"direct={self.direct!r} must be 'auto', 'on' or 'off'")
        object.__setattr__(self, "weights", _parse_weights(self.weights))

    @property
    def folder_weights(self) -> dict[str, float]:
        """:attr:`weights` as a dict (folder -> weight)."""
        return dict(self.weights)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if self.weights:
            data["weights"] = self.folder_weights
        else:
            del data["weights"]  # files without weights read as before
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> IOConfig:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise ConfigError(
                f"unknown IOConfig fields {unknown}; expected a subset of {sorted(fields)}"
            )
        return cls(**data)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> IOConfig:
        """Read a tune file written by ``tierswap bench --tune`` (JSON, ``{"io": {...}}``)."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read IO config file {str(path)!r}: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"IO config file {str(path)!r} must hold a JSON object")
        return cls.from_dict(data.get("io", data))

    def to_file(self, path: str | os.PathLike[str], **extra: Any) -> None:
        Path(path).write_text(json.dumps({"io": self.to_dict(), **extra}, indent=2) + "\n")

    @classmethod
    def default(cls) -> IOConfig:
        """The settings from ``$TIERSWAP_CONFIG`` when set, else the built-in defaults."""
        env = os.environ.get("TIERSWAP_CONFIG")
        return cls.from_file(env) if env else cls()


def _parse_weights(value: object) -> tuple[tuple[str, float], ...]:
    """Weights as sorted ``(folder, weight)`` pairs; raises ConfigError for a bad entry."""
    items = value.items() if isinstance(value, Mapping) else value
    try:
        pairs = [(str(folder), weight) for folder, weight in items]  # type: ignore[attr-defined]
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"weights={value!r} must map folders to weights, e.g. {{'/nvme0': 2.0, '/nvme1': 1.0}}"
        ) from exc
    for folder, weight in pairs:
        ok = isinstance(weight, (int, float)) and not isinstance(weight, bool)
        if not ok or not math.isfinite(weight) or weight <= 0:
            raise ConfigError(
                f"weight {weight!r} of folder {folder!r} must be a positive number "
                "(its measured bandwidth, or any number in proportion)"
            )
    return tuple(sorted((folder, float(weight)) for folder, weight in pairs))
