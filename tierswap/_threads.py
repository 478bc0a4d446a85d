"""The step's share of torch's CPU threads: half of them, the rest left to the I/O threads.

While slices step on the CPU, the I/O threads that read and write them need cores too (their
checksums, copies and system calls). An op split over every core then waits for the share
that finds none free: on the 2-core VM one thread ran GPT-2 4 x 1024's streamed step after
backward 8-18% faster than two, and the 8-bit C kernels 13-17% faster
(``docs/benchmarks.md``). So the step's C kernels take :func:`kernel_threads`, and a step that
``step()`` runs on its caller's thread, with slices streaming, runs its torch ops on as many
(:func:`step_threads`) where that cannot change their results. (A step of resident slices
has no I/O beside it, and keeps every thread.)

It can where an op reduces: torch's CPU reductions split their range by thread count, so a sum
over millions of elements rounds differently on one thread than on two (measured here). The
step must stay bitwise equal to the same torch optimizer in memory, which runs on every
thread, so only the steps of torch optimizers known to be elementwise get fewer threads
(:func:`elementwise`); tierswap's own slice work (casts, copies, gradient edits, the codecs)
is elementwise or takes exact maxima.

Why only on the caller's thread, with nothing of tierswap's computing beside it (not the
worker that steps in backward, or in the next forward): ``torch.set_num_threads`` sets more
than the calling thread's count, also MKL's for every thread and the count a thread that has
not run an op yet starts from, so it would slow autograd running beside the step.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterable, Iterator

import torch

__all__ = ["elementwise", "kernel_threads", "step_threads"]

#: torch optimizers whose step is elementwise on each tensor (exact types: a subclass may
#: override ``step`` with reductions): their results do not depend on the thread count.
ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.SGD,
    torch.optim.Adagrad,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.ASGD,
)

_lowered = threading.local()  # .base: the thread's count before step_threads lowered it


def kernel_threads() -> int:
    """Threads for the step's compute: half of torch's (of those the calling thread had
    before :func:`step_threads` lowered them), at least one."""
    base = getattr(_lowered, "base", None) or torch.get_num_threads()
    return max(1, base // 2)


def elementwise(optimizers: Iterable[torch.optim.Optimizer]) -> bool:
    """Whether every one of ``optimizers`` steps elementwise (:data:`ELEMENTWISE`)."""
    return all(type(opt) in ELEMENTWISE for opt in optimizers)


@functools.cache
def _openmp() -> bool:
    """Whether torch's CPU ops run on OpenMP (its wheels for Linux and Windows): elsewhere
    (the native pool) ``torch.set_num_threads`` after the first parallel op only warns."""
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


@contextlib.contextmanager
def step_threads(lower: bool) -> Iterator[None]:
    """Run torch's ops on :func:`kernel_threads` threads within the block when ``lower``
    (under OpenMP), restored after; a nested block keeps the outer one's count."""
    if not lower or not _openmp() or getattr(_lowered, "base", None) is not None:
        yield
        return
    base = torch.get_num_threads()
    _lowered.base = base
    try:
        torch.set_num_threads(kernel_threads())
        yield
    finally:
        torch.set_num_threads(base)
        _lowered.base = None
