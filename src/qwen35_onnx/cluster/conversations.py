"""Which replica holds a conversation: message-prefix keys and a bounded table of them per replica
(no Ray import; :mod:`.routing` uses them).

A chat request's rendered prompt begins with its tools and template switches, then its messages in
order, so two requests whose first *i* messages (and tools and switches) are equal share the prompt
up to the end of message *i*; the same holds for a Responses request's input items and an Anthropic Messages
request's messages (:data:`PROMPT_FIELDS`). A request's **keys** are a hash chain over that order: key *i* digests
the tools, the switches and messages 1..i. A replica that answered a request with messages 1..n
keeps the state after its reply (the server's kept states), and the conversation's next request
resends messages 1..n, the reply and a new message: its key *n* equals the last key of the request
the replica answered. The table remembers, per replica, the last key of each request routed there,
so the longest key of a request found under a replica is the number of messages whose state that
replica was left holding.

This is the policy of prefix-cache affinity routing (Ray Serve LLM's ``PrefixCacheAffinityRouter``,
SGLang's cache-aware router) at message granularity: matching whole messages, not characters, means
a shared system prompt alone never pulls every new conversation to one replica.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence

__all__ = ["ConversationTable", "conversation_keys", "count_route", "response_key", "route_counts"]

PROMPT_FIELDS = {
    "/v1/chat/completions": (("tools", "tool_choice", "chat_template_kwargs"), "messages"),
    "/v1/responses": (("instructions", "tools", "tool_choice", "reasoning", "chat_template_kwargs"), "input"),
    "/v1/messages": (("system", "tools", "tool_choice", "thinking"), "messages"),
}
"""Per route: the request fields rendered into the prompt before (or around) the conversation (part of every key),
and the field that holds the conversation's messages or items."""

RESPONSES_PATH = "/v1/responses"


def _canonical(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str).encode()


def response_key(response_id: str) -> bytes:
    """The key of a stored response of the Responses API: the replica that stores it holds its state."""
    return hashlib.blake2b(b"response:" + response_id.encode(errors="replace"), digest_size=16).digest()


def conversation_keys(body: object, path: str = "/v1/chat/completions") -> tuple[bytes, ...]:
    """The keys of a request ``body`` (the parsed JSON object) of the API at ``path``: key *i* (16 bytes) digests
    the route's prompt fields (:data:`PROMPT_FIELDS`) and the conversation's messages (items) 1..i+1; empty when
    the body is not an object with a list of them (the replica answers such a request with its own error;
    routing does not care).

    A Responses request continuing a stored response (``previous_response_id``) starts with that response's key
    (:func:`response_key`: the router records it for the replica that stores a response, so continuations and
    ``GET /v1/responses/{id}`` find that replica); a string ``input`` is one item.
    """
    fields, conversation = PROMPT_FIELDS.get(path, (None, None))
    if fields is None or not isinstance(body, dict):
        return ()
    items = body.get(conversation)
    previous = body.get("previous_response_id") if path == RESPONSES_PATH else None
    if path == RESPONSES_PATH and isinstance(items, str):
        items = [items]
    if not isinstance(items, list) and not (isinstance(previous, str) and items is None):
        return ()
    keys = []
    digest = hashlib.blake2b(_canonical({k: body.get(k) for k in fields}), digest_size=16).digest()
    if isinstance(previous, str):
        digest = response_key(previous)
        keys.append(digest)
    for item in items or ():
        digest = hashlib.blake2b(digest + _canonical(item), digest_size=16).digest()
        keys.append(digest)
    return tuple(keys)


class ConversationTable:
    """The last key of each request routed to each replica, at most ``max_keys`` per replica (least
    recently routed or matched dropped first); thread-safe.

    The table is what the router knows, not what the replica keeps: a replica whose kept-state cache
    dropped a state (``--state-cache-bytes``) still appears to hold it, and a request sent home then
    prefills it again (correct, slower).
    """

    def __init__(self, max_keys: int = 100_000):
        if max_keys < 1:
            raise ValueError(f"max_keys must be >= 1, got {max_keys}")
        self.max_keys = max_keys
        self._keys: dict[Hashable, OrderedDict] = {}
        self._lock = threading.Lock()

    def record(self, replica: Hashable, keys: Sequence[bytes], also: Sequence[bytes] = ()) -> None:
        """Remember that ``replica`` answered a request with ``keys`` (its last key is kept) and holds what the keys
        ``also`` name (e.g. a response it stores: :func:`response_key`)."""
        kept = [*keys[-1:], *also]
        if not kept:
            return
        with self._lock:
            held = self._keys.setdefault(replica, OrderedDict())
            for key in kept:
                held[key] = None
                held.move_to_end(key)
            while len(held) > self.max_keys:
                held.popitem(last=False)

    def matches(self, keys: Sequence[bytes], replicas: Sequence[Hashable]) -> dict[Hashable, int]:
        """For each of ``replicas``: how many leading messages of a request with ``keys`` it was left
        holding (0: none; at most ``len(keys)``)."""
        found = {}
        with self._lock:
            for replica in replicas:
                held = self._keys.get(replica)
                found[replica] = 0
                if held:
                    for i in range(len(keys), 0, -1):
                        if keys[i - 1] in held:
                            held.move_to_end(keys[i - 1])
                            found[replica] = i
                            break
        return found

    def forget(self, replica: Hashable) -> None:
        """Drop what ``replica`` held (it died or left: a restarted replica holds nothing)."""
        with self._lock:
            self._keys.pop(replica, None)

    def keep_only(self, replicas: Sequence[Hashable]) -> None:
        """Drop every replica not in ``replicas``."""
        with self._lock:
            for gone in set(self._keys) - set(replicas):
                del self._keys[gone]

    def __len__(self) -> int:
        with self._lock:
            return sum(len(held) for held in self._keys.values())


_route_counts: dict[str, int] = {}
_route_counts_lock = threading.Lock()


def count_route(decision: str) -> None:
    """Count one request routed as ``decision`` (see :func:`route_counts`) in this process."""
    with _route_counts_lock:
        _route_counts[decision] = _route_counts.get(decision, 0) + 1


def route_counts() -> dict[str, int]:
    """Requests routed in this process so far, by where they went: ``home`` (to a replica holding
    the longest prefix of its messages), ``away`` (some replica held a prefix, another was chosen:
    load, or round-robin), ``new`` (no replica held any)."""
    with _route_counts_lock:
        return dict(_route_counts)
