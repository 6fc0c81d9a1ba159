"""WaitingQueue: the scheduler's ``waiting`` sequences, read and changed like the seed's deque.

The seed keeps one deque: a new request is appended at the back, a preempted one goes back to
the front (``appendleft``), admission takes the front. Under the scheduling order ``fcfs`` that
is exactly what this queue is.

Under ``priority`` there is one such deque per priority value, and the queue reads as their
concatenation, best (lowest) value first. So admission takes the earliest arrival of the best
priority, and a preempted sequence goes back to the front of its own priority's queue: its
place, since within one priority a preempted sequence arrived before every sequence still
waiting (the seed's argument for ``appendleft``). With every priority equal the two orders are
the same queue.

``num_tokens`` is the sum of ``len(seq)`` over the queue, kept as sequences come and go, so
the admission limits of ``Scheduler.add`` cost O(1). A waiting sequence's length does not
change (only running ones get tokens).
"""
from __future__ import annotations

import bisect
from collections import deque
from typing import Iterator


class WaitingQueue:
    """Waiting sequences in admission order (see the module docstring)."""

    __slots__ = ("by_priority", "_queues", "_keys", "_len", "num_tokens")

    def __init__(self, by_priority: bool = False):
        self.by_priority = by_priority
        self._queues: dict[int, deque] = {}   # priority (0 for all under fcfs) -> the seed's deque
        self._keys: list[int] = []            # the priorities that have a queue, ascending
        self._len = 0
        self.num_tokens = 0

    def _key(self, seq) -> int:
        return seq.priority if self.by_priority else 0

    def _queue(self, seq) -> deque:
        key = self._key(seq)
        q = self._queues.get(key)
        if q is None:
            q = self._queues[key] = deque()
            bisect.insort(self._keys, key)
        return q

    def _drop_if_empty(self, key: int) -> None:
        if not self._queues[key]:
            del self._queues[key]
            del self._keys[bisect.bisect_left(self._keys, key)]

    # ---- reading -------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator:
        for key in self._keys:
            yield from self._queues[key]

    def __getitem__(self, i: int):
        """``[0]`` is the next sequence to admit; other indices walk the queue (O(n))."""
        if i == 0 and self._keys:
            return self._queues[self._keys[0]][0]
        return list(self)[i]

    def __repr__(self) -> str:
        return f"WaitingQueue({list(self)!r})"

    # ---- changing ------------------------------------------------------------------------
    def append(self, seq) -> None:
        """A new arrival: the back of its priority's queue."""
        self._queue(seq).append(seq)
        self._len += 1
        self.num_tokens += len(seq.token_ids)

    def appendleft(self, seq) -> None:
        """A preempted sequence: the front of its priority's queue."""
        self._queue(seq).appendleft(seq)
        self._len += 1
        self.num_tokens += len(seq.token_ids)

    def popleft(self):
        key = self._keys[0]
        seq = self._queues[key].popleft()
        self._drop_if_empty(key)
        self._len -= 1
        self.num_tokens -= len(seq.token_ids)
        return seq

    def remove(self, seq) -> None:
        key = self._key(seq)
        self._queues[key].remove(seq)
        self._drop_if_empty(key)
        self._len -= 1
        self.num_tokens -= len(seq.token_ids)
