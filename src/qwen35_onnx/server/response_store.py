"""Stored responses of the Responses API (``store: true``, the API's default): each keeps its conversation (the
chat messages of its input, after the stored conversation it continued, and its reply) and its response object,
so that ``previous_response_id`` continues it and ``GET`` / ``DELETE /v1/responses/{id}`` find it. The state the
reply left is kept where every route keeps states (the server's kept states, ``--state-cache-bytes``): a
continuation prefills only its new input while that state is kept.

Bounded by bytes (the conversations' and objects' JSON), least recently used dropped first; thread-safe.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["ResponseStore", "StoredResponse"]


@dataclass(frozen=True)
class StoredResponse:
    """A stored response: ``conversation`` (chat messages, the reply's assistant message last), ``body`` (the
    response object) and ``nbytes`` (their JSON's size)."""

    conversation: list
    body: dict
    nbytes: int


class ResponseStore:
    """Stored responses up to ``max_bytes`` (0: none kept), least recently used dropped first."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, response_id: str, conversation: list, body: dict) -> bool:
        """Keep a response; False when it alone is over the limit (nothing kept)."""
        nbytes = len(json.dumps(conversation, default=str)) + len(json.dumps(body, default=str))
        if nbytes > self.max_bytes:
            return False
        with self._lock:
            old = self._items.pop(response_id, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._items[response_id] = StoredResponse(conversation, body, nbytes)
            self._bytes += nbytes
            while self._bytes > self.max_bytes:
                _, dropped = self._items.popitem(last=False)
                self._bytes -= dropped.nbytes
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response (now the most recently used), None when not kept."""
        with self._lock:
            found = self._items.get(response_id)
            if found is not None:
                self._items.move_to_end(response_id)
            return found

    def delete(self, response_id: str) -> bool:
        """Drop a stored response; False when none had the id."""
        with self._lock:
            found = self._items.pop(response_id, None)
            if found is not None:
                self._bytes -= found.nbytes
            return found is not None

    def stats(self) -> dict[str, int]:
        """``{'responses', 'bytes', 'max_bytes'}``."""
        with self._lock:
            return {"responses": len(self._items), "bytes": self._bytes, "max_bytes": self.max_bytes}
