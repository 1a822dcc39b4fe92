"""Tool-call parsers: split a chat reply into content and OpenAI tool calls, whole or as it
streams.

Formats (``--tool-call-parser``, vLLM's names):

- ``hermes`` (Qwen2.5, Qwen3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks anywhere in the reply; the text around them is content.
- ``llama3_json`` (Llama 3.1-3.3): a reply that opens with ``{`` (or ``<|python_tag|>``) is one
  or more ``{"name": ..., "parameters": {...}}`` objects separated by ``;``; any other reply is
  content.

and the two formats a forced ``tool_choice`` constrains the reply to (as vLLM does): a named
function's reply is that function's arguments object; ``required`` makes it a JSON array of
``{"name": ..., "parameters": {...}}``.

A parser is fed the reply's text deltas and returns :data:`Segment` s: content text, the head
of a call (its name) and argument text of the latest call. A call is released only once it is
whole and its JSON parses, so streaming and the whole reply give the same calls; a call whose
JSON does not parse (or that the reply cut off) stays content. The named-function parser
streams its arguments as they come (the grammar guarantees them).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

__all__ = [
    "TOOL_CALL_PARSERS",
    "CallArgs",
    "CallHead",
    "ToolCallParser",
    "make_parser",
    "partial_suffix",
]

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
_PYTHON_TAG = "<|python_tag|>"


@dataclasses.dataclass(frozen=True)
class CallHead:
    """A new tool call, by function name (its arguments follow as CallArgs)."""

    name: str


@dataclasses.dataclass(frozen=True)
class CallArgs:
    """Argument JSON text of the latest CallHead."""

    text: str


Segment = str | CallHead | CallArgs


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (a tag cut by a delta)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _call(obj: Any, arg_keys: tuple[str, ...]) -> list[Segment] | None:
    """A parsed call object as (head, args) segments, or None if it is not a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = {}
    for key in arg_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return [CallHead(obj["name"]), CallArgs(json.dumps(args, ensure_ascii=False))]


def _decode_object(text: str) -> tuple[Any, int] | None:
    """The JSON value at the start of ``text`` (which starts with '{' or '[') and where it
    ends, or None if it is not whole (yet) or malformed."""
    try:
        return json.JSONDecoder().raw_decode(text)
    except json.JSONDecodeError:
        return None


class ToolCallParser:
    """One reply's parser: ``feed(text)`` per delta, then ``finish()``; ``parse(text)`` for a
    whole reply (on a fresh parser)."""

    def __init__(self) -> None:
        self._buf = ""

    def feed(self, text: str) -> list[Segment]:
        self._buf += text
        return _merge(self._scan(final=False))

    def finish(self) -> list[Segment]:
        return _merge(self._scan(final=True))

    def parse(self, text: str) -> list[Segment]:
        return _merge(self.feed(text) + self.finish())

    def _scan(self, final: bool) -> list[Segment]:
        raise NotImplementedError


def _merge(segments: list[Segment]) -> list[Segment]:
    """Adjacent content pieces joined, empty ones dropped."""
    out: list[Segment] = []
    for s in segments:
        if isinstance(s, str):
            if not s:
                continue
            if out and isinstance(out[-1], str):
                out[-1] += s
                continue
        out.append(s)
    return out


class HermesParser(ToolCallParser):
    _OPEN, _CLOSE = "<tool_call>", "</tool_call>"

    def _scan(self, final: bool) -> list[Segment]:
        out: list[Segment] = []
        while True:
            buf = self._buf
            start = buf.find(self._OPEN)
            if start < 0:
                keep = 0 if final else partial_suffix(buf, self._OPEN)
                out.append(buf[: len(buf) - keep])
                self._buf = buf[len(buf) - keep :]
                return out
            out.append(buf[:start])
            close = buf.find(self._CLOSE, start + len(self._OPEN))
            if close < 0 and not final:  # wait for the whole call
                self._buf = buf[start:]
                return out
            end = len(buf) if close < 0 else close + len(self._CLOSE)
            body = buf[start + len(self._OPEN) : close if close >= 0 else end].strip()
            decoded = _decode_object(body) if body.startswith("{") else None
            call = None
            if decoded is not None and not body[decoded[1] :].strip():
                call = _call(decoded[0], ("arguments", "parameters"))
            out.extend(call if call is not None else [buf[start:end]])
            self._buf = buf[end:]


class Llama3JsonParser(ToolCallParser):
    def __init__(self) -> None:
        super().__init__()
        self._state = "start"  # start -> calls (-> content), or start -> content

    def _scan(self, final: bool) -> list[Segment]:
        if self._state == "start":
            head = self._buf.lstrip()
            if head.startswith(_PYTHON_TAG) or head.startswith("{"):
                self._state = "calls"
            elif not final and (not head or _PYTHON_TAG.startswith(head)):
                return []
            else:
                self._state = "content"
        if self._state == "content":
            text, self._buf = self._buf, ""
            return [text]
        out: list[Segment] = []
        while True:
            rest = self._buf.lstrip()
            while rest.startswith((";", _PYTHON_TAG)):
                rest = rest[1 if rest[0] == ";" else len(_PYTHON_TAG) :].lstrip()
            if not rest or (not final and _PYTHON_TAG.startswith(rest)):
                self._buf = rest
                return out
            decoded = _decode_object(rest) if rest.startswith("{") else None
            if decoded is None:
                if not final and rest.startswith("{"):  # not whole yet
                    self._buf = rest
                    return out
                self._state, self._buf = "content", ""  # malformed, or text after the calls
                out.append(rest)
                return out
            call = _call(decoded[0], ("parameters", "arguments"))
            out.extend(call if call is not None else [rest[: decoded[1]]])
            self._buf = rest[decoded[1] :]


class RequiredParser(ToolCallParser):
    """``tool_choice="required"``: the reply is a JSON array of calls (grammar-enforced)."""

    def __init__(self) -> None:
        super().__init__()
        self._state = "start"  # start -> items -> done, or start -> content

    def _scan(self, final: bool) -> list[Segment]:
        out: list[Segment] = []
        if self._state == "start":
            rest = self._buf.lstrip()
            if not rest and not final:
                return out
            if rest.startswith("["):
                self._state, self._buf = "items", rest[1:]
            else:
                self._state = "content"
        while self._state == "items":
            rest = self._buf.lstrip().lstrip(",").lstrip()
            if rest.startswith("]"):
                self._state, self._buf = "content", rest[1:]
                break
            decoded = _decode_object(rest) if rest.startswith("{") else None
            if decoded is None:
                if not final and (not rest or rest.startswith("{")):
                    self._buf = rest
                    return out
                self._state, self._buf = "content", rest
                break
            call = _call(decoded[0], ("parameters", "arguments"))
            out.extend(call if call is not None else [rest[: decoded[1]]])
            self._buf = rest[decoded[1] :]
        if self._state == "content":
            out.append(self._buf)
            self._buf = ""
        return out


class NamedFunctionParser(ToolCallParser):
    """A named ``tool_choice``: the whole reply is the function's arguments (grammar-enforced),
    streamed as it comes."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name
        self._started = False

    def _scan(self, final: bool) -> list[Segment]:
        out: list[Segment] = []
        if not self._started and (self._buf or final):
            self._started = True
            out.append(CallHead(self._name))
        if self._buf:
            out.append(CallArgs(self._buf))
            self._buf = ""
        return out


def make_parser(kind: str, function_name: str | None = None) -> ToolCallParser:
    """A fresh parser: ``hermes``, ``llama3_json``, ``required`` or ``named`` (with
    ``function_name``)."""
    if kind == "hermes":
        return HermesParser()
    if kind == "llama3_json":
        return Llama3JsonParser()
    if kind == "required":
        return RequiredParser()
    if kind == "named" and function_name:
        return NamedFunctionParser(function_name)
    raise ValueError(f"tool call parser must be one of {list(TOOL_CALL_PARSERS)}, got {kind!r}")
