"""Test doubles of SwapStore and TierCache that follow their documented contracts.

They let the optimizer's tests run against a known-simple cache: LRU over two tiers, hard
budgets (checked on every change), write-back of dirty items on eviction, pinning, counters.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
from collections import OrderedDict
from pathlib import Path

import torch

from tierswap.errors import BudgetError, KeyNotFoundError, StoreLockedError


class FakeStore:
    def __init__(self, path, mode="a", durable=True):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.path / "lock", "a+")  # noqa: SIM115
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            self._lock.close()
            raise StoreLockedError(f"{self.path} is in use") from exc
        self.generation, self.meta, self._data = 0, {}, {}
        snapshot = self.path / "snapshot.pt"
        if mode == "a" and snapshot.exists():
            saved = torch.load(snapshot, weights_only=True)
            self.generation, self.meta, self._data = saved["gen"], saved["meta"], saved["data"]
        self.reads = self.writes = 0

    def put(self, key, tensor):
        self._data[key] = tensor.detach().to("cpu", copy=True)
        self.writes += 1

    def get(self, key, out=None):
        if key not in self._data:
            raise KeyNotFoundError(key)
        self.reads += 1
        value = self._data[key].clone()
        return out.copy_(value) if out is not None else value

    def delete(self, key):
        self._data.pop(key, None)

    def keys(self):
        return list(self._data)

    def __contains__(self, key):
        return key in self._data

    def commit(self, meta=None):
        self.generation += 1
        self.meta = dict(meta or {})
        buffer = io.BytesIO()
        torch.save({"gen": self.generation, "meta": self.meta, "data": self._data}, buffer)
        tmp = self.path / "snapshot.pt.partial"
        tmp.write_bytes(buffer.getvalue())
        os.replace(tmp, self.path / "snapshot.pt")
        return self.generation

    def stats(self):
        return {"reads": self.reads, "writes": self.writes}

    def close(self):
        self._lock.close()


class FakeCache:
    """LRU over ``host`` (and ``device`` when its budget is > 0); checks budgets always."""

    def __init__(self, store, *, device_budget, host_budget, device=None, policy="lru"):
        self.store = store
        self.budget = {"device": device_budget, "host": host_budget}
        self.items = {"device": OrderedDict(), "host": OrderedDict()}  # key -> [tensor, dirty]
        self.pins = {"device": {}, "host": {}}
        self.nvme_reads = self.nvme_writes = self.bytes_read = self.bytes_written = 0
        self.max_used = {"device": 0, "host": 0}

    def _used(self, tier):
        return sum(t.nbytes for t, _ in self.items[tier].values())

    def _make_room(self, tier, nbytes):
        if nbytes > self.budget[tier]:
            raise BudgetError(f"{nbytes} bytes do not fit the {tier} budget")
        while self._used(tier) + nbytes > self.budget[tier]:
            victim = next((k for k in self.items[tier] if not self.pins[tier].get(k)), None)
            if victim is None:
                raise BudgetError(f"{tier} is full of pinned items")
            self._evict_from(tier, victim)

    def _evict_from(self, tier, key):
        tensor, dirty = self.items[tier].pop(key)
        if dirty:
            self.store.put(key, tensor)
            self.nvme_writes += 1
            self.bytes_written += tensor.nbytes

    def _insert(self, tier, key, tensor, dirty):
        self._make_room(tier, tensor.nbytes)
        self.items[tier][key] = [tensor, dirty]
        self.max_used[tier] = max(self.max_used[tier], self._used(tier))
        assert self._used(tier) <= self.budget[tier]

    def _locate(self, key):
        for tier in ("device", "host"):
            if key in self.items[tier]:
                return tier
        return None

    def put(self, key, tensor, tier=None):
        tier = tier or "host"
        self.delete(key)
        self._insert(tier, key, tensor.detach().to("cpu", copy=True), True)

    def get(self, key, tier="host"):
        where = self._locate(key)
        if where == tier:
            self.items[tier].move_to_end(key)
            return self.items[tier][key][0]
        if where is None:
            if key not in self.store:
                raise KeyNotFoundError(key)
            tensor, dirty = self.store.get(key), False
            self.nvme_reads += 1
            self.bytes_read += tensor.nbytes
        else:
            tensor, dirty = self.items[where].pop(key)
        self._insert(tier, key, tensor, dirty)
        return tensor

    def prefetch(self, keys, tier="host"):
        for key in keys:
            with contextlib.suppress(BudgetError):
                self.get(key, tier)

    @contextlib.contextmanager
    def pinned(self, key, tier="host"):
        tensor = self.get(key, tier)
        self.pins[tier][key] = self.pins[tier].get(key, 0) + 1
        try:
            yield tensor
        finally:
            self.pins[tier][key] -= 1

    def mark_dirty(self, key):
        self.items[self._locate(key)][key][1] = True

    def delete(self, key):
        where = self._locate(key)
        if where is not None:
            self.items[where].pop(key)
        self.store.delete(key)

    def flush(self):
        for tier in ("device", "host"):
            for key, item in self.items[tier].items():
                if item[1]:
                    self.store.put(key, item[0])
                    self.nvme_writes += 1
                    self.bytes_written += item[0].nbytes
                    item[1] = False

    def stats(self):
        tiers = {
            tier: {"used": self._used(tier), "budget": self.budget[tier]}
            for tier in ("device", "host")
        }
        nvme = {"bytes_read": self.bytes_read, "bytes_written": self.bytes_written}
        return {**tiers, "nvme": nvme, "stall_seconds": 0.0}

    def close(self):
        self.items = {"device": OrderedDict(), "host": OrderedDict()}
