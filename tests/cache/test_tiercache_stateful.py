"""Hypothesis state machine: the cache against a dict model, with random budgets and policies."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tests.cache.books import assert_books_balance
from tierswap import SwapStore, TierCache
from tierswap.cache._tiers import footprint
from tierswap.errors import BudgetError, KeyNotFoundError

PAGE = 4096
KEYS = st.sampled_from(["a", "b/c", "d", "e"])
TIERS = st.sampled_from([None, "host", "device"])
# float32 lengths: under a page, exactly one, a page and a bit, three pages
LENGTHS = st.sampled_from([10, 1024, 1100, 3072])


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="tierswap-sm-"))
        self.store = SwapStore(self.dir / "s", mode="w", durable=False, chunk_bytes="8KiB")
        self.model: dict[str, torch.Tensor] = {}
        self.cache: TierCache | None = None
        self.counter = 0

    @initialize(
        device_pages=st.integers(0, 3),
        host_pages=st.integers(1, 4),
        policy=st.sampled_from(["lru", "lookahead"]),
    )
    def start(self, device_pages: int, host_pages: int, policy: str) -> None:
        self.budgets = {"device": device_pages * PAGE, "host": host_pages * PAGE}
        self.cache = TierCache(
            self.store,
            device_budget=self.budgets["device"],
            host_budget=self.budgets["host"],
            policy=policy,
        )

    def _fits(self, key: str, tier: str | None) -> bool:
        size = footprint(self.model[key].numel() * 4)
        if tier is None:
            return any(b > 0 and size <= b for b in self.budgets.values())
        return self.budgets[tier] > 0 and size <= self.budgets[tier]

    @rule(key=KEYS, length=LENGTHS, tier=st.sampled_from([None, "host", "device", "nvme"]))
    def put(self, key: str, length: int, tier: str | None) -> None:
        self.counter += 1
        value = torch.arange(length, dtype=torch.float32) + 10_000 * self.counter
        size = footprint(length * 4)
        if tier in ("host", "device") and not 0 < size <= self.budgets[tier]:
            with pytest.raises(BudgetError):
                self.cache.put(key, value, tier=tier)
            return
        self.cache.put(key, value, tier=tier)
        self.model[key] = value.clone()

    @rule(key=KEYS, tier=TIERS)
    def get(self, key: str, tier: str | None) -> None:
        if key not in self.model:
            with pytest.raises(KeyNotFoundError):
                self.cache.get(key, tier=tier)
            return
        if not self._fits(key, tier):
            with pytest.raises(BudgetError):
                self.cache.get(key, tier=tier)
            return
        got = self.cache.get(key, tier=tier)
        torch.testing.assert_close(got.cpu(), self.model[key], rtol=0, atol=0)

    @rule(key=KEYS, tier=TIERS)
    def modify_in_place(self, key: str, tier: str | None) -> None:
        if key not in self.model or not self._fits(key, tier):
            return
        with self.cache.pinned(key, tier=tier) as t:
            t.add_(1)
            self.cache.mark_dirty(key)
        self.model[key] += 1

    @rule(keys=st.lists(KEYS, max_size=4), tier=st.sampled_from(["host", "device"]))
    def prefetch(self, keys: list[str], tier: str) -> None:
        if not self.budgets[tier]:
            return
        if any(k not in self.model for k in keys):
            with pytest.raises(KeyNotFoundError):
                self.cache.prefetch(keys, tier=tier)
            return
        self.cache.prefetch(keys, tier=tier)

    @rule(key=KEYS)
    def evict(self, key: str) -> None:
        self.cache.evict(key)
        # not `where(key) is None`: a prefetch still queued may read the key back in at once
        if key in self.model:
            torch.testing.assert_close(self.store.get(key), self.model[key], rtol=0, atol=0)

    @rule(key=KEYS)
    def delete(self, key: str) -> None:
        if key not in self.model:
            with pytest.raises(KeyNotFoundError):
                self.cache.delete(key)
            return
        self.cache.delete(key)
        del self.model[key]

    @rule()
    def flush_and_check_store(self) -> None:
        self.cache.flush()
        assert sorted(self.store.keys()) == sorted(self.model)
        for key, value in self.model.items():
            torch.testing.assert_close(self.store.get(key), value, rtol=0, atol=0)

    @invariant()
    def budgets_hold(self) -> None:
        if self.cache is None:
            return
        with self.cache._cv:  # white-box: each ledger's count matches what the tiers hold
            assert_books_balance(self.cache, self.budgets)

    def teardown(self) -> None:
        try:
            if self.cache is not None:
                self.cache.close()
        finally:
            self.store.close()
            shutil.rmtree(self.dir, ignore_errors=True)


CacheMachine.TestCase.settings = settings(
    max_examples=30,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCacheMachine = CacheMachine.TestCase
