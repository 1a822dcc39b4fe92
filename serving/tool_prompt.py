"""Tools in the prompt: the conversation and ``tools`` handed to the chat template, with a
fallback for templates that do not render them.

A template that renders ``tools`` (Qwen2.5/3, Llama 3.1+, Hermes, Mistral, ...) gets them as
they are, and one that renders assistant ``tool_calls`` and ``tool`` messages gets those as
they are. A template that ignores them (the bundled SmolLM2's ChatML template does) would
silently drop them, so instead:

- the tools become a system block in the format of the server's tool-call parser (Hermes'
  ``<tools>`` block as Qwen2.5's template writes it, or Llama 3.1's JSON instructions), added
  to the first system message or put in a new one;
- an assistant message's ``tool_calls`` are written into its content in that format;
- a ``tool`` message becomes a user message holding ``<tool_response>...</tool_response>``
  (as Qwen2.5's template renders tool results).

What a template renders is found once per template by rendering a probe conversation.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["TemplateToolSupport", "conversation_for_template", "tool_system_block"]

_PROBE_NAME = "jaxpaged_probe_function"
_PROBE_RESULT = "jaxpaged_probe_result"


@dataclasses.dataclass(frozen=True)
class TemplateToolSupport:
    """What a chat template renders itself."""

    tools: bool  # the `tools` variable
    tool_turns: bool  # assistant tool_calls and tool-role messages

    @classmethod
    def probe(cls, render: Callable[..., str]) -> TemplateToolSupport:
        """``render(messages, **kwargs)`` applies the template and returns its text."""
        tool = {
            "type": "function",
            "function": {"name": _PROBE_NAME, "description": "", "parameters": {}},
        }
        call = {
            "id": "call_0",
            "type": "function",
            "function": {"name": _PROBE_NAME, "arguments": {}},
        }
        turns = [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": _PROBE_RESULT, "tool_call_id": "call_0"},
        ]
        return cls(
            tools=_renders(render, [{"role": "user", "content": "x"}], _PROBE_NAME, tools=[tool]),
            tool_turns=_renders(render, turns, _PROBE_NAME, _PROBE_RESULT),
        )


def _renders(render: Callable[..., str], messages: list, *needles: str, **kwargs: Any) -> bool:
    try:
        text = render(messages, **kwargs)
    except Exception:  # the template refuses the probe (e.g. an unknown role)
        return False
    return isinstance(text, str) and all(n in text for n in needles)


def tool_system_block(tools: Sequence[dict[str, Any]], parser: str | None) -> str:
    """How the tools are described to a model whose template does not render them."""
    if parser == "llama3_json":
        return (
            "You have access to the following functions. To call a function, respond with "
            'JSON for a function call in the format {"name": function name, "parameters": '
            "dictionary of argument name and its value}. Do not use variables.\n\n"
            + "\n\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        )
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        + "\n</tools>\n\nFor each function call, return a json object with function name and "
        "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def _written_call(call: dict[str, Any], parser: str | None) -> str:
    fn = call["function"]
    if parser == "llama3_json":
        return json.dumps({"name": fn["name"], "parameters": fn["arguments"]}, ensure_ascii=False)
    body = json.dumps({"name": fn["name"], "arguments": fn["arguments"]}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def conversation_for_template(
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None,
    support: TemplateToolSupport,
    parser: str | None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) to hand to the template: as they are where it renders them,
    written into the messages (module docstring) where it does not."""
    out = [dict(m) for m in messages]
    if not support.tool_turns:
        for i, m in enumerate(out):
            if m["role"] == "tool":
                out[i] = {
                    "role": "user",
                    "content": f"<tool_response>\n{m['content']}\n</tool_response>",
                }
            elif m.get("tool_calls"):
                sep = ";" if parser == "llama3_json" else "\n"
                written = sep.join(_written_call(c, parser) for c in m.pop("tool_calls"))
                m["content"] = f"{m['content']}\n{written}" if m["content"] else written
    if not tools or support.tools:
        return out, (list(tools) if tools else None)
    block = tool_system_block(tools, parser)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}".lstrip()}
    else:
        out.insert(0, {"role": "system", "content": block})
    return out, None
