"""Anthropic's Messages API over HTTP: ``POST /v1/messages`` (streamed or not) and
``POST /v1/messages/count_tokens``, as the official ``anthropic`` client calls them.

Each request runs as a Chat Completions request (serving/chat_run.py); its reply, read by
the same reasoning and tool-call parsers, becomes content blocks: ``thinking`` (with
``--reasoning-parser``), ``text`` and ``tool_use``. Streamed and whole replies are built by
the same :class:`ContentBlocks`. Errors come back in Anthropic's shape,
``{"type": "error", "error": {"type", "message"}}``; ``x-api-key`` (or a bearer token)
carries the server's API key.
"""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jaxpaged.serving.anthropic_protocol import (
    REFUSED_FIELDS,
    CountTokensRequest,
    MessagesRequest,
)
from jaxpaged.serving.chat_run import ChatRun, check_model, render_prompt, start_chat
from jaxpaged.serving.errors import ServingError
from jaxpaged.serving.frontend import Frontend
from jaxpaged.serving.protocol import parse_body

__all__ = ["ContentBlocks", "add_anthropic_routes"]

# our error types -> Anthropic's
_ERROR_TYPES = {
    "invalid_request_error": "invalid_request_error",
    "authentication_error": "authentication_error",
    "not_found_error": "not_found_error",
    "rate_limit_error": "rate_limit_error",
    "service_unavailable": "overloaded_error",
}


def _error(e: ServingError) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(e.error_type, "api_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


class ContentBlocks:
    """A reply's content blocks, built from a ReplyBuilder's deltas (chat_reply.py); each
    call returns the stream events the change makes. Whitespace before any text is held
    back, so that a reply of tool calls alone has no text block."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self._args: dict[int, str] = {}  # tool_use block index -> its arguments' JSON text
        self._open = False
        self._held = ""

    @property
    def _index(self) -> int:
        return len(self.blocks) - 1

    def _current(self, kind: str) -> bool:
        return self._open and self.blocks[-1]["type"] == kind

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        out = self._stop()
        self.blocks.append(block)
        self._open = True
        return [
            *out,
            {"type": "content_block_start", "index": self._index, "content_block": dict(block)},
        ]

    def _stop(self) -> list[dict[str, Any]]:
        if not self._open:
            return []
        self._open = False
        block = self.blocks[-1]
        if block["type"] == "tool_use":
            try:
                block["input"] = json.loads(self._args[self._index] or "{}")
            except json.JSONDecodeError:  # cut off by max_tokens: stop_reason says so
                block["input"] = {}
        return [{"type": "content_block_stop", "index": self._index}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self._index, "delta": delta}

    def feed(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for d in deltas:
            if d.get("reasoning_content"):
                text = d["reasoning_content"]
                if not self._current("thinking"):
                    out += self._start({"type": "thinking", "thinking": "", "signature": ""})
                self.blocks[-1]["thinking"] += text
                out.append(self._delta({"type": "thinking_delta", "thinking": text}))
            if d.get("content"):
                out += self._text(d["content"])
            for call in d.get("tool_calls", ()):
                fn = call["function"]
                if "id" in call:
                    head = {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": {}}
                    out += self._start(head)
                    self._args[self._index] = ""
                if fn.get("arguments"):
                    self._args[self._index] += fn["arguments"]
                    out.append(self._delta({"type": "input_json_delta",
                                            "partial_json": fn["arguments"]}))  # fmt: skip
        return out

    def _text(self, text: str) -> list[dict[str, Any]]:
        out = []
        if not self._current("text"):
            if not (self._held + text).strip():
                self._held += text
                return []
            text, self._held = self._held + text, ""
            out += self._start({"type": "text", "text": ""})
        self.blocks[-1]["text"] += text
        return [*out, self._delta({"type": "text_delta", "text": text})]

    def close(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self._held and not self.blocks:  # the whole reply was whitespace
            out += self._start({"type": "text", "text": ""})
            self.blocks[-1]["text"] = self._held
            out.append(self._delta({"type": "text_delta", "text": self._held}))
        self._held = ""
        return out + self._stop()

    @property
    def called_tools(self) -> bool:
        return any(b["type"] == "tool_use" for b in self.blocks)


def _stop_reason(
    finish: str | None, stop: int | str | None, body: MessagesRequest, blocks: ContentBlocks
) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) of a finished reply."""
    if finish == "length":
        return "max_tokens", None
    if isinstance(stop, str) and stop in (body.stop_sequences or ()):
        return "stop_sequence", stop
    if blocks.called_tools:
        return "tool_use", None
    return "end_turn", None


def _usage(run: ChatRun, output_tokens: int | None = None) -> dict[str, Any]:
    """Anthropic's usage: input_tokens leaves out the prompt tokens read from the prefix
    cache (cache_read_input_tokens), as Anthropic counts them."""
    t = run.totals
    cached = t.num_cached_tokens
    return {
        "input_tokens": run.num_prompt_tokens - cached,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
        "output_tokens": t.num_completion_tokens if output_tokens is None else output_tokens,
    }


def _sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


async def _stream(body: MessagesRequest, run: ChatRun, head: dict[str, Any]) -> AsyncIterator[str]:
    blocks = ContentBlocks()
    reply = run.builder()
    finish = stop = None
    started = False
    try:
        async for d in run.deltas():
            if not started:  # after the first output: the prefix-cache hits are known
                started = True
                message = {**head, "usage": _usage(run, output_tokens=0)}
                yield _sse({"type": "message_start", "message": message})
            finish, stop = d.finish_reason or finish, d.stop_reason if d.finish_reason else stop
            for event in blocks.feed(reply.delta(d.text, finished=d.finish_reason is not None)):
                yield _sse(event)
        if not started:
            yield _sse({"type": "message_start", "message": {**head, "usage": _usage(run, 0)}})
        for event in blocks.close():
            yield _sse(event)
        reason, sequence = _stop_reason(finish, stop, body, blocks)
        yield _sse(
            {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
             "usage": _usage(run)}
        )  # fmt: skip
        yield _sse({"type": "message_stop"})
    except ServingError as e:
        yield _sse(_error(e))


def add_anthropic_routes(app: FastAPI, frontend: Frontend) -> None:
    """The Messages API's endpoints; their errors come back in Anthropic's shape."""
    cfg = frontend.config

    def anthropic_errors(
        fn: Callable[[Request], Awaitable[Response]],
    ) -> Callable[[Request], Awaitable[Response]]:
        @functools.wraps(fn)
        async def wrapped(request: Request) -> Response:
            try:
                key = request.headers.get("x-api-key")
                auth = f"Bearer {key}" if key is not None else None
                frontend.check_api_key(auth or request.headers.get("authorization"))
                return await fn(request)
            except ServingError as e:
                return JSONResponse(_error(e), status_code=e.http_status)

        return wrapped

    @app.post("/v1/messages")
    @anthropic_errors
    async def messages(request: Request) -> Response:
        body: MessagesRequest = parse_body(MessagesRequest, await request.body(), REFUSED_FIELDS)
        check_model(frontend, body.model)
        chat = body.chat_request(cfg.reasoning_parser)
        mid = f"msg_{uuid.uuid4().hex}"
        run = await start_chat(frontend, chat, mid, stream=body.stream)
        head = {
            "id": mid,
            "type": "message",
            "role": "assistant",
            "model": body.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
        }
        if body.stream:
            return StreamingResponse(_stream(body, run, head), media_type="text/event-stream")
        sample = await run.final(request)
        blocks = ContentBlocks()
        blocks.feed(run.builder().delta(sample.text, finished=True))
        blocks.close()
        reason, sequence = _stop_reason(sample.finish_reason, sample.stop_reason, body, blocks)
        return JSONResponse(
            {**head, "content": blocks.blocks, "stop_reason": reason, "stop_sequence": sequence,
             "usage": _usage(run)}
        )  # fmt: skip

    @app.post("/v1/messages/count_tokens")
    @anthropic_errors
    async def count_tokens(request: Request) -> Response:
        body = parse_body(CountTokensRequest, await request.body(), REFUSED_FIELDS)
        check_model(frontend, body.model)
        prompt = render_prompt(frontend, body.chat_request(cfg.reasoning_parser))
        return JSONResponse({"input_tokens": len(prompt)})
