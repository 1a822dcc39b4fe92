"""One chat choice's reply in OpenAI's shape: the reasoning part split off
(``--reasoning-parser``), then tool calls parsed out of the content (serving/tools.py says
which parser), whole (``message``) or as streamed deltas (``delta``).

Streamed tool calls follow OpenAI's delta shape: a call's first delta carries its ``index``,
``id``, ``type`` and ``function.name`` (with empty ``arguments``), later ones
``function.arguments`` pieces of the same index; joined, they equal the whole reply's call.
"""

from __future__ import annotations

import uuid
from typing import Any

from jaxpaged.serving.reasoning import ThinkSplitter
from jaxpaged.serving.tool_parsers import CallArgs, CallHead, Segment, make_parser
from jaxpaged.serving.tools import ToolPlan

__all__ = ["ReplyBuilder"]


def _call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ReplyBuilder:
    """Use ``message(text)`` for a whole reply, or ``delta(text, finished)`` per streamed
    delta (not both on one builder)."""

    def __init__(self, reasoning_parser: str | None, tools: ToolPlan) -> None:
        self._reasoning = reasoning_parser
        self._splitter = ThinkSplitter(reasoning_parser) if reasoning_parser else None
        self._tools = tools
        self._parser = make_parser(tools.parser, tools.function_name) if tools.parser else None
        self._num_calls = 0
        self._dropping = False  # a call past the first when parallel calls are off

    @property
    def plain(self) -> bool:
        """Neither a reasoning nor a tool-call parser reads the reply."""
        return self._splitter is None and self._parser is None

    @property
    def called_tools(self) -> bool:
        return self._num_calls > 0

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's finish reason: a reply that stopped after calling tools the model chose
        to call says so; a call forced by name keeps "stop" (as OpenAI and vLLM answer)."""
        chose = self.called_tools and self._tools.parser != "named"
        return "tool_calls" if reason == "stop" and chose else reason

    def _keep(self, segments: list[Segment]) -> list[tuple[Segment, int]]:
        """(segment, index of the latest call) pairs; with parallel calls off, the calls
        after the first are dropped."""
        out = []
        for s in segments:
            if isinstance(s, CallHead):
                self._dropping = self._num_calls >= 1 and not self._tools.parallel
                if self._dropping:
                    continue
                self._num_calls += 1
            elif isinstance(s, CallArgs) and self._dropping:
                continue
            out.append((s, self._num_calls - 1))
        return out

    def message(self, text: str) -> dict[str, Any]:
        reasoning = None
        if self._splitter is not None:
            reasoning, text = self._splitter.split(text)
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        if self._reasoning is not None:
            msg["reasoning_content"] = reasoning
        if self._parser is None:
            return msg
        content, calls = "", []
        for s, _ in self._keep(self._parser.parse(text)):
            if isinstance(s, str):
                content += s
            elif isinstance(s, CallHead):
                calls.append(
                    {
                        "id": _call_id(),
                        "type": "function",
                        "function": {"name": s.name, "arguments": ""},
                    }
                )
            else:
                calls[-1]["function"]["arguments"] += s.text
        msg["content"] = None if calls and not content.strip() else content
        if calls:
            msg["tool_calls"] = calls
        return msg

    def delta(self, text: str, finished: bool) -> list[dict[str, Any]]:
        """The deltas (``delta`` objects of stream chunks) this piece of the reply releases;
        ``finished`` on the reply's last piece releases what was held back."""
        reasoning, content = "", text
        if self._splitter is not None:
            reasoning, content = self._splitter.feed(text)
            if finished:
                tail_r, tail_c = self._splitter.flush()
                reasoning, content = reasoning + tail_r, content + tail_c
        out: list[dict[str, Any]] = []
        if reasoning:
            out.append({"reasoning_content": reasoning})
        if self._parser is None:
            if content or self._splitter is None:
                out.append({"content": content})
            return out
        segments = self._parser.feed(content)
        if finished:
            segments += self._parser.finish()
        for s, index in self._keep(segments):
            if isinstance(s, str):
                out.append({"content": s})
            elif isinstance(s, CallHead):
                head = {"name": s.name, "arguments": ""}
                call = {"index": index, "id": _call_id(), "type": "function"}
                out.append({"tool_calls": [{**call, "function": head}]})
            else:
                call = {"index": index, "function": {"arguments": s.text}}
                out.append({"tool_calls": [call]})
        return out
