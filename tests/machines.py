"""What the project's threaded state machines (engine, pipeline, cache faults) share: the
faults their store doubles inject, and their Hypothesis settings."""

from __future__ import annotations

import errno
import threading
from typing import Any

from hypothesis import HealthCheck, settings

__all__ = ["ArmedFaults", "InjectedFault", "raise_", "threaded_settings"]


def threaded_settings(max_examples: int, steps: int) -> settings:
    """Settings of a state machine whose rules start threads."""
    return settings(
        max_examples=max_examples,
        stateful_step_count=steps,
        deadline=None,
        # threads make replays inexact: shrinking one failure, not each, keeps a failing run short
        report_multiple_bugs=False,
        suppress_health_check=[HealthCheck.too_slow],
    )


class InjectedFault(OSError):  # noqa: N818 (a fault the test injects, named as such)
    """A failure a store double injects: which call (``kind``: ``"read"``, ``"write"``, or a
    kind of its own) and how (``mode``: ``"raise"`` from the call, ``"fail"`` a failed future,
    ``"late"`` the data landed, then the error)."""

    def __init__(self, code: int, kind: str, mode: str, key: str) -> None:
        super().__init__(code, f"injected {kind} failure ({mode}) of {key!r}")
        self.kind = kind
        self.mode = mode


class ArmedFaults:
    """The fault of the next read and of the next write of a store double: armed by the test,
    consumed by the first call of its kind that starts after (whatever its key), and kept in
    :attr:`fired`. A kind other than ``"read"`` takes the write fault. Thread-safe."""

    def __init__(self) -> None:
        self.read_fault: str | None = None
        self.write_fault: str | None = None
        self.fired: list[InjectedFault] = []
        self._lock = threading.Lock()

    def arm(self, kind: str, mode: str) -> None:
        """Fail the next read (``kind="read"``) or write the way ``mode`` says."""
        with self._lock:
            if kind == "read":
                self.read_fault = mode
            else:
                self.write_fault = mode

    def disarm(self) -> None:
        with self._lock:
            self.read_fault = self.write_fault = None

    def _take(self, kind: str, key: str) -> InjectedFault | None:
        """The fault armed for this call of ``kind``, consumed and recorded, or ``None``."""
        with self._lock:
            if kind == "read":
                mode, self.read_fault = self.read_fault, None
            else:
                mode, self.write_fault = self.write_fault, None
            if mode is None:
                return None
            fault = InjectedFault(errno.EIO if kind == "read" else errno.ENOSPC, kind, mode, key)
            self.fired.append(fault)
            return fault


def raise_(error: BaseException) -> Any:
    raise error
