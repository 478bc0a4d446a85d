"""How torch dtypes map onto zarr v3 data types.

Dtypes zarr knows natively (bool, ints, uints, float16/32/64, complex64/128) are stored as
themselves. Every other torch dtype (bfloat16, the float8 family, complex32, ...) is stored as the
unsigned integer of the same width; the torch dtype's name in the array attributes says how to view
the bytes again. Data is little-endian on disk, as the ``bytes`` codec declares.
"""

from __future__ import annotations

import sys

import torch

from tierswap.errors import InvalidTensorError

__all__ = ["dtype_from_name", "dtype_name", "zarr_data_type", "zarr_fill_value"]

_NATIVE = {
    torch.bool: "bool",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint8: "uint8",
    torch.uint16: "uint16",
    torch.uint32: "uint32",
    torch.uint64: "uint64",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.complex64: "complex64",
    torch.complex128: "complex128",
}
_UINT_BY_WIDTH = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}
_UNSUPPORTED = {"qint8", "quint8", "qint32", "quint4x2", "quint2x4"}

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
    raise ImportError("tierswap stores raw little-endian bytes and needs a little-endian host")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; raises for dtypes whose bytes cannot be stored."""
    name = str(dtype).removeprefix("torch.")
    if name in _UNSUPPORTED or (dtype not in _NATIVE and dtype.itemsize not in _UINT_BY_WIDTH):
        raise InvalidTensorError(
            f"dtype {dtype} cannot be stored; convert it (e.g. dequantize) before put()"
        )
    return name


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidTensorError(f"unknown torch dtype {name!r} in store metadata")
    return dtype


def zarr_data_type(dtype: torch.dtype) -> str:
    """The zarr v3 ``data_type`` the bytes of ``dtype`` are stored as."""
    dtype_name(dtype)
    return _NATIVE.get(dtype) or _UINT_BY_WIDTH[dtype.itemsize]


def zarr_fill_value(data_type: str) -> object:
    """A zero ``fill_value`` in the JSON form zarr v3 expects for ``data_type``."""
    if data_type == "bool":
        return False
    if data_type.startswith("complex"):
        return [0.0, 0.0]
    if data_type.startswith("float"):
        return 0.0
    return 0
