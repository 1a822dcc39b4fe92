"""A chat request's tool choice: which parser reads the reply, and the grammar a forced
choice puts on it.

As vLLM does it: ``tool_choice`` defaults to ``auto`` when tools are given (``none``
otherwise); ``auto`` needs the server's ``--enable-auto-tool-choice`` and
``--tool-call-parser`` (the reply is parsed in the model's own format, nothing is enforced);
a named function constrains the reply to that function's arguments (its parameters' JSON
schema) and ``required`` to a JSON array of ``{"name", "parameters"}`` objects, one of the
tools each, so the arguments always parse; ``none`` leaves the reply as content (the tools
are still shown to the model, as vLLM does by default).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxpaged.sampling_params import StructuredOutput
from jaxpaged.serving.errors import InvalidRequest
from jaxpaged.serving.protocol import ChatCompletionRequest, NamedToolChoice

__all__ = ["ToolPlan", "plan_tools"]

_NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """How one chat request's reply is read."""

    parser: str | None = None  # hermes, llama3_json, required, named; None: all content
    function_name: str | None = None  # the named choice
    grammar: StructuredOutput | None = None  # the forced choice's constraint
    parallel: bool = True  # several calls allowed


def plan_tools(
    body: ChatCompletionRequest, *, tool_call_parser: str | None, auto_enabled: bool
) -> ToolPlan:
    """The request's ToolPlan; InvalidRequest (naming tools or tool_choice) for a choice the
    request or the server cannot honour."""
    tools = body.tools or []
    choice = body.tool_choice
    parallel = body.parallel_tool_calls is not False
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and not tools:
        raise InvalidRequest("tool_choice needs tools to choose from", param="tool_choice")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequest(f"tools: function names must be distinct, got {names}", param="tools")
    if choice == "none":
        return ToolPlan()
    if choice == "auto":
        if not auto_enabled or tool_call_parser is None:
            raise InvalidRequest(
                'tool_choice "auto" (the default when tools are given) needs the server to run '
                "with --enable-auto-tool-choice and --tool-call-parser",
                param="tool_choice",
            )
        strict = [t.function.name for t in tools if t.function.strict]
        if strict:
            raise InvalidRequest(
                f"tools {strict} ask for strict arguments, which only a forced tool_choice "
                '("required" or a named function) enforces',
                param="tools",
            )
        return ToolPlan(parser=tool_call_parser, parallel=parallel)
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in names:
            raise InvalidRequest(
                f"tool_choice names function {name!r}, which is not among the tools {names}",
                param="tool_choice",
            )
        schema = _parameters(tools[names.index(name)].function.parameters)
        return ToolPlan(
            parser="named", function_name=name, grammar=_grammar(schema), parallel=False
        )
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": _parameters(t.function.parameters),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        array["maxItems"] = 1
    return ToolPlan(parser="required", grammar=_grammar(array), parallel=parallel)


def _parameters(schema: dict[str, Any] | None) -> dict[str, Any]:
    return schema if schema else _NO_ARGUMENTS


def _grammar(schema: dict[str, Any]) -> StructuredOutput:
    try:
        return StructuredOutput(json=schema)
    except ValueError as e:
        raise InvalidRequest(f"tools: {e}", param="tools") from None
