"""Ray Serve request routers of the chat replicas (Ray's ``RequestRouter`` API; they run in the
process that holds the replicas' handle: the ingress).

:class:`ConversationRouter` (``--routing conversation``, the default):

1. The request's conversation keys (:func:`~.conversations.conversation_keys`, carried by
   :class:`~.replica.ForwardedRequest`) are looked up per replica in the router's
   :class:`~.conversations.ConversationTable`: the replica left holding the most leading messages
   is the conversation's **home**.
2. The home is chosen when its load (running + waiting requests, from Ray's queue-length cache; a
   replica not in the cache counts as idle) exceeds the least loaded replica's by at most
   ``route_imbalance``; otherwise, or when no replica holds a prefix (a new conversation), the less
   loaded of two replicas drawn at random ("power of two choices": Mitzenmacher 2001; Ray Serve's
   default router). A full home (at ``max_ongoing_requests``) is passed over for the others.
3. Where the request went, its last key is recorded (the state the replica keeps after replying), and the key of
   the response it will store (a Responses request: its id, drawn by the ingress), so that the response's
   continuations and ``GET /v1/responses/{id}`` go to that replica.

:class:`RoundRobinRouter` (``--routing round-robin``): each request to the next replica in turn (for
comparison: it ignores where a conversation's state is).

The table is per router: one ingress replica (the default) sees every request; more ingress
replicas would each learn only their own requests' homes. Ray Serve ships this module to the
ingress by value (a copy of its globals), so what must be shared with the ingress (the decision
counts) lives in :mod:`.conversations`.
"""

from __future__ import annotations

import logging
import random
from itertools import count

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from .conversations import ConversationTable, count_route, response_key

__all__ = ["ConversationRouter", "RoundRobinRouter"]

log = logging.getLogger(__name__)


def _keys(pending_request: PendingRequest | None) -> tuple[bytes, ...]:
    if pending_request is None or not pending_request.args:
        return ()
    return tuple(getattr(pending_request.args[0], "conversation", ()) or ())


def _stored(pending_request: PendingRequest | None) -> tuple[bytes, ...]:
    """The key of the response the request's replica will store (Responses API), if any."""
    if pending_request is None or not pending_request.args:
        return ()
    response_id = getattr(pending_request.args[0], "response_id", None)
    return () if response_id is None else (response_key(response_id),)


def _back_off_when_full(pending_request: PendingRequest | None) -> None:
    """Ask Ray to wait (its backoff) between two rounds of choices when every replica it was offered
    was full: it sleeps only when the request's routing context says so (its own locality and
    multiplex policies set it), else it would ask again at once, probing busy replicas in a loop."""
    if pending_request is not None:
        pending_request.routing_context.should_backoff = True


def _two_choices(replicas: list[RunningReplica]) -> list[RunningReplica]:
    """Two of ``replicas`` drawn at random (all when fewer): Ray then takes the less loaded."""
    return random.sample(replicas, min(2, len(replicas)))


class ConversationRouter(RequestRouter):
    """Sends a conversation's requests to the replica that keeps its state, load allowing (see the
    module docstring)."""

    def initialize_state(self, route_imbalance: int = 4, max_keys: int = 100_000) -> None:
        self.route_imbalance = route_imbalance
        self.table = ConversationTable(max_keys)

    def _load(self, replica: RunningReplica) -> int:
        queue_len = self.replica_queue_len_cache.get(replica.replica_id)
        return 0 if queue_len is None else queue_len

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """Ray's call: ``candidate_replicas`` ranked, most preferred first (Ray takes the least loaded
        of a rank that has room, else tries the next rank)."""
        if not candidate_replicas:
            return []
        _back_off_when_full(pending_request)
        return self.rank(candidate_replicas, pending_request)

    def rank(self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None):
        """The conversation's home first (load allowing), else two at random (see the module docstring)."""
        keys = _keys(pending_request)
        matched = self.table.matches(keys, [r.replica_id for r in candidate_replicas]) if keys else {}
        longest = max(matched.values(), default=0)
        if longest == 0:
            return [_two_choices(candidate_replicas)]
        homes = [r for r in candidate_replicas if matched[r.replica_id] == longest]
        others = [r for r in candidate_replicas if matched[r.replica_id] != longest]
        least = min(self._load(r) for r in candidate_replicas)
        fit = [
            r for r in homes if self._load(r) - least <= self.route_imbalance and self._load(r) < r.max_ongoing_requests
        ]
        if fit:
            return [fit, _two_choices(others)] if others else [fit]
        return [_two_choices(others or homes)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        keys, stored = _keys(pending_request), _stored(pending_request)
        if keys:
            matched = self.table.matches(keys, [replica_id, *self.curr_replicas])
            longest = max(matched.values())
            count_route("new" if longest == 0 else "home" if matched[replica_id] == longest else "away")
        self.table.record(replica_id, keys, stored)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.forget(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.table.keep_only([r.replica_id for r in replicas])


class RoundRobinRouter(ConversationRouter):
    """Each request to the next replica in turn (a full one passed over for the one after it); it
    keeps the table only to count where requests went (:func:`~.conversations.route_counts`)."""

    def initialize_state(self, **kwargs) -> None:
        super().initialize_state(**kwargs)
        self._turn = count()

    def rank(self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None):
        """The next replica in turn first, then the others in order."""
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        start = next(self._turn) % len(ordered)
        return [[ordered[(start + i) % len(ordered)]] for i in range(len(ordered))]
