"""The prefetch queues of :class:`~tierswap.TierCache`: explicit ``prefetch`` calls and the
policy's read-ahead.

Private to :mod:`tierswap.cache`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

from tierswap.cache._core import CacheCore
from tierswap.cache._tiers import LOADING, READY, Entry, Meta
from tierswap.tiers import DEVICE, HOST, TierName

# Outcomes of one prefetch attempt: started (or nothing to do); started, more to do later;
# waiting for write-backs it started; cannot get room yet.
_DONE, _PENDING, _WAITING, _BLOCKED = "done", "pending", "waiting", "blocked"
# Read-ahead looks at most this many scheduled items (or a tier's worth of bytes) per access.
_MAX_AHEAD = 256

Item = tuple[str, TierName]


class Prefetcher:
    """Keys to read ahead, in order, and the planning that starts what room allows.

    Two queues: ``explicit`` (from :meth:`TierCache.prefetch`, kept until done) and the
    read-ahead (the policy's ``upcoming()`` after each access, consumed lazily, replaced by the
    next access). :meth:`plan` never waits: a prefetch without room yet stays queued, and the
    pump plans again when I/O completes. Every method runs under the cache's lock, on the
    :class:`CacheCore` given."""

    def __init__(self) -> None:
        self.explicit: list[Item] = []
        self._auto: list[Item] = []
        self._auto_iter: Iterator[Item] | None = None
        self._meta_wanted: set[str] = set()

    def queued(self) -> set[str]:
        """The keys either queue holds."""
        return {k for k, _ in self.explicit} | {k for k, _ in self._auto}

    def add(self, keys: Iterable[str], tier: TierName) -> None:
        queued = set(self.explicit)
        self.explicit.extend((k, tier) for k in keys if (k, tier) not in queued)

    def follow(self, upcoming: Iterable[str], tier: TierName) -> None:
        """Read ahead ``upcoming`` (the policy's next keys) into ``tier`` from now on."""
        self._auto = []
        self._auto_iter = ((k, tier) for k in upcoming)

    def drop(self, key: str) -> None:
        self.explicit = [item for item in self.explicit if item[0] != key]
        self._auto = [item for item in self._auto if item[0] != key]

    def plan(self, core: CacheCore) -> None:
        """Start what the queues allow now (never waits), then free room nobody wants."""
        self.explicit = self._run_queue(core, self.explicit, None)
        budget = core.tiers[HOST].budget + core.tiers[DEVICE].budget
        self._auto = self._run_queue(core, self._auto, self._auto_iter, budget)
        core.release_unwanted(self.queued())

    def _run_queue(
        self, core: CacheCore, queue: list[Item], more: Iterator[Item] | None, budget: int = 0
    ) -> list[Item]:
        """Try the items of ``queue`` (then of ``more``, up to ``budget`` bytes) in order;
        the items left to do."""
        kept: list[Item] = []
        seen = looked = 0
        items = itertools.chain(queue, more) if more is not None else iter(queue)
        for item in items:
            outcome = self._try(core, *item)
            if outcome != _DONE:
                kept.append(item)
            if outcome == _WAITING and more is None:
                continue  # explicit prefetches: the next may evict for itself meanwhile
            if outcome in (_BLOCKED, _WAITING):
                kept.extend(itertools.islice(items, len(queue)))  # keep the queued rest
                break
            meta = core.meta.get(item[0])
            seen += meta.footprint if meta else 0
            looked += 1
            if more is not None and (seen > budget or looked >= _MAX_AHEAD):
                break
        return kept

    def _try(self, core: CacheCore, key: str, tier: TierName) -> str:
        """One prefetch of ``key`` into ``tier``: its outcome."""
        meta = core.meta.get(key)
        if meta is None:
            self._want_meta(core, key)
            return _BLOCKED
        if meta.footprint > core.tiers[tier].budget:
            return _DONE  # too large for the tier: it skips the tier, so skip it here
        entry = core.find(key)
        if entry is not None:
            return self._try_move(core, entry, tier)
        if key in core.write_backs:
            return _BLOCKED
        return self._try_load(core, key, meta, tier)

    @staticmethod
    def _try_move(core: CacheCore, entry: Entry, tier: TierName) -> str:
        if entry.tier in (tier, DEVICE):
            return _DONE
        if entry.state == LOADING or (entry.claims and not entry.pins):
            # being read in, or held for a caller: the tensor handed out must stay the entry's
            return _PENDING
        if entry.pins or entry.state != READY:
            return _DONE
        core.policy.admit(entry.key)
        if core.move(entry, tier, prefetch=True):
            return _DONE
        return _WAITING if core.tiers[tier].coming(entry.key, entry.size) else _BLOCKED

    @staticmethod
    def _try_load(core: CacheCore, key: str, meta: Meta, tier: TierName) -> str:
        """Read ``key`` in: into host when it fits there (moved up when used), else ``tier``."""
        load_tier: TierName = HOST if meta.footprint <= core.tiers[HOST].budget else tier
        core.policy.admit(key)
        if not core.reserve(load_tier, meta.footprint, key, prefetch=True):
            return _WAITING if core.tiers[load_tier].coming(key, meta.footprint) else _BLOCKED
        core.new_loading(key, meta, load_tier)
        return _DONE if load_tier == tier else _PENDING

    def _want_meta(self, core: CacheCore, key: str) -> None:
        """Look ``key`` up in the store outside the lock, then plan prefetches again."""
        if key in self._meta_wanted:
            return
        self._meta_wanted.add(key)

        def lookup() -> None:
            meta = core.stored_meta(key)  # None: a scheduled key the store lacks, never read
            with core.cv:
                self._meta_wanted.discard(key)
                if meta is None:
                    self.drop(key)
                else:
                    core.meta.setdefault(key, meta)
                core.gate.wake()

        core.gate.defer(lookup)
