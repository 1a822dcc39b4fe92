"""Prefix-affinity routing for jaxpaged under Ray Serve (jaxpaged.serving.ray_serve): a
conversation's requests go to the replica that served its earlier turns (where its prefix's
KV blocks are cached) while that replica is not overloaded, else to the least-loaded one.

The rule is the data-parallel router's (jaxpaged.engine.dp_router), over Ray's replica ids:
prefix keys are chained hashes of the request's leading 64-character chunks, the load is the
replica's ongoing requests as Ray's queue-length cache knows them (KV usage is not known
here), and the preferred replica is kept while it has at most ``affinity_slack`` more
ongoing requests than the least-loaded one. Ray's own backpressure adds the other bound: a
replica at ``max_ongoing_requests`` rejects the request and the next in the ranking gets it.

The text hashed is the request body's prompt-bearing fields in a fixed order (``system``,
``instructions``, ``messages``, ``input``, ``prompt``) as compact JSON. A later turn of a chat
repeats the earlier messages, so its text starts with the earlier turn's (up to the closing
bracket): the same leading keys. A request with the ``x-session-id`` header is keyed by the
header alone. The table of keys lives in the process that routes (the ingress replica):
with several ingress replicas each keeps its own.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.replica_wrapper import RunningReplica
from ray.serve._private.request_router.request_router import RequestRouter

from jaxpaged.engine.dp_router import ReplicaLoad, Router, RouterConfig, prefix_keys

__all__ = ["PrefixAffinityRouter", "rank_replicas", "route_keys", "routing_text"]

# the fields of an OpenAI / Anthropic request body that carry the prompt, in prompt order
_PROMPT_FIELDS = ("system", "instructions", "messages", "input", "prompt")
SESSION_HEADER = b"x-session-id"


def routing_text(body: bytes) -> str:
    """The text a request's prefix keys are hashed from ('' for a body that is not a JSON
    object: no keys, so the least-loaded replica serves it)."""
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return ""
    if not isinstance(request, dict):
        return ""
    fields = [request[k] for k in _PROMPT_FIELDS if request.get(k) is not None]
    return json.dumps(fields, separators=(",", ":"), ensure_ascii=False) if fields else ""


def route_keys(
    headers: Sequence[tuple[bytes, bytes]], body: bytes, config: RouterConfig
) -> list[int]:
    """The prefix keys of one HTTP request (module docstring): the session header's one key
    when it is sent, else the prompt's chunk keys."""
    for name, value in headers:
        if name.lower().replace(b"_", b"-") == SESSION_HEADER:
            return [hash(("session", value))]
    return prefix_keys(routing_text(body), config)


def rank_replicas(
    router: Router,
    keys: Sequence[int],
    ongoing: Mapping[Hashable, int | None],
    sent: Mapping[Hashable, int],
) -> list[Hashable]:
    """Replica ids best first: the router's choice for ``keys`` (recorded), then the others
    by ongoing requests. ``ongoing`` holds every candidate (None: not known, counted as 0)."""
    loads = {
        r: ReplicaLoad(alive=True, open_requests=n or 0, kv_cache_usage=0.0, sent_total=sent.get(r, 0))
        for r, n in ongoing.items()
    }  # fmt: skip
    chosen = router.choose(keys, loads)
    order = list(loads)
    rest = sorted(
        (r for r in order if r != chosen), key=lambda r: (loads[r].open_requests, order.index(r))
    )
    return [chosen, *rest]


class PrefixAffinityRouter(RequestRouter):
    """Ray Serve's request-router interface over :func:`rank_replicas`; the ingress passes a
    request's keys as the ``route_keys`` keyword. ``request_router_kwargs`` may set
    ``affinity_slack`` and ``table_size`` (RouterConfig's)."""

    def initialize_state(self, **kwargs: Any) -> None:  # noqa: ANN401
        unknown = set(kwargs) - {"affinity_slack", "table_size"}
        if unknown:
            raise ValueError(
                f"PrefixAffinityRouter takes affinity_slack and table_size, not {sorted(unknown)}"
            )
        self.router = Router(RouterConfig(**kwargs))
        self.sent: dict[Hashable, int] = {}

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        keys = list(pending_request.kwargs.get("route_keys", ())) if pending_request else []
        by_id = {r.replica_id: r for r in candidate_replicas}
        cache = self.replica_queue_len_cache
        ranked = rank_replicas(self.router, keys, {r: cache.get(r) for r in by_id}, self.sent)
        # the preferred replica alone first; if it rejects (full), the rest by load
        return (
            [[by_id[ranked[0]]], [by_id[r] for r in ranked[1:]]]
            if len(ranked) > 1
            else [[by_id[ranked[0]]]]
        )

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: Any, result: Any
    ) -> None:  # noqa: ANN401
        self.sent[replica_id] = self.sent.get(replica_id, 0) + 1
        keys = pending_request.kwargs.get("route_keys", ())
        if keys:  # where it went (the preferred one may have rejected it)
            self.router.record(keys, replica_id)

    def on_replica_actor_died(self, replica_id: Any) -> None:  # noqa: ANN401
        super().on_replica_actor_died(replica_id)
        self.router.forget(replica_id)
        self.sent.pop(replica_id, None)
