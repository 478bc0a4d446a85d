"""The compact formats' C kernels (``_kernels.c``): built once per machine, loaded with ctypes.

Why C: torch's eager ops take a dozen passes over each piece for the 8-bit encoder and
single-thread their gathers, and split a master into remainders through strided int16 views,
so on the CPU the compact step was bound by its codec (``bench/codec.py``). The kernels do the
same arithmetic in one pass, bit for bit (the tests compare both), on the step's share of
torch's threads (:func:`tierswap._threads.kernel_threads`), and ctypes releases the GIL while
they run.

Built on first use with the system's C compiler (:func:`build_command`) into
``$TIERSWAP_CACHE_DIR`` (default ``$XDG_CACHE_HOME/tierswap`` or ``~/.cache/tierswap``), under
a name that hashes the source, the compiler and the flags, and published with an atomic
rename, so ranks that build at once each get a whole file. Where no compiler works, one
:class:`RuntimeWarning` says so and the formats stay on torch's ops (and CUDA tensors always
do). ``TIERSWAP_NATIVE=0`` turns the kernels off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from tierswap._threads import kernel_threads

__all__ = [
    "Kernels",
    "build",
    "build_command",
    "cache_dir",
    "for_tensors",
    "kernels",
    "library_path",
]

_SOURCE = Path(__file__).with_name("_kernels.c")
_FLAGS = ("-O3", "-shared", "-fPIC", "-pthread")
_BUILD_SECONDS = 120


class Kernels:
    """The loaded kernels. The callers (``_quant8``, ``_remainder``) check the arguments and
    pass contiguous CPU tensors of the right dtypes and sizes: the kernels trust them."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        ptr, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        signatures = {
            "tierswap_encode_8bit": [ptr, i64, i64, ptr, ptr, ptr, c_int],
            "tierswap_decode_8bit": [ptr, ptr, i64, i64, ptr, ptr, c_int],
            "tierswap_split": [ptr, i64, ptr, ptr, c_int],
            "tierswap_join": [ptr, ptr, i64, ptr, c_int],
        }
        self._fns: dict[str, Any] = {}
        for name, argtypes in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, None
            self._fns[name] = fn

    def encode_8bit(
        self,
        x: torch.Tensor,
        offsets: torch.Tensor,
        codes: torch.Tensor,
        absmax: torch.Tensor,
        block_size: int,
    ) -> None:
        """``codes`` and ``absmax`` of flat fp32 ``x`` (``offsets``: ``_code_offsets``)."""
        self._fns["tierswap_encode_8bit"](
            x.data_ptr(), x.numel(), block_size, offsets.data_ptr(), codes.data_ptr(),
            absmax.data_ptr(), kernel_threads(),
        )  # fmt: skip

    def decode_8bit(
        self,
        codes: torch.Tensor,
        absmax: torch.Tensor,
        qmap: torch.Tensor,
        out: torch.Tensor,
        block_size: int,
    ) -> None:
        """fp32 values of ``codes`` and ``absmax`` under the 256-entry ``qmap`` into ``out``."""
        self._fns["tierswap_decode_8bit"](
            codes.data_ptr(), absmax.data_ptr(), codes.numel(), block_size, qmap.data_ptr(),
            out.data_ptr(), kernel_threads(),
        )  # fmt: skip

    def split(
        self, master: torch.Tensor, param_bits: torch.Tensor, remainder: torch.Tensor | None
    ) -> None:
        """bf16 bits of fp32 ``master`` rounded half up into int16 ``param_bits``, and its
        lower halves into int16 ``remainder`` when given."""
        rem = 0 if remainder is None else remainder.data_ptr()
        self._fns["tierswap_split"](
            master.data_ptr(), master.numel(), param_bits.data_ptr(), rem, kernel_threads()
        )

    def join(self, param_bits: torch.Tensor, remainder: torch.Tensor, out: torch.Tensor) -> None:
        """fp32 ``out`` with bits ``(param_bits << 16) + remainder``."""
        self._fns["tierswap_join"](
            param_bits.data_ptr(),
            remainder.data_ptr(),
            out.numel(),
            out.data_ptr(),
            kernel_threads(),
        )


def cache_dir() -> Path:
    """Where built kernels are kept (see the module docstring)."""
    if folder := os.environ.get("TIERSWAP_CACHE_DIR"):
        return Path(folder)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tierswap"


def build_command(output: Path) -> list[str]:
    """The compiler command that builds ``_kernels.c`` into ``output``: ``$CC`` when set, else
    the compiler Python was built with if it is on this machine (a conda build names one that
    often is not), else ``cc``."""
    compiler = os.environ.get("CC")
    if not compiler:
        built_with = shlex.split(sysconfig.get_config_var("CC") or "")
        compiler = shlex.join(built_with) if built_with and shutil.which(built_with[0]) else "cc"
    return [*shlex.split(compiler), *_FLAGS, "-o", str(output), str(_SOURCE)]


def library_path() -> Path:
    """The built kernels' file for this source, compiler, flags and machine."""
    key = hashlib.sha256(_SOURCE.read_bytes())
    key.update(repr((build_command(Path("out")), platform.machine())).encode())
    return cache_dir() / f"kernels-{key.hexdigest()[:16]}.so"


def build(target: Path) -> None:
    """Compiles into a temporary file beside ``target`` and renames it into place (whole or
    not at all; the temporary file is removed either way)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=".building-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            build_command(Path(name)),
            check=False,
            capture_output=True,
            text=True,
            timeout=_BUILD_SECONDS,
        )
        if done.returncode:
            lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
            raise OSError(next((line for line in lines if "error" in line), lines[-1]))
        os.replace(name, target)
    finally:
        Path(name).unlink(missing_ok=True)


@functools.cache
def kernels() -> Kernels | None:
    """The kernels, built if need be; ``None`` (after one warning) where they cannot be, or
    where ``TIERSWAP_NATIVE=0``."""
    if os.environ.get("TIERSWAP_NATIVE", "1") == "0":
        return None
    try:
        target = library_path()
        if not target.exists():
            build(target)
        return Kernels(ctypes.CDLL(str(target)))
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        command = " ".join(build_command(cache_dir() / "kernels.so"))
        warnings.warn(
            f"tierswap could not build its C kernels ({command}: "
            f"{exc or type(exc).__name__}); state_precision='8bit' and master='remainder' run "
            "on torch's ops, 1.4-4x slower on the CPU. Install a C compiler (or set CC), point "
            "TIERSWAP_CACHE_DIR at a writable folder, or set TIERSWAP_NATIVE=0 to silence this.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def for_tensors(*tensors: torch.Tensor) -> Kernels | None:
    """The kernels where they may take these tensors (they read raw host pointers): all on
    the CPU; ``None`` otherwise, or where :func:`kernels` is."""
    return kernels() if all(t.device.type == "cpu" for t in tensors) else None
