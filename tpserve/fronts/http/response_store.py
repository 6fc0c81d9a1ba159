"""The Responses API's store: the last N responses of one HTTP front, in memory, LRU.

``POST /v1/responses`` with ``store`` (OpenAI's default: true) keeps the response object and
the conversation that led to it (its input items, those of the responses it continued
included), so that ``GET /v1/responses/{id}`` returns it and ``previous_response_id`` continues
it. The store holds at most ``capacity`` responses (``--responses-store-size``); storing one
more evicts the least recently used (read or stored). An evicted, deleted or unknown id is a
404 (responses_api.py), as for an id OpenAI never issued. A capacity of 0 stores nothing.

A continued conversation shares its items with the one it continues (the lists are rebuilt,
the item maps are the same objects), so a chain of N turns costs N lists of references, not N
copies of its text. The store lives in the front's process: a restarted front (or another
replica) has an empty one.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

DEFAULT_CAPACITY = 1024


@dataclass
class Stored:
    """One stored response: the response object as returned, and the conversation that the
    model answered (every input item, in order, the continued responses' included; the
    instructions are not items: OpenAI does not carry them over to a continuation)."""

    response: dict
    input_items: list[dict]

    @property
    def conversation(self) -> list[dict]:
        """The items a continuation starts from: the input, then this response's output."""
        return self.input_items + self.response["output"]


class ResponseStore:
    """A bounded map of response id -> Stored, least recently used evicted first."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"the responses store size must be an integer >= 0, got {capacity!r}")
        self.capacity = capacity
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self.evicted = 0  # responses dropped to make room

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._items

    def put(self, response_id: str, response: dict, input_items: list[dict]) -> None:
        if self.capacity == 0:
            return
        self._items[response_id] = Stored(response, input_items)
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)
            self.evicted += 1

    def get(self, response_id: str) -> Stored | None:
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None
