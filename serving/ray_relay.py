"""The two ends of an HTTP request relayed from jaxpaged's Ray Serve ingress to an engine
replica (jaxpaged.serving.ray_serve). Ray's HTTP proxy routes on headers alone (the body is
read later, by the replica), so a router that keys on the prompt needs a hop that has read
it: the ingress reads the body, computes the prefix keys (jaxpaged.serving.ray_router) and
sends scope + body through a Ray handle; the replica runs `jaxpaged serve`'s app on them and
streams the ASGI messages back.

A replica that dies before it sent anything (it had not started answering) costs the
request nothing: the ingress sends it to another replica, at most ``RESENDS`` times, then
answers 503 naming the failure. One that dies while streaming cuts the response (the
client sees the connection end early, never a hang).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from ray.exceptions import RayActorError

from jaxpaged.engine.dp_router import RouterConfig
from jaxpaged.serving.ray_router import route_keys

__all__ = ["RESENDS", "IngressApp", "run_relayed"]

log = logging.getLogger("jaxpaged.serving.ray_relay")

RESENDS = 2
# the parts of an HTTP scope an app reads; the rest (server state, extensions) stays here
_SCOPE_KEYS = ("type", "asgi", "http_version", "method", "scheme", "path", "raw_path",
               "query_string", "root_path", "headers", "client", "server")  # fmt: skip


class IngressApp:
    """The ingress's ASGI app: every HTTP request is read whole and relayed to a replica by
    ``call(scope, body, route_keys)`` (a streaming Ray handle call, ranked by the router)."""

    def __init__(self, call: Callable[..., Any], config: RouterConfig | None = None) -> None:
        self.call = call  # returns Ray's DeploymentResponseGenerator
        self.config = config or RouterConfig()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:  # noqa: ANN401
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return  # websockets: no route takes them
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        keys = route_keys(scope.get("headers", []), bytes(body), self.config)
        plain = {k: scope[k] for k in _SCOPE_KEYS if k in scope}
        for attempt in range(RESENDS + 1):
            started = False
            stream = self.call(plain, bytes(body), route_keys=keys)
            try:
                async for message in stream:
                    started = True
                    await send(message)
                return
            except RayActorError as exc:
                if started:
                    raise  # the response was under way: the connection ends early
                if attempt == RESENDS:
                    await _unavailable(send, f"replica failed before answering: {exc}")
                    return
                log.warning("replica failed before answering, resending: %s", exc)
            except BaseException:
                stream.cancel()  # e.g. the client went away: the replica aborts it
                raise


async def _unavailable(send: Any, message: str) -> None:  # noqa: ANN401
    body = json.dumps({"error": {"message": message, "type": "ServiceUnavailable", "code": 503}})
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json")]})  # fmt: skip
    await send({"type": "http.response.body", "body": body.encode()})


async def run_relayed(app: Any, scope: dict, body: bytes) -> AsyncIterator[dict]:  # noqa: ANN401
    """Runs the ASGI ``app`` on a relayed request and yields what it sends. Cancelling the
    iteration (the ingress's caller went away) cancels the app, as a disconnect would."""
    sent: asyncio.Queue[dict | None] = asyncio.Queue()
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # a disconnect arrives as cancellation instead
        raise AssertionError("unreachable")

    task = asyncio.create_task(app(scope, receive, sent.put))
    task.add_done_callback(lambda _: sent.put_nowait(None))
    try:
        while (message := await sent.get()) is not None:
            yield message
        task.result()  # the app's own exception, if it raised
    finally:
        task.cancel()
