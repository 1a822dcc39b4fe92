"""Request bodies of Anthropic's Messages API (``POST /v1/messages``,
``POST /v1/messages/count_tokens``) and their translation into a Chat Completions request,
so that a conversation runs exactly as on ``/v1/chat/completions``.

Parsed strictly: unknown fields, block types jaxpaged cannot take (images, documents,
server tools) and features it does not have are a 400 naming them (:data:`REFUSED_FIELDS`).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Tag, model_validator

from jaxpaged.serving.errors import InvalidRequest
from jaxpaged.serving.protocol import ChatCompletionRequest
from jaxpaged.serving.protocol import StrictModel as _Strict

__all__ = ["REFUSED_FIELDS", "CountTokensRequest", "MessagesRequest"]

# Fields of the Messages API that jaxpaged refuses when set (field -> why).
REFUSED_FIELDS: dict[str, str] = {
    "service_tier": "jaxpaged has one service tier",
    "container": "jaxpaged runs no code-execution containers",
    "mcp_servers": "jaxpaged connects to no MCP servers; declare tools and run them yourself",
    "inference_geo": "jaxpaged serves from where it runs",
    "speed": "jaxpaged has one speed",
    "diagnostics": "not supported",
    "context_management": "jaxpaged does not edit the conversation",
    "user_profile_id": "not supported",
    "workspace_id": "not supported",
}

_BLOCK_TYPES = ("text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking")


class _Body(_Strict):
    """A null refused field counts as not sent."""

    @model_validator(mode="before")
    @classmethod
    def _drop_null_refused(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v is None and k in REFUSED_FIELDS)}
        return data


class CacheControl(_Strict):
    """Accepted without effect: prefix caching is automatic."""

    type: Literal["ephemeral"]
    ttl: str | None = None


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: None = None


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False  # the result is written as "Error: ..."
    cache_control: CacheControl | None = None

    def text(self) -> str:
        text = self.content
        if not isinstance(text, str):
            text = "".join(b.text for b in text)
        return f"Error: {text}" if self.is_error else text


class Base64Source(_Strict):
    type: Literal["base64"]
    media_type: str  # image/png, image/jpeg or image/webp (the data decides)
    data: str

    def __repr__(self) -> str:  # never the image's bytes
        return f"Base64Source({self.media_type}, <{len(self.data)} characters>)"


class UrlSource(_Strict):
    type: Literal["url"]
    url: str  # fetched only from the server's --allowed-media-domains


class ImageBlock(_Strict):
    """An image of a vision-language model, in a user message."""

    type: Literal["image"]
    source: Base64Source | UrlSource
    cache_control: CacheControl | None = None

    def chat_part(self) -> dict[str, Any]:
        """The chat API's image_url part (serving/frontend.py decodes it)."""
        src = self.source
        url = src.url if isinstance(src, UrlSource) else f"data:{src.media_type};base64,{src.data}"
        return {"type": "image_url", "image_url": {"url": url}}


class ThinkingBlock(_Strict):
    """Earlier turns' reasoning sent back: left out of the prompt, as chat templates do."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


def _block_tag(block: Any) -> str:
    tag = block.get("type") if isinstance(block, dict) else getattr(block, "type", None)
    if tag not in _BLOCK_TYPES:
        raise InvalidRequest(
            f"content block type {tag!r} is not supported; jaxpaged takes {list(_BLOCK_TYPES)}",
            param="messages",
        )
    return "thinking" if tag == "redacted_thinking" else tag


Block = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ImageBlock, Tag("image")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[ThinkingBlock, Tag("thinking")],
    Discriminator(_block_tag),
]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    def chat_messages(self, where: str) -> list[dict[str, Any]]:
        """This message as chat messages: a user turn's tool results become tool messages,
        an assistant turn's tool_use blocks its tool_calls."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        out: list[dict[str, Any]] = []
        text, calls = "", []
        parts: list[dict[str, Any]] = []  # a user turn's text and images, once it has images
        for i, block in enumerate(self.content):
            if isinstance(block, TextBlock):
                text += block.text
            elif isinstance(block, ImageBlock):
                if self.role != "user":
                    raise InvalidRequest(
                        "image blocks belong to user messages", param=f"{where}.{i}"
                    )
                if text:
                    parts.append({"type": "text", "text": text})
                    text = ""
                parts.append(block.chat_part())
            elif isinstance(block, ToolUseBlock):
                if self.role != "assistant":
                    raise InvalidRequest(
                        "tool_use blocks belong to assistant messages", param=f"{where}.{i}"
                    )
                calls.append(
                    {
                        "id": block.id,
                        "type": "function",
                        "function": {"name": block.name, "arguments": json.dumps(block.input)},
                    }
                )
            elif isinstance(block, ToolResultBlock):
                if self.role != "user":
                    raise InvalidRequest(
                        "tool_result blocks belong to user messages", param=f"{where}.{i}"
                    )
                if text or parts:
                    out.append(_user(text, parts))
                    text, parts = "", []
                out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": block.text()})  # fmt: skip
        if self.role == "assistant":
            if text or calls:
                msg: dict[str, Any] = {"role": "assistant", "content": text or None}
                if calls:
                    msg["tool_calls"] = calls
                out.append(msg)
        elif text or parts or not out:
            out.append(_user(text, parts))
        return out


def _user(text: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
    """A user chat message of text, or of parts (images) and the text after them."""
    if not parts:
        return {"role": "user", "content": text}
    tail = [{"type": "text", "text": text}] if text else []
    return {"role": "user", "content": parts + tail}


class Tool(_Strict):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    strict: bool | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Strict):
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = None  # checked as Anthropic does; max_tokens bounds it


class OutputConfig(_Strict):
    format: dict[str, Any] | None = None  # {"type": "json_schema", "schema": ...}


class Metadata(_Strict):
    user_id: str | None = None  # accepted without effect


class _Conversation(_Body):
    model: str
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    tools: list[dict[str, Any]] | None = None  # custom tools; server tools are refused
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None

    def parsed_tools(self) -> list[Tool]:
        out = []
        for i, tool in enumerate(self.tools or ()):
            kind = tool.get("type")
            if kind not in (None, "custom"):
                raise InvalidRequest(
                    f"tools.{i}: server tool {kind!r} is not supported; declare a custom tool "
                    "(name, input_schema) and run it yourself",
                    param=f"tools.{i}.type",
                )
            try:
                out.append(Tool.model_validate(tool))
            except ValueError as e:
                raise InvalidRequest(f"tools.{i}: {e}", param=f"tools.{i}") from None
        return out

    def chat_fields(self, reasoning_parser: str | None) -> dict[str, Any]:
        """The Chat Completions fields of the conversation (messages, tools, choice)."""
        messages: list[dict[str, Any]] = []
        system = self.system
        if isinstance(system, list):
            system = "".join(b.text for b in system)
        if system:
            messages.append({"role": "system", "content": system})
        if not self.messages:
            raise InvalidRequest("messages must not be empty", param="messages")
        if self.messages[-1].role == "assistant":
            raise InvalidRequest(
                "a final assistant message (prefill) is not supported; end with a user message",
                param=f"messages.{len(self.messages) - 1}",
            )
        for i, m in enumerate(self.messages):
            messages += m.chat_messages(f"messages.{i}.content")
        fields: dict[str, Any] = {"model": self.model, "messages": messages}
        tools = self.parsed_tools()
        if tools:
            fields["tools"] = [
                {"type": "function", "function": {"name": t.name, "description": t.description,
                 "parameters": t.input_schema, "strict": t.strict}}
                for t in tools
            ]  # fmt: skip
        choice = self.tool_choice
        if choice is not None:
            if choice.type == "tool":
                if not choice.name:
                    raise InvalidRequest('tool_choice "tool" needs a name', param="tool_choice")
                fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
            else:
                fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[
                    choice.type
                ]
            if choice.disable_parallel_tool_use:
                fields["parallel_tool_calls"] = False
        if self.thinking is not None:
            if self.thinking.type == "enabled" and reasoning_parser is None:
                raise InvalidRequest(
                    "thinking needs the server to run with --reasoning-parser", param="thinking"
                )
            fields["chat_template_kwargs"] = {"enable_thinking": self.thinking.type == "enabled"}
        fmt = self.output_config.format if self.output_config is not None else None
        if fmt is not None:
            if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
                raise InvalidRequest(
                    'output_config.format must be {"type": "json_schema", "schema": {...}}',
                    param="output_config.format",
                )
            fields["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": fmt["schema"]},
            }
        return fields


def _chat(fields: dict[str, Any]) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in fields.items() if v is not None}
        )
    except ValueError as e:
        raise InvalidRequest(f"messages: {e}", param="messages") from None


class CountTokensRequest(_Conversation):
    def chat_request(self, reasoning_parser: str | None) -> ChatCompletionRequest:
        return _chat(self.chat_fields(reasoning_parser))


class MessagesRequest(_Conversation):
    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # also sent through the client's extra_body
    stop_sequences: list[str] | None = None
    stream: bool = False
    metadata: Metadata | None = None

    def chat_request(self, reasoning_parser: str | None) -> ChatCompletionRequest:
        if self.max_tokens < 1:
            raise InvalidRequest(
                f"max_tokens must be >= 1, got {self.max_tokens}", param="max_tokens"
            )
        budget = self.thinking.budget_tokens if self.thinking is not None else None
        if budget is not None and not 1024 <= budget < self.max_tokens:
            raise InvalidRequest(
                f"thinking.budget_tokens must be >= 1024 and less than max_tokens, got {budget}",
                param="thinking.budget_tokens",
            )
        fields = self.chat_fields(reasoning_parser)
        fields.update(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop=self.stop_sequences,
            stream=self.stream,
        )
        return _chat(fields)
