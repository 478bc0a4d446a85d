"""The white-box check both cache state machines run: each tier's books match what it holds."""

from __future__ import annotations

from tierswap import TierCache


def assert_books_balance(cache: TierCache, budgets: dict[str, int]) -> None:
    """Each tier within its budget, and its ledger's count equal to its entries, write-backs
    and earmarks. The caller holds the cache's lock."""
    stats = cache.stats()
    assert stats.device.used <= budgets["device"]
    assert stats.host.used <= budgets["host"]
    for tier in cache._tiers.values():
        held = sum(e.size for e in tier.entries.values())
        assert tier.used == held + tier.writing + sum(tier.earmarks.values())
        assert tier.used == tier.ledger.used <= tier.ledger.budget
        assert tier.balanced()
        tier.check()
