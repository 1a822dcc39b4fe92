"""A bounded in-memory store of Responses API responses (``store: true``), for
``GET``/``DELETE /v1/responses/{id}``, ``previous_response_id`` and cancellation.

Eviction: least recently used first. The store holds at most ``capacity`` responses; storing
one more evicts the response stored or read (GET, or as a ``previous_response_id``) least
recently. A response still generating is never evicted (it counts toward the capacity only
once it ends). Everything is lost when the server stops.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from typing import Any

__all__ = ["ResponseStore", "StoredResponse"]


@dataclasses.dataclass
class StoredResponse:
    """A response object (OpenAI's shape) and the conversation it continues, as chat
    messages: the input of every turn up to and including its own, then its output (a
    later request with ``previous_response_id`` starts from these)."""

    body: dict[str, Any]
    messages: list[dict[str, Any]]
    request_id: str  # the engine request, while generating (cancel aborts it)
    ended: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._done: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()
        self._running: dict[str, StoredResponse] = {}

    def __len__(self) -> int:
        return len(self._done) + len(self._running)

    def start(self, response_id: str, entry: StoredResponse) -> None:
        """A response that is generating (GET shows it in progress; cancel may abort it)."""
        self._running[response_id] = entry

    def finish(self, response_id: str, body: dict[str, Any], messages: list[dict]) -> None:
        """The response ended: keep it (evicting the least recently used beyond capacity)."""
        entry = self._running.pop(response_id, None)
        if entry is None:  # deleted while generating
            return
        entry.body, entry.messages = body, messages
        entry.ended.set()
        self._done[response_id] = entry
        while len(self._done) > self.capacity:
            self._done.popitem(last=False)

    def abandon(self, response_id: str) -> None:
        """A generating response that failed: keep nothing."""
        entry = self._running.pop(response_id, None)
        if entry is not None:
            entry.ended.set()

    def get(self, response_id: str) -> StoredResponse | None:
        if response_id in self._running:
            return self._running[response_id]
        entry = self._done.get(response_id)
        if entry is not None:
            self._done.move_to_end(response_id)
        return entry

    def running(self, response_id: str) -> bool:
        return response_id in self._running

    def delete(self, response_id: str) -> bool:
        found = self._done.pop(response_id, None) or self._running.pop(response_id, None)
        return found is not None
