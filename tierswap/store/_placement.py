"""Which folder holds which chunk, in a store on several folders (one per drive).

Chunks are striped over the folders in proportion to their weights (their measured bandwidth,
``tierswap bench --dir A --dir B --tune F``; equal without one): the weights become a short
cyclic *pattern* of folder indices in which folder ``f`` appears in proportion to its weight,
interleaved (smooth weighted round robin), and chunk ``i`` of key ``k`` goes to
``pattern[(crc32(k) + i) % len(pattern)]``. Consecutive chunks of a tensor thus land on
different drives, and keys with one chunk spread over the drives too.

The rule only chooses where a chunk is written; each array records the folder of every chunk
(:attr:`~tierswap.store._layout.ArrayMeta.folders`), so a reader needs no rule and a store
keeps working when the weights change.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path

from tierswap.errors import ConfigError

__all__ = ["PATTERN_SLOTS", "Placement", "folder_weights"]

#: Length of the pattern the weights are rounded to (a weight counts in 64ths of the total).
PATTERN_SLOTS = 64


class Placement:
    """Where new chunks go, for folders with the given ``weights`` (positive numbers).

    Thread safety: immutable after construction.
    """

    def __init__(self, weights: Sequence[float]) -> None:
        self.weights = tuple(float(w) for w in weights)
        self.pattern = _pattern(self.weights)

    def folders(self, key: str, nchunks: int) -> tuple[int, ...]:
        """The folder of each of ``nchunks`` chunks of ``key``; ``()`` when all are the home's."""
        if len(self.weights) == 1:
            return ()
        start = zlib.crc32(key.encode("utf-8", "surrogatepass"))
        size = len(self.pattern)
        placed = tuple(self.pattern[(start + i) % size] for i in range(nchunks))
        return placed if any(placed) else ()


def _pattern(weights: tuple[float, ...]) -> tuple[int, ...]:
    """Folder indices, each as often as its share of :data:`PATTERN_SLOTS` (at least once),
    spread evenly: at each slot the folder furthest behind its share comes next."""
    total = sum(weights)
    counts = [max(1, round(PATTERN_SLOTS * w / total)) for w in weights]
    size = sum(counts)
    pattern: list[int] = []
    credit = [0] * len(counts)
    for _slot in range(size):
        for f, count in enumerate(counts):
            credit[f] += count
        best = max(range(len(counts)), key=lambda f: credit[f])
        credit[best] -= size
        pattern.append(best)
    return tuple(pattern)


def folder_weights(roots: Sequence[Path], measured: Mapping[str, float]) -> list[float]:
    """The weight of each folder of ``roots`` from ``measured`` (folder -> weight, as
    ``tierswap bench --tune`` writes them): the entry of the folder itself or of the closest
    folder above it, else of a measured folder on the same filesystem. Equal weights when
    nothing is measured; a folder without a weight beside measured ones is a ConfigError."""
    if len(roots) == 1 or not measured:
        return [1.0] * len(roots)
    weights = [_weight_of(root, measured) for root in roots]
    missing = [str(root) for root, w in zip(roots, weights, strict=True) if w is None]
    if missing:
        raise ConfigError(
            f"the I/O config holds measured weights for {sorted(measured)} but none for the "
            f"store folders {missing}; measure every folder of the store together: "
            f"tierswap bench {' '.join(f'--dir {r}' for r in roots)} --tune F"
        )
    return [float(w) for w in weights if w is not None]


def _weight_of(root: Path, measured: Mapping[str, float]) -> float | None:
    root = root.resolve()
    above = [Path(d) for d in measured if root == Path(d) or root.is_relative_to(Path(d))]
    if above:
        return measured[str(max(above, key=lambda d: len(d.parts)))]
    device = _device(root)
    for folder, weight in measured.items():
        if device is not None and _device(Path(folder)) == device:
            return weight
    return None


def _device(path: Path) -> int | None:
    """The filesystem of ``path`` (of its closest existing parent); ``None`` if unknown."""
    for candidate in (path, *path.parents):
        try:
            return os.stat(candidate).st_dev
        except OSError:
            continue
    return None
