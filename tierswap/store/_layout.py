"""The on-disk layout: a zarr v3 group whose arrays hold one tensor each.

```
ROOT/zarr.json                  group; attributes.tierswap = {format, generation, meta, durable}
ROOT/<key>/zarr.json            1-D array of the tensor's elements, plain ``bytes`` codec,
                                attributes.tierswap = {dtype, shape, chunk_bytes, crc32c: [...]}
ROOT/<key>/c/<i>                chunk i: raw little-endian bytes, padded with zeros to chunk_bytes
ROOT/<a>/zarr.json              a group for every proper prefix of a key
ROOT/.tierswap/zarr.json        tierswap's private group (lock, staging, journal live here)
```
A store on several folders (one per drive) keeps that layout in its first folder, the *home*;
an array whose chunks live in other folders names the folder of each chunk in a top-level
``tierswap_folders`` field, and chunk ``i`` of folder ``f`` is ``FOLDER_f/<key>/c/<i>``. Paths
inside any folder are written *qualified* (:func:`qualify`): plain for the home,
``.tierswap/folder-<f>/<path>`` for folder ``f``, which is also where a snapshot taken into a
single folder nests folder ``f``.

This module only builds and parses those documents and paths; it does no I/O.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tierswap.config import ALIGN, round_up
from tierswap.errors import CorruptionError, InvalidTensorError
from tierswap.store._dtypes import dtype_from_name, dtype_name, zarr_data_type, zarr_fill_value

__all__ = [
    "FOLDERS_FIELD",
    "FORMAT_VERSION",
    "INTERNAL_DIR",
    "NESTED_PREFIX",
    "ArrayInfo",
    "ArrayMeta",
    "array_document",
    "chunk_relpath",
    "group_document",
    "locate",
    "nested_folder",
    "parse_array_document",
    "parse_root_document",
    "qualify",
    "root_document",
    "split_qualified",
]

FORMAT_VERSION = 1
INTERNAL_DIR = ".tierswap"
_TAG = "tierswap"
#: Top-level field of an array whose chunks are not all in the home folder: zarr's
#: ``must_understand`` rule makes zarr-python refuse it instead of reading zeros.
FOLDERS_FIELD = "tierswap_folders"
#: Name prefix of a folder nested in the home's private folder (a snapshot into one folder).
NESTED_PREFIX = "folder-"
_FOLDER_PREFIX = f"{INTERNAL_DIR}/{NESTED_PREFIX}"


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
    """What :meth:`SwapStore.info` reports about one stored tensor."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    chunk_bytes: int
    nchunks: int


@dataclasses.dataclass(frozen=True)
class ArrayMeta:
    """Everything needed to find, read and verify one stored tensor."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunk_bytes: int
    crcs: tuple[int, ...] = ()
    #: The folder of each chunk (store folders, home = 0); empty: every chunk is in the home.
    folders: tuple[int, ...] = ()

    def folder_of(self, index: int) -> int:
        """The folder holding chunk ``index``."""
        return self.folders[index] if self.folders else 0

    def chunk_qualified(self, index: int) -> str:
        """Qualified path (:func:`qualify`) of chunk ``index``."""
        return qualify(self.folder_of(index), chunk_relpath(self.key, index))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def nchunks(self) -> int:
        return -(-self.nbytes // self.chunk_bytes)

    def payload(self, index: int) -> tuple[int, int]:
        """(offset, length) of chunk ``index``'s bytes within the flat tensor."""
        start = index * self.chunk_bytes
        return start, min(self.chunk_bytes, self.nbytes - start)

    def chunk_span(self, start: int, stop: int) -> range:
        """Indices of the chunks holding elements ``[start, stop)`` (empty for an empty range)."""
        if stop <= start:
            return range(0)
        itemsize = self.dtype.itemsize
        return range(start * itemsize // self.chunk_bytes, -(-stop * itemsize // self.chunk_bytes))

    def info(self) -> ArrayInfo:
        return ArrayInfo(
            self.key, self.dtype, self.shape, self.nbytes, self.chunk_bytes, self.nchunks
        )


def chunk_bytes_for(nbytes: int, max_chunk_bytes: int, itemsize: int) -> int:
    """Chunk size of a tensor: at most ``max_chunk_bytes``, whole pages, whole elements."""
    chunk = min(max_chunk_bytes, max(round_up(nbytes), ALIGN))
    if chunk % itemsize:  # only complex128 (16 B) can miss; ALIGN is a multiple of 16 anyway
        raise InvalidTensorError(f"itemsize {itemsize} does not divide chunk size {chunk}")
    return chunk


def chunk_relpath(key: str, index: int) -> str:
    """Path of chunk ``index`` relative to the root (zarr's default chunk key encoding)."""
    return f"{key}/c/{index}"


def qualify(folder: int, rel: str) -> str:
    """The qualified form of path ``rel`` inside store folder ``folder``: ``rel`` itself in
    the home (folder 0), else ``.tierswap/folder-<folder>/<rel>`` (no key can start so)."""
    return rel if folder == 0 else f"{nested_folder(folder)}/{rel}"


def nested_folder(folder: int) -> str:
    """Where folder ``folder`` nests inside the home (a snapshot taken into one folder)."""
    return f"{_FOLDER_PREFIX}{folder}"


def split_qualified(qualified: str) -> tuple[int, str]:
    """Inverse of :func:`qualify`: ``(folder, path inside it)``."""
    if not qualified.startswith(_FOLDER_PREFIX):
        return 0, qualified
    number, _, rel = qualified.removeprefix(_FOLDER_PREFIX).partition("/")
    return int(number), rel


def locate(roots: Sequence[Path], qualified: str) -> Path:
    """The file a qualified path names, given the store's folders (home first)."""
    folder, rel = split_qualified(qualified)
    if folder >= len(roots):
        raise CorruptionError(
            f"path {qualified!r} names folder {folder} but the store has {len(roots)}"
        )
    return roots[folder] / rel


def array_document(meta: ArrayMeta) -> dict[str, Any]:
    """The zarr v3 ``zarr.json`` of ``meta``'s array."""
    doc = _plain_array_document(meta)
    if any(meta.folders):
        doc[FOLDERS_FIELD] = {"must_understand": True, "chunks": list(meta.folders)}
    return doc


def _plain_array_document(meta: ArrayMeta) -> dict[str, Any]:
    data_type = zarr_data_type(meta.dtype)
    storage_itemsize = meta.dtype.itemsize
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": [meta.numel],
        "data_type": data_type,
        "chunk_grid": {
            "name": "regular",
            "configuration": {"chunk_shape": [meta.chunk_bytes // storage_itemsize]},
        },
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": zarr_fill_value(data_type),
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
        "attributes": {
            _TAG: {
                "dtype": dtype_name(meta.dtype),
                "shape": list(meta.shape),
                "chunk_bytes": meta.chunk_bytes,
                "crc32c": list(meta.crcs),
            }
        },
        "storage_transformers": [],
    }


def parse_array_document(key: str, doc: Any) -> ArrayMeta:
    """Inverse of :func:`array_document`; raises :class:`CorruptionError` on a bad document."""
    try:
        attrs = doc["attributes"][_TAG]
        meta = ArrayMeta(
            key=key,
            dtype=dtype_from_name(attrs["dtype"]),
            shape=tuple(int(d) for d in attrs["shape"]),
            chunk_bytes=int(attrs["chunk_bytes"]),
            crcs=tuple(int(c) for c in attrs["crc32c"]),
            folders=tuple(int(f) for f in doc.get(FOLDERS_FIELD, {}).get("chunks", ())),
        )
        shape = doc.get("shape")
    except (KeyError, TypeError, ValueError, AttributeError, InvalidTensorError) as exc:
        raise CorruptionError(f"metadata of key {key!r} is damaged: {exc!r}") from exc
    sizes_ok = meta.chunk_bytes > 0 and meta.chunk_bytes % ALIGN == 0
    if not sizes_ok or any(d < 0 for d in meta.shape):
        raise CorruptionError(
            f"metadata of key {key!r} is inconsistent: chunk_bytes {meta.chunk_bytes}, "
            f"shape {list(meta.shape)}"
        )
    folders_ok = not meta.folders or (len(meta.folders) == meta.nchunks and min(meta.folders) >= 0)
    if len(meta.crcs) != meta.nchunks or shape != [meta.numel] or not folders_ok:
        raise CorruptionError(f"metadata of key {key!r} is inconsistent (chunks, sizes or shape)")
    return meta


def group_document(attributes: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"zarr_format": 3, "node_type": "group", "attributes": attributes or {}}


def root_document(generation: int, meta: dict[str, Any], durable: bool) -> dict[str, Any]:
    tag = {"format": FORMAT_VERSION, "generation": generation, "meta": meta, "durable": durable}
    return group_document({_TAG: tag})


def parse_root_document(doc: Any) -> tuple[int, dict[str, Any], bool]:
    """(generation, meta, durable) of a root document; a plain zarr group reads as generation 0."""
    try:
        tag = doc["attributes"].get(_TAG)
        if tag is None:
            return 0, {}, True
        if tag["format"] != FORMAT_VERSION:
            raise CorruptionError(
                f"store format {tag['format']} is not supported by this tierswap "
                f"(format {FORMAT_VERSION}); upgrade tierswap"
            )
        return int(tag["generation"]), dict(tag["meta"]), bool(tag["durable"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CorruptionError(f"root metadata is damaged: {exc!r}") from exc
