"""FairQueue: requests held in front of the engine, one queue per connection, taken in turn.

The engine's scheduler serves its waiting requests first come, first served. Were every
request added as it arrived, one connection that queues 20,000 requests would make every other
client wait behind all of them. The server instead adds requests only while the engine has
room for what it can start in its next step (``ServingEngine.has_room``); the rest wait here,
and ``pop`` takes the next one from each connection with waiting requests in turn, so a client
waits behind at most one request of each other client plus what the engine already holds.

Entries are keyed by the connection (any hashable) and carry the request's engine id;
``discard`` forgets one (aborted, or its connection dropped) without searching the queues.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any, Hashable


class FairQueue:
    """Round-robin over per-connection FIFOs. ``len`` counts the entries not discarded."""

    def __init__(self):
        self._queues: OrderedDict[Hashable, deque[str]] = OrderedDict()  # next connection first
        self._entries: dict[str, Any] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, engine_id: str) -> bool:
        return engine_id in self._entries

    def get(self, engine_id: str):
        return self._entries.get(engine_id)

    def entries(self) -> list:
        return list(self._entries.values())

    def push(self, key: Hashable, engine_id: str, entry) -> None:
        assert engine_id not in self._entries, engine_id
        self._entries[engine_id] = entry
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = deque()
        queue.append(engine_id)

    def pop(self):
        """The oldest entry of the connection whose turn it is (None when empty); that
        connection's turn comes again after every other connection's."""
        while self._queues:
            key, queue = next(iter(self._queues.items()))
            while queue:
                entry = self._entries.pop(queue.popleft(), None)
                if entry is not None:
                    if queue:
                        self._queues.move_to_end(key)
                    else:
                        del self._queues[key]
                    return entry
            del self._queues[key]  # only discarded entries were left
        return None

    def discard(self, engine_id: str) -> bool:
        """Forget an entry (its id stays in its connection's FIFO until ``pop`` skips it)."""
        return self._entries.pop(engine_id, None) is not None
