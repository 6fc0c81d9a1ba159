"""ThreadGovernor: a CPU rank's intra-op thread count, lowered while other processes want its cores.

A CPU rank runs one intra-op thread per core of its share, and every parallel region (each linear
layer, the experts, the LM head: ~30 per decode step of a 4-layer MoE model) ends at a barrier
that waits for its slowest thread. When another process is busy on the same cores, the scheduler
takes a core from one thread for milliseconds at a time while the other spins at the barrier, so
the step only advances while every thread runs at once. Measured on a 2-core machine with a test
suite running beside it (load average 3.4): the Qwen3-30B-A3B-shaped MoE benchmark model's bf16
decode step took 240 ms on two threads against 98 ms on one (49 ms on two, quiet).

So each rank, before a step, at most every ``interval`` seconds, reads how much CPU time other
processes used on its cores since the last look (``/proc/stat``'s busy time of the CPUs it may run
on, minus its own CPU time) and moves its thread count by one:

* down, when the others took more than ``DOWN`` of a core beyond the cores its threads leave
  free (a thread then shares a core, and the barriers wait for it);
* up, when the others used less than ``UP`` of a core beyond what one thread more would
  leave them (a core is free again).

The margins differ so that a load near the edge does not flip the count every interval. Never
above the rank's share (less what ``ModelRunner.lend_cores`` lent), never below one. The
kernels' sums do not depend on the thread count (each output's arithmetic is fixed), so neither
do the results. ``TPSERVE_THREAD_GOVERNOR=0`` keeps the share's count.
"""
from __future__ import annotations

import os
import time
from typing import Callable

DOWN = 0.4  # cores others used beyond the free ones: one thread fewer
UP = 0.25  # cores others used beyond those one thread more leaves: below it, one more
INTERVAL_S = 0.5


def enabled() -> bool:
    """Whether ranks govern their thread count (``TPSERVE_THREAD_GOVERNOR``, default on)."""
    return os.environ.get("TPSERVE_THREAD_GOVERNOR", "1") != "0"


def read_busy_seconds(cpus: frozenset[int] | None) -> float | None:
    """CPU seconds spent busy (everything but idle and iowait, steal included: the hypervisor's
    use of the core) on ``cpus`` (all when None) since boot, from ``/proc/stat``; None where it
    cannot be read."""
    try:
        with open("/proc/stat") as f:
            text = f.read()
    except OSError:
        return None
    ticks = 0
    for line in text.splitlines():
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        name, *fields = line.split()
        try:
            cpu = int(name[3:])
        except ValueError:
            continue
        if cpus is not None and cpu not in cpus:
            continue
        values = [int(v) for v in fields[:8]]
        ticks += sum(values) - values[3] - values[4]  # idle, iowait
    return ticks / _CLK_TCK


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _allowed_cpus() -> frozenset[int] | None:
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


class ThreadGovernor:
    """Chooses a rank's thread count from the CPU time other processes use (module docstring).

    ``tick()`` before each step returns the count to run with; it looks again only after
    ``interval`` seconds. The readers are parameters so that tests can drive it.
    """

    def __init__(self, max_threads: int, *, interval: float = INTERVAL_S,
                 busy: Callable[[], float | None] | None = None,
                 own: Callable[[], float] = time.process_time,
                 clock: Callable[[], float] = time.monotonic, cpus: int | None = None):
        allowed = _allowed_cpus()
        self.cpus = cpus if cpus is not None else (len(allowed) if allowed else (os.cpu_count() or 1))
        self._busy = busy if busy is not None else (lambda: read_busy_seconds(allowed))
        self._own, self._clock = own, clock
        self.interval = interval
        self.max_threads = max(1, int(max_threads))
        self.threads = self.max_threads
        self.others = 0.0  # cores other processes used over the last interval
        self._last = self._sample()

    def _sample(self):
        busy = self._busy()
        return None if busy is None else (self._clock(), busy, self._own())

    def set_max(self, max_threads: int) -> int:
        """A new ceiling (the rank's share less lent cores), and the count for now: the ceiling
        (the next look lowers it again if the others still use the cores)."""
        self.max_threads = self.threads = max(1, int(max_threads))
        return self.threads

    def tick(self) -> int:
        """The thread count for the next step (changed by at most one per interval)."""
        if self._last is None:
            return self.threads
        now = self._clock()
        if now - self._last[0] < self.interval:
            return self.threads
        cur = self._sample()
        if cur is None:
            self._last = None
            return self.threads
        wall = cur[0] - self._last[0]
        others = max(0.0, (cur[1] - self._last[1]) - (cur[2] - self._last[2])) / wall
        self._last, self.others = cur, others
        free = self.cpus - self.threads  # cores this rank's threads leave to others
        if self.threads > 1 and others > free + DOWN:
            self.threads -= 1
        elif self.threads < self.max_threads and others < free - 1 + UP:
            self.threads += 1
        return self.threads
