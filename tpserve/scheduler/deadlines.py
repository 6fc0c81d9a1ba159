"""Deadlines: when each unfinished request with a timeout must end.

A request with ``timeout`` gets ``seq.deadline`` (a ``time.monotonic()`` value, set by the
engine). The scheduler asks ``expired(now)`` at the start of every step, before scheduling, so
no batch is in flight then: it finishes those sequences with finish_reason "timeout" and frees
their blocks whatever their state (waiting, prefilling, decoding).

A heap of (deadline, arrival number, sequence), so a check costs O(1) when nothing expires and
O(log n) per expiry. Sequences that finish otherwise stay in the heap until their deadline or
a compaction (when more than half the entries are dead), so it never holds more than twice the
live ones plus a few.
"""
from __future__ import annotations

import heapq
import itertools


class Deadlines:
    """The deadlines of unfinished sequences (see the module docstring)."""

    __slots__ = ("_heap", "_counter", "live")

    def __init__(self):
        self._heap: list = []
        self._counter = itertools.count()
        self.live = 0  # entries whose sequence has not finished

    def add(self, seq) -> None:
        heapq.heappush(self._heap, (seq.deadline, next(self._counter), seq))
        self.live += 1

    def finished(self) -> None:
        """A sequence with a deadline finished (its entry is dead now)."""
        self.live -= 1
        heap = self._heap
        if len(heap) > 64 and len(heap) > 2 * self.live:
            self._heap = [e for e in heap if not e[2].is_finished]
            heapq.heapify(self._heap)

    def expired(self, now: float) -> list:
        """The unfinished sequences whose deadline is at or before ``now``, earliest first.
        They stay counted as live until ``finished`` is called for each."""
        heap = self._heap
        out = []
        while heap and heap[0][0] <= now:
            seq = heapq.heappop(heap)[2]
            if not seq.is_finished:
                out.append(seq)
        return out

    def __len__(self) -> int:
        return len(self._heap)
