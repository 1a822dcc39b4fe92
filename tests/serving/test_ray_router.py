"""The Ray Serve prefix-affinity rule and relay (jaxpaged.serving.ray_router, ray_relay) with
fakes, no cluster: a conversation's later turns rank its first turn's replica first while it
is within the slack of the least-loaded one; a replica that fails before answering costs the
request nothing, one that fails while streaming cuts it."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("ray.serve")  # the ray extra (in dev)

from ray.exceptions import RayActorError  # noqa: E402

from jaxpaged.engine.dp_router import Router, RouterConfig  # noqa: E402
from jaxpaged.serving.ray_relay import RESENDS, IngressApp, run_relayed  # noqa: E402
from jaxpaged.serving.ray_router import rank_replicas, route_keys  # noqa: E402

CONFIG = RouterConfig(block_size=4, affinity_slack=2)  # 16-character chunks


def _chat(*turns: str) -> bytes:
    messages = [{"role": "system", "content": "You answer in one short sentence."}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return json.dumps({"model": "m", "messages": messages, "temperature": 0}).encode()


def test_a_later_turn_keeps_the_first_turns_keys():
    first = route_keys([], _chat("What is a paged KV cache?"), CONFIG)
    later = route_keys([], _chat("What is a paged KV cache?", "Blocks.", "And why?"), CONFIG)
    other = route_keys([], _chat("Name a prime number."), CONFIG)
    assert len(first) >= 3 and later[: len(first) - 1] == first[:-1]  # up to the "]"
    assert other[0] == first[0] and other[-1] not in first  # the system prompt only
    assert route_keys([], b"not json", CONFIG) == []
    session = route_keys([(b"X-Session-Id", b"abc")], _chat("hi"), CONFIG)
    assert session == route_keys([(b"x_session_id", b"abc")], _chat("other"), CONFIG)
    assert len(session) == 1


def test_the_holder_ranks_first_until_it_is_past_the_slack():
    router = Router(CONFIG)
    sent: dict[str, int] = {"a": 5, "b": 1}
    keys = route_keys([], _chat("What is a paged KV cache?"), CONFIG)
    later = route_keys([], _chat("What is a paged KV cache?", "Blocks.", "And why?"), CONFIG)
    assert rank_replicas(router, keys, {"a": 0, "b": 0}, sent) == ["b", "a"]  # fewer sent
    assert rank_replicas(router, later, {"a": 0, "b": 2}, sent)[0] == "b"  # within slack
    assert rank_replicas(router, later, {"a": 0, "b": 3}, sent) == ["a", "b"]  # past it
    assert rank_replicas(router, later, {"a": 2, "b": 0}, sent)[0] == "a"  # now its holder
    # "a" gone: the least loaded ("c": None is unknown, counted 0; nothing sent to it yet)
    assert rank_replicas(router, later, {"b": 0, "c": None}, sent)[0] == "c"
    sent["c"] = 9
    assert rank_replicas(router, later, {"b": 0, "c": 0}, sent)[0] == "c"  # its holder
    router.forget("c")  # it died: its prefixes are nobody's
    assert rank_replicas(router, later, {"b": 0, "c": 0}, sent) == ["b", "c"]


class _Stream:
    """A fake streaming handle call: yields ``messages``, then raises ``fail`` (if any)."""

    def __init__(self, messages: list[dict], fail: BaseException | None = None) -> None:
        self.messages, self.fail, self.cancelled = messages, fail, False

    def __aiter__(self):
        return self._run()

    async def _run(self):
        for m in self.messages:
            yield m
        if self.fail is not None:
            raise self.fail

    def cancel(self) -> None:
        self.cancelled = True


def _relay(streams: list[_Stream], body: bytes = b'{"prompt": "p"}') -> tuple[list, list]:
    calls, sent = [], []
    queue = iter([{"type": "http.request", "body": body[:5], "more_body": True},
                  {"type": "http.request", "body": body[5:]}])  # fmt: skip

    def call(scope: dict, data: bytes, route_keys: list[int]) -> _Stream:
        calls.append((scope["path"], data, route_keys))
        return streams[len(calls) - 1]

    async def receive() -> dict:
        return next(queue)

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "path": "/v1/completions", "headers": [], "app": object()}
    asyncio.run(IngressApp(call, CONFIG)(scope, receive, send))
    return calls, sent


def test_a_replica_failing_before_it_answers_costs_the_request_nothing():
    start = {"type": "http.response.start", "status": 200, "headers": []}
    done = {"type": "http.response.body", "body": b"ok"}
    calls, sent = _relay([_Stream([], RayActorError()), _Stream([start, done])])
    assert sent == [start, done]
    assert [c[:2] for c in calls] == [("/v1/completions", b'{"prompt": "p"}')] * 2

    calls, sent = _relay([_Stream([], RayActorError()) for _ in range(RESENDS + 1)])
    assert len(calls) == RESENDS + 1 and sent[0]["status"] == 503
    assert b"failed before answering" in sent[1]["body"]

    with pytest.raises(RayActorError):  # streaming had started: the response is cut
        _relay([_Stream([start], RayActorError()), _Stream([start, done])])
    cut = _Stream([start], ValueError("boom"))
    with pytest.raises(ValueError):
        _relay([cut])
    assert cut.cancelled


def test_the_replica_side_runs_the_app_on_the_relayed_body():
    async def app(scope, receive, send):
        body = (await receive())["body"]
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": body[::-1]})
        if scope["path"] == "/fail":
            raise RuntimeError("app failed")

    async def collect(path: str) -> list[dict]:
        return [m async for m in run_relayed(app, {"type": "http", "path": path}, b"abc")]

    got = asyncio.run(collect("/"))
    assert [m.get("status") or m["body"] for m in got] == [201, b"cba"]
    with pytest.raises(RuntimeError, match="app failed"):
        asyncio.run(collect("/fail"))
