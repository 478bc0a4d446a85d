"""Key vocabulary: what a key may look like, and how it maps to a path inside the store.

Keys are ``/``-separated names such as ``"model.layers.0.mlp.weight/exp_avg"``. A valid key can
never name a file outside the store: no empty, ``.`` or ``..`` segments, no absolute paths, no NUL
or control characters, and bounded lengths.
"""

from __future__ import annotations

from collections import Counter

from tierswap.errors import InvalidKeyError

__all__ = [
    "MAX_KEY_BYTES",
    "MAX_SEGMENT_BYTES",
    "RESERVED_SEGMENTS",
    "KeyHierarchy",
    "validate_key",
]

MAX_KEY_BYTES = 1024
MAX_SEGMENT_BYTES = 200  # leaves room under NAME_MAX (255) for temporary suffixes
#: Names that clash with the zarr layout or tierswap's own bookkeeping.
RESERVED_SEGMENTS = frozenset({"zarr.json", ".tierswap"})


def validate_key(key: object) -> str:
    """Return ``key`` when it is a valid store key, else raise :class:`InvalidKeyError`."""
    if not isinstance(key, str):
        raise InvalidKeyError(f"key {key!r} must be a str, not {type(key).__name__}")
    if not key:
        raise InvalidKeyError("key '' is empty; use a name like 'layer0/exp_avg'")
    if len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        raise InvalidKeyError(f"key {key[:40]!r}... is longer than {MAX_KEY_BYTES} bytes")
    bad = next((c for c in key if ord(c) < 32 or ord(c) == 127), None)
    if bad is not None:
        raise InvalidKeyError(f"key {key!r} contains control character {bad!r}; remove it")
    if key.startswith("/"):
        raise InvalidKeyError(f"key {key!r} is absolute; drop the leading '/'")
    for segment in key.split("/"):
        _validate_segment(key, segment)
    return key


def _validate_segment(key: str, segment: str) -> None:
    if segment == "":
        raise InvalidKeyError(f"key {key!r} has an empty segment ('//' or a trailing '/')")
    if segment in (".", ".."):
        raise InvalidKeyError(f"key {key!r} has a {segment!r} segment; keys cannot walk paths")
    if segment in RESERVED_SEGMENTS:
        raise InvalidKeyError(f"key {key!r} uses the reserved name {segment!r}; rename it")
    if "\\" in segment:
        raise InvalidKeyError(f"key {key!r} contains a backslash; use '/' between segments")
    if len(segment.encode("utf-8", "surrogatepass")) > MAX_SEGMENT_BYTES:
        raise InvalidKeyError(
            f"key {key!r} has a segment longer than {MAX_SEGMENT_BYTES} bytes; shorten it"
        )
    try:
        segment.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidKeyError(f"key {key!r} is not valid UTF-8 text") from exc


def _prefixes(key: str) -> list[str]:
    parts = key.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


class KeyHierarchy:
    """Live keys and the groups they imply, so a clash check costs O(depth), not O(keys).

    A key cannot be a tensor and a group at once (``"a"`` beside ``"a/b"``). A key may be live
    for several reasons at once (stored, and being overwritten): :meth:`add` and :meth:`remove`
    count them. Not thread-safe: the caller holds its own lock.
    """

    def __init__(self) -> None:
        self._refs: Counter[str] = Counter()
        self._groups: Counter[str] = Counter()  # group -> live keys below it

    def add(self, key: str) -> None:
        if not self._refs[key]:
            self._groups.update(_prefixes(key))
        self._refs[key] += 1

    def remove(self, key: str) -> None:
        self._refs[key] -= 1
        if self._refs[key] <= 0:
            del self._refs[key]
            for group in _prefixes(key):
                self._groups[group] -= 1
                if not self._groups[group]:
                    del self._groups[group]

    def check(self, key: str) -> None:
        """Raise :class:`InvalidKeyError` when ``key`` would clash with a live key."""
        for group in _prefixes(key):
            if self._refs[group]:
                raise InvalidKeyError(
                    f"key {key!r} would nest under the stored key {group!r}; "
                    "delete that key or choose another name"
                )
        if self._groups[key]:
            raise InvalidKeyError(
                f"key {key!r} is a group holding other keys; choose another name for the tensor"
            )
