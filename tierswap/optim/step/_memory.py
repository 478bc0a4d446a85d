"""The C library's allocator around a step: transients go back to the OS, the rest reuses.

Two settings of glibc's mmap threshold (allocations at least that large get a mapping of their
own, given back to the OS when freed; smaller ones come from the heap, whose freed memory is
kept and reused):

- **while a step runs**, :data:`STEP_MMAP_THRESHOLD` (1 MiB): the step's slice-sized transients
  (torch's temporaries of foreach kernels, the first step's new state, the decoded copies of a
  parameter stepped whole) leave at once when freed, so the step's memory stays within the host
  budget. With glibc's default, which raises the threshold to the largest mapped block freed so
  far (up to 32 MiB), they stayed in the heap: about 250 MiB above the budget for 40 parameters
  of 1M elements, measured here.
- **between steps** (the forward and backward passes), :data:`IDLE_MMAP_THRESHOLD` (32 MiB, the
  ceiling glibc's own threshold reaches): activations and gradients come from the heap and are
  reused every iteration instead of faulting in fresh pages. Keeping 1 MiB there cost GPT-2 124M
  about 0.15 s of its 1.25 s forward and backward (``docs/benchmarks.md``). Except while
  an optimizer streams parameters (:func:`hold_threshold`, :data:`STREAM_MMAP_THRESHOLD`):
  its parameters and gradients are allocated and freed module by module in forward and
  backward, and in the heap they stayed (2.9x its memory bound with 16 MiB parameters,
  measured here); smaller allocations, activations among them, stay in the heap, and
  ``step()`` of such an optimizer returns their free pages (:func:`trim_heap`) once backward
  is over: else what deep models freed there stayed (GPT-2 12 x 2560 in bf16: 3.0 GiB between
  steps, 2.1 with the trim; the third backward's peak 3.92 GiB, 3.8 with it; iterations no
  slower within this VM's noise, two interleaved runs each).

:func:`step_allocations` switches between them (nested and concurrent steps counted, so the
worker of ``overlap="forward"`` and ``step()`` may overlap). ``malloc_trim(0)`` returns whole free
pages after the first step, whose state is created and freed in slice-sized pieces; it costs well
under a millisecond. Outside glibc (musl, macOS) all of this does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import threading
from collections.abc import Callable, Iterator

__all__ = [
    "IDLE_MMAP_THRESHOLD",
    "STEP_MMAP_THRESHOLD",
    "STREAM_MMAP_THRESHOLD",
    "hold_threshold",
    "step_allocations",
    "trim_heap",
]

#: glibc's ``mallopt`` parameter number of the mmap threshold.
_M_MMAP_THRESHOLD = -3
#: While a step runs, allocations at least this large get their own mapping.
STEP_MMAP_THRESHOLD = 1 << 20
#: Between steps: glibc's ceiling for its dynamic threshold (``DEFAULT_MMAP_THRESHOLD_MAX``).
IDLE_MMAP_THRESHOLD = 32 << 20

_steps_lock = threading.Lock()
_steps_running = 0
#: Between steps while an optimizer streams parameters: its parameters and gradients of this
#: size or more leave when freed; activations and small tensors stay in the heap (1 MiB cost
#: GPT-2 4 x 1024 about 1 s of a 5 s iteration in page faults, measured here).
STREAM_MMAP_THRESHOLD = 8 << 20
_holds: list[int] = []  # the thresholds held between steps (optimizers streaming parameters)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


@functools.cache
def _mallopt() -> Callable[[int, int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return None


@contextlib.contextmanager
def step_allocations() -> Iterator[None]:
    """Run a step (or a part of one) under :data:`STEP_MMAP_THRESHOLD`; when the last step
    running ends, the threshold goes to :data:`IDLE_MMAP_THRESHOLD`."""
    global _steps_running
    with _steps_lock:
        _steps_running += 1
        if _steps_running == 1:
            _set_mmap_threshold(STEP_MMAP_THRESHOLD)
    try:
        yield
    finally:
        with _steps_lock:
            _steps_running -= 1
            if _steps_running == 0:
                _set_mmap_threshold(_idle_threshold())


def _idle_threshold() -> int:
    """The threshold between steps: the lowest held, else :data:`IDLE_MMAP_THRESHOLD`. The
    caller holds the lock."""
    return min(_holds, default=IDLE_MMAP_THRESHOLD)


def hold_threshold(nbytes: int = STREAM_MMAP_THRESHOLD) -> Callable[[], None]:
    """Keep the threshold at ``nbytes`` (or lower) between steps too, until the returned
    function is called (once; later calls do nothing): what streamed parameters and gradients
    need, which come and go in forward and backward."""
    with _steps_lock:
        _holds.append(nbytes)
        if _steps_running == 0:
            _set_mmap_threshold(_idle_threshold())
    released = False

    def release() -> None:
        nonlocal released
        with _steps_lock:
            if released:
                return
            released = True
            _holds.remove(nbytes)
            if _steps_running == 0:
                _set_mmap_threshold(_idle_threshold())

    return release


def _set_mmap_threshold(nbytes: int) -> None:
    mallopt = _mallopt()
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, nbytes)


def trim_heap() -> None:
    """Return free heap pages to the OS where the C library can (glibc); else do nothing."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
