"""A gRPC ``Chat`` (messages, tools, tool choice) checked and read exactly as the HTTP API's
chat request, and the tool calls parsed from a finished sample's text.

The chat is turned into the JSON body of ``/v1/chat/completions`` and parsed by the same
model, so both APIs accept, refuse and render the same conversations.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from typing import Any

from jaxpaged.sampling_params import SamplingParams
from jaxpaged.serving import generation_pb2 as pb
from jaxpaged.serving.chat_reply import ReplyBuilder
from jaxpaged.serving.errors import InvalidRequest
from jaxpaged.serving.frontend import Frontend
from jaxpaged.serving.protocol import ChatCompletionRequest, parse_body
from jaxpaged.serving.tools import ToolPlan, plan_tools

__all__ = ["ChatTools", "chat_prompt"]

_CHAT_ROLES = ("system", "user", "assistant", "tool")


def _message(i: int, m: pb.ChatMessage) -> dict[str, Any]:
    if m.role not in _CHAT_ROLES:
        raise InvalidRequest(
            f"chat.messages[{i}].role must be one of {list(_CHAT_ROLES)}, got {m.role!r}",
            param="role",
        )
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.images:
        if m.role != "user":
            raise InvalidRequest(
                f"chat.messages[{i}]: only user messages take images", param="images"
            )
        parts: list[dict[str, Any]] = [
            {"type": "image_url", "image_url": {"url": _data_url(b)}} for b in m.images
        ]
        out["content"] = parts + ([{"type": "text", "text": m.content}] if m.content else [])
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in m.tool_calls
        ]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


def _data_url(data: bytes) -> str:
    """A data URL of image bytes, the chat path's form (engine/images.py reads the format
    from the data itself; the MIME type named here only has to be one it takes)."""
    mime = (
        "image/jpeg"
        if data[:2] == b"\xff\xd8"
        else "image/webp"
        if data[8:12] == b"WEBP"
        else "image/png"
    )
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _tool(i: int, t: pb.Tool) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": t.name}
    if t.description:
        fn["description"] = t.description
    if t.parameters:
        try:
            fn["parameters"] = json.loads(t.parameters)
        except json.JSONDecodeError as e:
            raise InvalidRequest(
                f"chat.tools[{i}].parameters is not valid JSON: {e}", param="tools"
            ) from None
    return {"type": "function", "function": fn}


def _request(chat: pb.Chat) -> ChatCompletionRequest:
    body: dict[str, Any] = {"messages": [_message(i, m) for i, m in enumerate(chat.messages)]}
    if chat.tools:
        body["tools"] = [_tool(i, t) for i, t in enumerate(chat.tools)]
    choice = chat.tool_choice.WhichOneof("choice") if chat.HasField("tool_choice") else None
    if choice == "mode":
        body["tool_choice"] = chat.tool_choice.mode
    elif choice == "function":
        body["tool_choice"] = {"type": "function", "function": {"name": chat.tool_choice.function}}
    if chat.HasField("parallel_tool_calls"):
        body["parallel_tool_calls"] = chat.parallel_tool_calls
    return parse_body(ChatCompletionRequest, json.dumps(body).encode())


async def chat_prompt(
    frontend: Frontend, chat: pb.Chat, params: SamplingParams
) -> tuple[Any, SamplingParams, ToolPlan]:
    """The chat's prompt (ids, or with images the engine's prompt dict), its params with a
    forced tool choice's grammar, and its plan."""
    body = _request(chat)
    cfg = frontend.config
    plan = plan_tools(
        body, tool_call_parser=cfg.tool_call_parser, auto_enabled=cfg.enable_auto_tool_choice
    )
    if plan.grammar is not None:
        if params.structured_output is not None:
            raise InvalidRequest(
                "a forced tool_choice constrains the output itself; it cannot be combined "
                "with structured_output",
                param="tool_choice",
            )
        params = dataclasses.replace(params, structured_output=plan.grammar)
    prompt = await frontend.chat_prompt(body.template_messages(), tools=body.template_tools())
    return prompt, params, plan


class ChatTools:
    """Adds the tool calls of each finished sample to the responses of one request."""

    def __init__(self, plan: ToolPlan) -> None:
        self._plan = plan
        self._texts: dict[int, str] = {}

    def add_calls(self, response: pb.GenerateResponse) -> None:
        if self._plan.parser is None:
            return
        for d in response.outputs:
            self._texts[d.index] = self._texts.get(d.index, "") + d.text
            if not d.finish_reason:
                continue
            reply = ReplyBuilder(None, self._plan)
            calls = reply.message(self._texts.pop(d.index)).get("tool_calls", ())
            d.tool_calls.extend(
                pb.ToolCall(
                    id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"]
                )
                for c in calls
            )
            d.finish_reason = reply.finish_reason(d.finish_reason)
