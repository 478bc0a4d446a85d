"""Key vocabulary: what a key may look like, and how it maps to a path inside the store.

Keys are ``/``-separated names such as ``"model.layers.0.mlp.weight/exp_avg"``. A valid key can
never name a file outside the store: no empty, ``.`` or ``..`` segments, no absolute paths, no NUL
or control characters, and bounded lengths.
"""

from __future__ import annotations

from tierswap.errors import InvalidKeyError

__all__ = ["MAX_KEY_BYTES", "MAX_SEGMENT_BYTES", "RESERVED_SEGMENTS", "validate_key"]

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
