"""RunningQueue: the scheduler's ``running`` sequences in admission order, with a version number.

Every change of the queue goes through :meth:`RunningQueue._changed`, which bumps ``version``.
Per-step views derived from the queue (the slot array and the token lists of the decode fast
path, the sampling arrays of a decode plan) are cached under that version, so there is exactly
one place where they can go stale and no caller has to remember to reset anything.

Reading it is like reading a deque (iteration, ``len``, indexing, truth value); the mutators
are the handful the scheduler uses.
"""
from __future__ import annotations

from collections import deque
from typing import Iterable, Iterator

import numpy as np


class RunningQueue:
    """Admission-ordered running sequences; ``version`` changes whenever the contents do."""

    __slots__ = ("_q", "version", "_views_version", "_slots", "_token_lists")

    def __init__(self):
        self._q: deque = deque()
        self.version = 0
        self._views_version = -1
        self._slots: np.ndarray | None = None
        self._token_lists: list | None = None

    def _changed(self) -> None:
        self.version += 1

    # ---- reading -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._q)

    def __bool__(self) -> bool:
        return bool(self._q)

    def __iter__(self) -> Iterator:
        return iter(self._q)

    def __getitem__(self, i):
        return self._q[i]

    def __repr__(self) -> str:
        return f"RunningQueue({list(self._q)!r}, version={self.version})"

    def _views(self) -> None:
        if self._views_version != self.version:
            q = self._q
            self._slots = np.fromiter((s.slot for s in q), dtype=np.intp, count=len(q))
            self._token_lists = [s.token_ids for s in q]
            self._views_version = self.version

    def slots(self) -> np.ndarray:
        """Slot of every sequence, in queue order (cached per version; do not write)."""
        self._views()
        return self._slots

    def token_lists(self) -> list:
        """``token_ids`` list of every sequence, in queue order (cached per version)."""
        self._views()
        return self._token_lists

    # ---- changing ------------------------------------------------------------------------
    def append(self, seq) -> None:
        self._q.append(seq)
        self._changed()

    def pop(self):
        seq = self._q.pop()
        self._changed()
        return seq

    def popleft(self):
        seq = self._q.popleft()
        self._changed()
        return seq

    def remove(self, seq) -> None:
        self._q.remove(seq)
        self._changed()

    def extendleft(self, seqs: Iterable) -> None:
        self._q.extendleft(seqs)
        self._changed()

    def replace(self, seqs: Iterable) -> None:
        """Make the queue hold ``seqs`` (in that order)."""
        self._q = deque(seqs)
        self._changed()
