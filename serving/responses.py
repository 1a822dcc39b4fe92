"""OpenAI's Responses API over HTTP: ``POST /v1/responses`` (streamed or not),
``GET``/``DELETE /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``.

Each turn runs as a Chat Completions request (serving/chat_run.py); its reply, read by the
same reasoning and tool-call parsers, becomes output items: a ``reasoning`` item (with
``--reasoning-parser``), a ``message`` with one ``output_text`` part, ``function_call`` items.
Streamed and whole responses are built by the same :class:`OutputItems`, so they agree.
Stored responses (``store``, the default) live in a bounded :class:`ResponseStore`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jaxpaged.serving.chat_run import ChatRun, check_model, start_chat
from jaxpaged.serving.errors import InvalidRequest, NotFound, ServingError
from jaxpaged.serving.frontend import Frontend
from jaxpaged.serving.protocol import parse_body
from jaxpaged.serving.response_store import ResponseStore, StoredResponse
from jaxpaged.serving.responses_protocol import (
    REFUSED_FIELDS,
    FunctionChoice,
    ResponsesRequest,
    input_messages,
)

__all__ = ["OutputItems", "add_responses_routes"]


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """A response's output items, built from a ReplyBuilder's deltas (chat_reply.py); each
    call returns the stream events (without sequence numbers) the change makes. Whitespace
    before any message text is held back, so that a reply of tool calls alone has no
    message item (as Chat Completions answers ``content: null``)."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._held = ""  # whitespace not yet in a message

    @property
    def _index(self) -> int:
        return len(self.items) - 1

    def _start(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        out = self._end("completed")
        self.items.append(item)
        self._open = item
        out.append(
            {"type": "response.output_item.added", "output_index": self._index, "item": dict(item)}
        )
        return out

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": self._index}

    def feed(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for delta in deltas:
            if delta.get("reasoning_content"):
                out += self._reasoning(delta["reasoning_content"])
            if delta.get("content"):
                out += self._text(delta["content"])
            for call in delta.get("tool_calls", ()):
                out += self._call(call)
        return out

    def _reasoning(self, text: str) -> list[dict[str, Any]]:
        out = []
        if self._open is None or self._open["type"] != "reasoning":
            item = {
                "id": _new_id("rs"),
                "type": "reasoning",
                "summary": [],
                "status": "in_progress",
            }
            out += self._start({**item, "content": [{"type": "reasoning_text", "text": ""}]})
        self._open["content"][0]["text"] += text
        ev = {"type": "response.reasoning_text.delta", **self._where(), "content_index": 0}
        return [*out, {**ev, "delta": text}]

    def _text(self, text: str) -> list[dict[str, Any]]:
        out = []
        if self._open is None or self._open["type"] != "message":
            if not (self._held + text).strip():
                self._held += text
                return []
            text, self._held = self._held + text, ""
            item = {"id": _new_id("msg"), "type": "message", "role": "assistant"}
            out += self._start({**item, "status": "in_progress", "content": []})
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self._open["content"].append(part)
            out.append(
                {"type": "response.content_part.added", **self._where(), "content_index": 0,
                 "part": dict(part)}
            )  # fmt: skip
        self._open["content"][0]["text"] += text
        ev = {"type": "response.output_text.delta", **self._where(), "content_index": 0}
        return [*out, {**ev, "delta": text, "logprobs": []}]

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        fn = call["function"]
        out = []
        if "id" in call:  # a call's first delta: its id and name
            item = {"id": _new_id("fc"), "type": "function_call", "call_id": call["id"]}
            out += self._start(
                {**item, "name": fn["name"], "arguments": "", "status": "in_progress"}
            )
        if fn.get("arguments"):
            self._open["arguments"] += fn["arguments"]
            out.append(
                {"type": "response.function_call_arguments.delta", **self._where(),
                 "delta": fn["arguments"]}
            )  # fmt: skip
        return out

    def _end(self, status: str) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        where = {"item_id": item["id"], "output_index": self._index}
        out: list[dict[str, Any]] = []
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            out.append(
                {"type": "response.reasoning_text.done", **where, "content_index": 0, "text": text}
            )
        elif item["type"] == "message":
            part = item["content"][0]
            out.append(
                {"type": "response.output_text.done", **where, "content_index": 0,
                 "text": part["text"], "logprobs": []}
            )  # fmt: skip
            out.append(
                {"type": "response.content_part.done", **where, "content_index": 0,
                 "part": dict(part)}
            )  # fmt: skip
        else:
            out.append(
                {"type": "response.function_call_arguments.done", **where,
                 "name": item["name"], "arguments": item["arguments"]}
            )  # fmt: skip
        out.append({"type": "response.output_item.done", "output_index": self._index, "item": item})
        return out

    def close(self, status: str) -> list[dict[str, Any]]:
        """Ends the open item (``status``: completed or incomplete); an all-whitespace
        reply without other items becomes a message of its own."""
        out: list[dict[str, Any]] = []
        if self._held and not self.items:  # the whole reply was whitespace
            item = {"id": _new_id("msg"), "type": "message", "role": "assistant"}
            part = {"type": "output_text", "text": self._held, "annotations": [], "logprobs": []}
            out += self._start({**item, "status": "in_progress", "content": [part]})
        self._held = ""
        return out + self._end(status)

    def as_message(self) -> dict[str, Any]:
        """The reply as a chat message (stored for previous_response_id); reasoning is left
        out, as chat templates leave out earlier turns' reasoning."""
        text = "".join(
            i["content"][0]["text"] for i in self.items if i["type"] == "message" and i["content"]
        )
        calls = [
            {
                "id": i["call_id"],
                "type": "function",
                "function": {"name": i["name"], "arguments": i["arguments"]},
            }
            for i in self.items
            if i["type"] == "function_call"
        ]
        msg: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
        if calls:
            msg["tool_calls"] = calls
        return msg


_STATUS = {"stop": "completed", "length": "incomplete", "abort": "cancelled"}


class _Turn:
    """One POST /v1/responses: the request, its stored history and the response object."""

    def __init__(self, frontend: Frontend, store: ResponseStore, body: ResponsesRequest) -> None:
        self.frontend = frontend
        self.store = store
        self.body = body
        self.id = _new_id("resp")
        self.created = int(time.time())
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            prev = store.get(body.previous_response_id)
            if prev is None:
                raise InvalidRequest(
                    f"previous response {body.previous_response_id!r} not found (never stored, "
                    f"deleted or evicted; the store keeps {store.capacity})",
                    param="previous_response_id",
                )
            if store.running(body.previous_response_id):
                raise InvalidRequest(
                    f"previous response {body.previous_response_id!r} is still in progress",
                    param="previous_response_id",
                )
            history = prev.messages
        self.chat = body.chat_request(history)
        self.messages = history + input_messages(body.input)  # the conversation so far
        self.items = OutputItems()
        self.run: ChatRun | None = None

    def envelope(self, status: str, usage: dict | None = None) -> dict[str, Any]:
        body, cfg = self.body, self.frontend.config
        fmt = body.text.format if body.text is not None else None
        choice = body.tool_choice
        if isinstance(choice, FunctionChoice):
            choice = choice.model_dump()
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": body.model or cfg.served_model_name,
            "output": self.items.items if status != "in_progress" else [],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": body.store,
            "temperature": body.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt
                     else {"type": "text"}},
            "tool_choice": choice or ("auto" if body.tools else "none"),
            "tools": [t.model_dump(exclude_none=True) for t in body.function_tools()],
            "top_p": body.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": body.user,
            "metadata": body.metadata or {},
        }  # fmt: skip

    def usage(self) -> dict[str, Any]:
        assert self.run is not None
        t = self.run.totals
        reasoning = "".join(
            i["content"][0]["text"] for i in self.items.items if i["type"] == "reasoning"
        )
        tok = self.frontend.engine.tokenizer
        # the reasoning text re-tokenized: the engine counts tokens, not which part they made
        num_reasoning = len(tok.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        return {
            "input_tokens": t.num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": t.num_cached_tokens},
            "output_tokens": t.num_completion_tokens,
            "output_tokens_details": {
                "reasoning_tokens": min(num_reasoning, t.num_completion_tokens)
            },
            "total_tokens": t.num_prompt_tokens + t.num_completion_tokens,
        }

    async def start(self) -> None:
        self.run = await start_chat(self.frontend, self.chat, self.id, stream=self.body.stream)
        if self.body.store:
            entry = StoredResponse(self.envelope("in_progress"), [], self.id)
            self.store.start(self.id, entry)

    def finish(self, finish_reason: str | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The final response object and the closing events."""
        status = _STATUS.get(finish_reason or "stop", "completed")
        events = self.items.close("incomplete" if status == "incomplete" else "completed")
        response = self.envelope(status, self.usage())
        if self.body.store:
            self.store.finish(self.id, response, [*self.messages, self.items.as_message()])
        return response, events

    def abandon(self) -> None:
        if self.body.store:
            self.store.abandon(self.id)


def _sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


async def _stream(turn: _Turn) -> AsyncIterator[str]:
    seq = 0

    def numbered(event: dict[str, Any]) -> str:
        nonlocal seq
        seq += 1
        return _sse({**event, "sequence_number": seq - 1})

    run = turn.run
    assert run is not None
    reply = run.builder()
    finish = None
    try:
        head = turn.envelope("in_progress")
        yield numbered({"type": "response.created", "response": head})
        yield numbered({"type": "response.in_progress", "response": head})
        async for d in run.deltas():
            finish = d.finish_reason or finish
            for event in turn.items.feed(reply.delta(d.text, finished=d.finish_reason is not None)):
                yield numbered(event)
        response, events = turn.finish(finish)
        for event in events:
            yield numbered(event)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        yield numbered({"type": kind, "response": response})
    except ServingError as e:
        turn.abandon()
        yield numbered({"type": "error", "code": e.error_type, "message": e.message,
                        "param": e.param})  # fmt: skip
        failed = {
            **turn.envelope("failed"),
            "error": {"code": "server_error", "message": e.message},
        }
        yield numbered({"type": "response.failed", "response": failed})
    finally:  # a client that went away: the request is aborted, nothing is kept
        if turn.store.running(turn.id):
            turn.abandon()


def add_responses_routes(app: FastAPI, frontend: Frontend) -> None:
    """The Responses API's endpoints, with a store of ``responses_store_size`` responses."""
    store = ResponseStore(frontend.config.responses_store_size)

    def stored(response_id: str) -> StoredResponse:
        entry = store.get(response_id)
        if entry is None:
            raise NotFound(
                f"response {response_id!r} not found (never stored, deleted or evicted)",
                param="response_id",
            )
        return entry

    @app.post("/v1/responses")
    async def create(request: Request) -> Response:
        frontend.check_api_key(request.headers.get("authorization"))
        body: ResponsesRequest = parse_body(ResponsesRequest, await request.body(), REFUSED_FIELDS)
        check_model(frontend, body.model)
        turn = _Turn(frontend, store, body)
        await turn.start()
        if body.stream:
            return StreamingResponse(_stream(turn), media_type="text/event-stream")
        try:
            sample = await turn.run.final(request)
            turn.items.feed(turn.run.builder().delta(sample.text, finished=True))
            response, _ = turn.finish(sample.finish_reason)
        except BaseException:
            turn.abandon()
            raise
        return JSONResponse(response)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(request: Request, response_id: str) -> dict:
        frontend.check_api_key(request.headers.get("authorization"))
        return stored(response_id).body

    @app.delete("/v1/responses/{response_id}")
    async def delete(request: Request, response_id: str) -> dict:
        frontend.check_api_key(request.headers.get("authorization"))
        entry = stored(response_id)
        if store.running(response_id):
            await frontend.abort(entry.request_id)
        store.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(request: Request, response_id: str) -> dict:
        """Aborts a response that is still generating and returns it as it ended
        (``cancelled``); a finished one cannot be cancelled."""
        frontend.check_api_key(request.headers.get("authorization"))
        entry = stored(response_id)
        if not store.running(response_id):
            raise InvalidRequest(
                f"response {response_id!r} is {entry.body['status']}; only a response still "
                "in progress can be cancelled",
                param="response_id",
            )
        await frontend.abort(entry.request_id)
        await asyncio.wait_for(entry.ended.wait(), 30)
        return stored(response_id).body
