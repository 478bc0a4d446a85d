"""When a SwapOptimizer commits: every N steps, or ``"auto"``, a bounded share of the time.

A commit makes the folder a restart point: it writes what the steps since the last commit left
only in memory (resident slices, scalars, the fp32 copy of parameters without a master) and
syncs. What that costs depends on the placement: next to nothing when every slice streams (the
streamed slices were written anyway), the whole resident state when it all stays in RAM. So a
fixed ``commit_every`` is either too rare for a streamed run or too costly for a resident one.

``"auto"`` (the default) commits when the time since the last commit reaches
``(1 / AUTO_SHARE - 1)`` times what the last commit cost, so commits take about
``AUTO_SHARE`` of the training time at most, whatever the placement. A crash then loses the
steps of about ``1 / AUTO_SHARE`` commit durations: for a streamed run that is every step or
two, for a 10 GB resident state on a 1 GB/s disk about a minute and a half.

A due commit of ``"auto"`` ends behind the next forward (:meth:`CommitClock.behind`) when that
forward leaves the CPU mostly idle, as it does when a GPU computes: its writes and the store's
sync then cost the step nothing. When the forward keeps the cores busy (a model computed on the
CPU), the commit's work would only slow it down, and more than it saves (torch's threads wait
for the slowest of them), so the commit ends within its step.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

__all__ = ["AUTO_SHARE", "BEHIND_BELOW", "CommitClock"]

#: The share of training time that ``commit_every="auto"`` lets commits take.
AUTO_SHARE = 0.1

#: A commit of ``"auto"`` ends behind the next forward when the process kept less than this
#: share of its cores busy between the last two steps measured (from the end of a step, or
#: of its commit, to the next step's start: the forward and the start of backward).
BEHIND_BELOW = 0.5


class CommitClock:
    """Decides, once per step, whether a step ends with a commit.

    ``every``: commit every that many steps (``0``: never by itself), or ``"auto"``. What a
    commit costs is measured as the commit's own time plus what its step took beyond the last
    step without one (the step before a commit also writes the parameters the commit needs).
    ``clock`` is the time source (seconds) and ``cpu`` the process's CPU time (seconds, all
    its threads; default :func:`time.process_time`), over ``cores`` cores (default: those the
    process may run on); replaceable in tests.
    """

    def __init__(
        self,
        every: int | str,
        clock: Callable[[], float] = time.monotonic,
        cpu: Callable[[], float] | None = None,
        cores: int | None = None,
    ) -> None:
        self.every = every
        self._clock = clock
        self._cpu = cpu or time.process_time
        self._cores = cores or _cores()
        self._since: tuple[float, float] | None = None  # (wall, cpu) the last step ended at
        #: The share of the cores the process kept busy between the last two steps measured
        #: (None: not measured yet).
        self.busy: float | None = None
        self._decided: tuple[int, bool] | None = None  # (step, due) of the step under way
        self._started = 0.0  # when the step under way was decided
        self._last_commit = clock()  # when the last commit ended (or the run started)
        self._cost: float | None = None  # seconds the last commit cost; None: none yet
        self._plain: float | None = None  # seconds of the last step without a commit
        self._due_step: float | None = None  # seconds of the last step with a commit

    def due(self, step: int) -> bool:
        """Whether step number ``step`` (1-based) ends with a commit; asked again for the same
        step, the same answer (hooks and ``step()`` both ask)."""
        if self._decided is not None and self._decided[0] == step:
            return self._decided[1]
        now = self._clock()
        self._measure(now)
        if isinstance(self.every, int):
            due = bool(self.every) and step % self.every == 0
        elif self._cost is None:
            due = True  # nothing measured yet
        elif self._plain is None:  # measure a step without a commit once, to price the params
            due = False
        else:  # the time the commit would end, had the step the length of the last one
            elapsed = now - self._last_commit + self._plain
            due = elapsed * AUTO_SHARE >= self._cost * (1 - AUTO_SHARE)
        self._decided, self._started = (step, due), now
        return due

    def stepped(self) -> None:
        """The slices of the step under way are done (its commit, if due, comes next)."""
        if self._decided is None:
            return
        now = self._clock()
        seconds = now - self._started
        if self._decided[1]:
            self._due_step = seconds
        else:
            self._plain = seconds
            self._since = (now, self._cpu())

    def behind(self) -> bool:
        """Whether the due commit of the step under way may end behind the next forward:
        with ``"auto"``, when the process left its cores mostly idle between the last two
        steps measured (:data:`BEHIND_BELOW`). Not measured yet: no. The forward it overlaps
        is not measured (the commit's own work would count): the next measure starts after a
        step without a commit, or after a commit that ends within its step."""
        return self.every == "auto" and self.busy is not None and self.busy < BEHIND_BELOW

    def committed(self, seconds: float, *, behind: bool = False) -> None:
        """A commit (due, or asked for) took ``seconds``; the interval starts again now.
        Unless it ended ``behind`` its step (its end is seen later, on whichever thread
        waits for it), the time up to the next step is measured from now."""
        extra = 0.0
        if self._due_step is not None and self._plain is not None:
            extra = max(self._due_step - self._plain, 0.0)
        self._cost = seconds + extra
        self._due_step = None
        self._last_commit = self._clock()
        if not behind:
            self._since = (self._last_commit, self._cpu())

    def _measure(self, now: float) -> None:
        """A step starts at ``now``: the share of the cores busy since the last one ended."""
        if self._since is None:
            return
        wall, cpu = now - self._since[0], self._cpu() - self._since[1]
        self._since = None
        if wall > 0:
            self.busy = cpu / (wall * self._cores)


def _cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1
