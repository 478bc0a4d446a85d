"""A custom eviction policy for tests: keys carry a number; odd-numbered keys go first."""

from __future__ import annotations

from collections.abc import Collection


def number(key: str) -> int:
    """The number a key carries: ``"s3"`` and ``"3"`` are 3."""
    return int(key.lstrip("s"))


class KeepEven:
    """Evicts the lowest odd-numbered key, and an even one (the highest) only when no odd one
    is left: a policy that is neither LRU nor Belady, to show a user's policy is honoured."""

    def access(self, key: str) -> None: ...

    def admit(self, key: str) -> None: ...

    def forget(self, key: str) -> None: ...

    def upcoming(self) -> list[str]:
        return []

    def victim(self, candidates: Collection[str], incoming: str | None) -> str | None:
        odd = sorted((k for k in candidates if number(k) % 2), key=number)
        return odd[0] if odd else max(candidates, key=number)
