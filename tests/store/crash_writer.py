"""Child process for the crash tests: commits generation after generation until killed.

Generation ``g`` holds a deterministic set of keys (see :func:`expected`), so the parent can
check the reopened store against the exact state of whichever generation survived.
"""

from __future__ import annotations

import sys

import torch

import tierswap as ts

KEYS = 6


def expected(generation: int) -> dict[str, torch.Tensor]:
    """The full contents of the store at ``generation``."""
    state = {}
    for i in range(KEYS):
        if generation == 0 or (generation + i) % 4 == 0:
            continue  # deleted (or never written) at this generation
        numel = 1000 + ((generation * 7 + i * 13) % 50) * 512
        gen = torch.Generator().manual_seed(generation * 100 + i)
        state[f"layer{i % 2}/k{i}"] = torch.randn(numel, generator=gen)
    return state


def main(path: str, start: int) -> None:
    with ts.SwapStore(path, chunk_bytes="8KiB", io=ts.IOConfig(block_bytes="4KiB")) as store:
        generation = store.generation
        assert generation == start, (generation, start)
        while True:
            generation += 1
            state = expected(generation)
            for key in store:
                if key not in state:
                    store.delete(key)
            for key, value in state.items():
                store.put(key, value)
            store.commit({"gen": generation})
            print(generation, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
