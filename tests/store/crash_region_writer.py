"""Child process for the crash tests of region writes: generation after generation of region
writes into one large key (whole and partial chunks, in recycled files), until killed.

Generation ``g`` is the result of replaying the region writes of generations 1..g on zeros
(see :func:`expected`), so the parent can check the reopened store exactly.
"""

from __future__ import annotations

import random
import sys

import torch

import tierswap as ts

NUMEL = 12 * 2048  # twelve 8 KiB chunks of float32
WRITES = 4


def regions(generation: int) -> list[tuple[int, torch.Tensor]]:
    """The region writes of ``generation``: (start, values)."""
    rng = random.Random(generation)
    out = []
    for _ in range(WRITES):
        start = rng.randrange(NUMEL)
        stop = min(NUMEL, start + rng.randrange(1, 3 * 2048))
        out.append((start, torch.full((stop - start,), float(generation))))
    return out


def expected(generation: int) -> dict[str, torch.Tensor]:
    """The full contents of the store at ``generation``."""
    if generation == 0:
        return {}
    value = torch.zeros(NUMEL)
    for g in range(1, generation + 1):
        for start, piece in regions(g):
            value[start : start + piece.numel()] = piece
    return {"x": value}


def main(path: str, start: int) -> None:
    with ts.SwapStore(path, chunk_bytes="8KiB", io=ts.IOConfig(block_bytes="4KiB")) as store:
        generation = store.generation
        assert generation == start, (generation, start)
        if "x" not in store:
            store.create("x", (NUMEL,), torch.float32)
        while True:
            generation += 1
            for start_, piece in regions(generation):
                store.put_region("x", start_, piece)
            store.commit({"gen": generation})
            print(generation, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
