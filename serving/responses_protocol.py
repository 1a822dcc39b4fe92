"""Request bodies of OpenAI's Responses API (``POST /v1/responses``) and their translation
into a Chat Completions request, so that a conversation runs exactly as on
``/v1/chat/completions`` (chat template, tools, structured output, reasoning parser).

Parsed as strictly as Chat Completions: unknown fields, unknown input item types, hosted
tools and the features jaxpaged does not have are a 400 naming them (:data:`REFUSED_FIELDS`).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Discriminator as _Discriminator
from pydantic import Field, Tag, model_validator

from jaxpaged.serving.errors import InvalidRequest
from jaxpaged.serving.protocol import ChatCompletionRequest
from jaxpaged.serving.protocol import StrictModel as _Strict

__all__ = ["REFUSED_FIELDS", "ResponsesRequest", "input_messages"]

# Fields of the Responses API that jaxpaged refuses when set (field -> why).
REFUSED_FIELDS: dict[str, str] = {
    "background": "background responses are not supported; stream or wait for the response",
    "conversation": "conversation objects are not supported; use previous_response_id",
    "prompt": "reusable prompt templates are not supported; send instructions and input",
    "include": "no extra output data (encrypted reasoning, logprobs) is available",
    "reasoning": "jaxpaged has no reasoning-effort or summary control; the server's "
    "--reasoning-parser decides the reasoning items",
    "service_tier": "jaxpaged has one service tier",
    "top_logprobs": "logprobs are not available on the Responses API",
    "max_tool_calls": "jaxpaged does not run tools, so it has no tool-call limit to apply",
    "stream_options": "not supported",
    "prompt_cache_retention": "prefix caching is automatic",
}

_HOSTED_TOOLS = (
    "web_search", "web_search_preview", "file_search", "code_interpreter", "computer_use",
    "computer_use_preview", "image_generation", "mcp", "local_shell", "shell", "custom",
    "apply_patch", "tool_search",
)  # fmt: skip


class _Body(_Strict):
    """A null refused field counts as not sent, and so does ``background: false``."""

    @model_validator(mode="before")
    @classmethod
    def _drop_unset_refused(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {
                k: v
                for k, v in data.items()
                if not (k in REFUSED_FIELDS and (v is None or (k == "background" and v is False)))
            }
        return data


class InputText(_Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # output_text sent back: must be empty
    logprobs: list[Any] | None = None  # output_text sent back: ignored (no effect)


class InputImage(_Strict):
    """An image of a vision-language model: a data URL (or an http(s) URL the server may
    fetch, --allowed-media-domains); ``file_id`` is not supported."""

    type: Literal["input_image"]
    image_url: str
    detail: Literal["auto", "low", "high"] | None = None  # accepted, not used

    def __repr__(self) -> str:  # never the image's bytes
        return f"InputImage(<{len(self.image_url)} characters>)"


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText | InputImage]
    id: str | None = None  # an output item sent back
    status: str | None = None
    phase: str | None = None  # written back by the openai client; no effect

    def text(self, where: str) -> str:
        if isinstance(self.content, str):
            return self.content
        if any(isinstance(p, InputImage) for p in self.content):
            raise InvalidRequest("input_image parts are taken in input only", param=where)
        if any(part.annotations for part in self.content):
            raise InvalidRequest("annotations are not supported", param=f"{where}.content")
        return "".join(part.text for part in self.content)

    def chat_content(self, where: str) -> str | list[dict[str, Any]]:
        """The content as a chat message's: text, or with images the chat API's parts."""
        if isinstance(self.content, str) or not any(
            isinstance(p, InputImage) for p in self.content
        ):
            return self.text(where)
        if self.role != "user":
            raise InvalidRequest("input_image parts are taken in user messages only", param=where)
        return [
            {"type": "image_url", "image_url": {"url": p.image_url}}
            if isinstance(p, InputImage)
            else {"type": "text", "text": p.text}
            for p in self.content
        ]


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None


class ReasoningText(_Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Strict):
    """A reasoning item sent back: left out of the prompt, as chat templates leave out the
    reasoning of earlier turns."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: None = None
    status: str | None = None


def _item_tag(item: Any) -> str | None:
    if isinstance(item, dict):
        tag = item.get("type", "message" if "role" in item else None)
        return tag if isinstance(tag, str) else None
    return getattr(item, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    _Discriminator(_item_tag),
]


_KNOWN_ITEMS = ("message", "function_call", "function_call_output", "reasoning")


def _input_tag(value: Any) -> str:
    """Which form ``input`` takes; an unknown item type is refused by name here."""
    if isinstance(value, list):
        for i, item in enumerate(value):
            tag = _item_tag(item)
            if tag not in _KNOWN_ITEMS:
                raise InvalidRequest(
                    f"input.{i}: item type {tag!r} is not supported; jaxpaged takes "
                    f"{list(_KNOWN_ITEMS)}",
                    param=f"input.{i}.type",
                )
        return "items"
    return "text"


InputValue = Annotated[
    Annotated[str, Tag("text")] | Annotated[list[InputItem], Tag("items")],
    _Discriminator(_input_tag),
]


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: None = None  # a verbosity control: refused when set


class ResponsesRequest(_Body):
    model: str | None = None
    input: InputValue
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    tools: list[dict[str, Any]] | None = None  # function tools; hosted ones are refused
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    truncation: Literal["disabled"] | None = None  # "auto" is refused
    # accepted without effect (NO_EFFECT_FIELDS)
    user: str | None = None
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    def function_tools(self) -> list[FunctionTool]:
        out = []
        for i, tool in enumerate(self.tools or ()):
            kind = tool.get("type")
            if kind in _HOSTED_TOOLS:
                raise InvalidRequest(
                    f"tools.{i}: hosted tool {kind!r} is not supported: jaxpaged serves a model, "
                    "not OpenAI's tools; declare a function tool and run it yourself",
                    param=f"tools.{i}.type",
                )
            if kind != "function":
                raise InvalidRequest(
                    f"tools.{i}.type must be 'function', got {kind!r}", param=f"tools.{i}.type"
                )
            try:
                out.append(FunctionTool.model_validate(tool))
            except ValueError as e:
                raise InvalidRequest(f"tools.{i}: {e}", param=f"tools.{i}") from None
        return out

    def response_format(self) -> dict[str, Any] | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "json_object"}
        if fmt.schema_ is None:
            raise InvalidRequest(
                "text.format.schema is required with type json_schema", param="text.format"
            )
        return {
            "type": "json_schema",
            "json_schema": {
                "name": fmt.name or "response",
                "schema": fmt.schema_,
                "strict": fmt.strict,
            },
        }

    def chat_request(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The Chat Completions request of this turn: the instructions as a system message,
        then ``history`` (the stored conversation of previous_response_id), then the input."""
        messages = list(history) + input_messages(self.input)
        if self.instructions:
            messages.insert(0, {"role": "system", "content": self.instructions})
        tools = self.function_tools()
        chat: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": self.stream,
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": self.response_format(),
        }
        if tools:
            chat["tools"] = [
                {"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                for t in tools
            ]
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice):
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        elif choice is not None:
            chat["tool_choice"] = choice
        try:
            return ChatCompletionRequest.model_validate(
                {k: v for k, v in chat.items() if v is not None}
            )
        except ValueError as e:
            raise InvalidRequest(f"input: {e}", param="input") from None


def input_messages(items: str | list[Any]) -> list[dict[str, Any]]:
    """Chat messages of a Responses ``input``: function_call items join the assistant turn
    before them (or start one), function_call_output items become tool messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input.{i}"
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": item.chat_content(where)})
        elif isinstance(item, FunctionCallItem):
            try:
                json.loads(item.arguments)
            except json.JSONDecodeError as e:
                raise InvalidRequest(
                    f"{where}.arguments is not valid JSON: {e}", param=f"{where}.arguments"
                ) from None
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            text = item.output
            if not isinstance(text, str):
                text = "".join(part.text for part in text)
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": text})
    return out
