"""Swap keys from parameter names: ``transformer.h.0.attn.c_attn.weight/exp_avg``.

A parameter name becomes one key segment. Names are module paths (``a.b.weight``) and almost
always valid as they are; the few characters and names the key rules refuse are
percent-escaped, reversibly (:func:`name_of` undoes it):

- ``%`` itself, ``/``, ``\\`` and control characters become ``%XX`` (their UTF-8 bytes in hex);
- a whole segment that is reserved (``.``, ``..``, ``zarr.json``, ``.tierswap``) or is the
  optimizer's own group ``optim`` gets its first character escaped (``%2E.``, ``%6Fptim``);
- a name longer than a segment may be (200 bytes) keeps its first 150 bytes and a ``~`` plus
  12 hex digits of its SHA-1: not reversible from the key alone, so every commit also records
  the full names in its metadata (``names``), which :func:`name_of` is not needed for.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence
from urllib.parse import unquote

from tierswap.errors import ConfigError
from tierswap.keys import MAX_SEGMENT_BYTES, RESERVED_SEGMENTS

__all__ = ["check_unique", "key_prefix", "name_of"]

#: Segments tierswap's optimizer uses itself (its small-state blob lives under ``optim/``).
_OWN = frozenset({"optim"})
_KEEP_BYTES = 150


def key_prefix(name: str) -> str:
    """The key segment of parameter ``name`` (see the module docstring)."""
    escaped = "".join(_escape(c) for c in name)
    if escaped in RESERVED_SEGMENTS | _OWN | {".", ".."}:
        escaped = _escape(escaped[0], force=True) + escaped[1:]
    if len(escaped.encode("utf-8")) > MAX_SEGMENT_BYTES:
        digest = hashlib.sha1(name.encode("utf-8", "surrogatepass")).hexdigest()[:12]
        head = escaped.encode("utf-8")[:_KEEP_BYTES].decode("utf-8", "ignore")
        escaped = f"{head}~{digest}"
    return escaped


def name_of(prefix: str) -> str:
    """The parameter name of a key segment made by :func:`key_prefix` (not for shortened
    names: those are in the commit's ``names``)."""
    return unquote(prefix)


def _escape(char: str, *, force: bool = False) -> str:
    if force or char in "%/\\" or ord(char) < 32 or ord(char) == 127:
        return "".join(f"%{byte:02X}" for byte in char.encode("utf-8", "surrogatepass"))
    return char


def check_unique(prefixes: Sequence[str]) -> None:
    """Raise :class:`ConfigError` when two parameters would share a key (one name twice)."""
    twice = sorted(p for p, count in Counter(prefixes).items() if count > 1)
    if twice:
        raise ConfigError(
            f"parameter names {[name_of(p) for p in twice]} occur twice; name each parameter "
            "once, e.g. pass model.named_parameters() of one model"
        )
