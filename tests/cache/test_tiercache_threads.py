"""Many threads at once, and the asyncio API."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch

from tierswap import LookaheadPolicy, TierCache

from .conftest import LoggingStore

PAGE = 4096
ITEM = PAGE // 4
KEYS = [f"t{i}" for i in range(12)]


def _fill(store: LoggingStore) -> None:
    for i, key in enumerate(KEYS):
        store.put(key, torch.full((ITEM,), float(i)))


@pytest.mark.parametrize("policy", ["lru", "lookahead", "scheduled"])
def test_many_threads_get_put_prefetch(logged: LoggingStore, policy: str) -> None:
    _fill(logged)
    chosen: Any = LookaheadPolicy(schedule=KEYS) if policy == "scheduled" else policy
    cache = TierCache(logged, device_budget=2 * PAGE, host_budget=4 * PAGE, policy=chosen)
    peak = {"device": 0, "host": 0}
    errors: list[BaseException] = []
    locks = {key: threading.Lock() for key in KEYS}
    adds = dict.fromkeys(KEYS, 0)

    def watch(kind: str, key: str) -> None:
        stats = cache.stats()
        peak["device"] = max(peak["device"], stats.device.used)
        peak["host"] = max(peak["host"], stats.host.used)

    logged.on_io = watch

    def worker(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        try:
            for _ in range(60):
                i = int(torch.randint(len(KEYS), (1,), generator=gen))
                key, op = KEYS[i], int(torch.randint(4, (1,), generator=gen))
                tier = ("device", "host", None)[seed % 3]
                if op == 0:
                    cache.prefetch(KEYS[i : i + 3], tier="host")
                elif op == 1:
                    with locks[key], cache.pinned(key, tier=tier, dirty=True) as t:
                        t.add_(1)
                        adds[key] += 1
                else:
                    with locks[key]:
                        got = cache.get(key, tier=tier).cpu().clone()
                        expected = float(i + adds[key])
                    assert torch.all(got == expected), (key, got[0], expected)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors[0]
    cache.flush()
    for i, key in enumerate(KEYS):
        assert torch.all(logged.get(key) == float(i + adds[key]))
    assert peak["device"] <= 2 * PAGE
    assert peak["host"] <= 4 * PAGE
    cache.close()


def test_asyncio_api_never_blocks_the_loop(logged: LoggingStore) -> None:
    _fill(logged)
    cache = TierCache(logged, device_budget=0, host_budget=4 * PAGE)

    async def main() -> None:
        gate = threading.Event()
        logged.gate = gate
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while not gate.is_set():
                ticks += 1
                if ticks == 5:
                    gate.set()  # only runs if the loop is free while aget waits
                await asyncio.sleep(0)

        await cache.aprefetch(KEYS[:2], tier="host")
        got, _ = await asyncio.wait_for(
            asyncio.gather(cache.aget(KEYS[1], tier="host"), ticker()), timeout=60
        )
        assert ticks >= 5
        torch.testing.assert_close(got, torch.full((ITEM,), 1.0))
        logged.gate = None
        await cache.aput("new/a", torch.ones(3), tier="host")
        torch.testing.assert_close(await cache.aget("new/a"), torch.ones(3))
        results = await asyncio.gather(*(cache.aget(k, tier="host") for k in KEYS))
        for i, t in enumerate(results):
            assert t[0].item() == float(i)

    asyncio.run(main())
    cache.close()


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["lru", "lookahead"])
def test_stress_many_threads_long(logged: LoggingStore, policy: str) -> None:
    """The same mix for much longer, 16 threads, tiny budgets (run with -m slow)."""
    _fill(logged)
    cache = TierCache(logged, device_budget=PAGE, host_budget=2 * PAGE, policy=policy)
    errors: list[BaseException] = []
    totals = dict.fromkeys(KEYS, 0)
    guard = threading.Lock()

    def worker(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        try:
            for _ in range(400):
                key = KEYS[int(torch.randint(len(KEYS), (1,), generator=gen))]
                tier = ("device", "host", None)[seed % 3]
                cache.prefetch([key], tier="host")
                with cache.pinned(key, tier=tier) as t:
                    with guard:
                        t.add_(1)
                        totals[key] += 1
                    cache.mark_dirty(key)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors[0]
    cache.close()
    for i, key in enumerate(KEYS):
        assert torch.all(logged.get(key) == float(i + totals[key]))
