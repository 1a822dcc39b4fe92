"""A model's chat template rendered with jinja2 alone, as transformers renders it.

transformers' ``apply_chat_template`` compiles the template in a sandboxed jinja2
environment (``trim_blocks``, ``lstrip_blocks``, the loop controls) with its own globals
(``raise_exception``, ``strftime_now``, a restricted ``dict`` and ``namespace``) and a
``tojson`` filter that does not escape HTML; the template sees the messages (``None`` values
dropped, reasoning copied under each of its names), ``tools``, ``documents``,
``add_generation_prompt``, the named special tokens and the caller's extra variables. This
module does the same without importing transformers (~0.7 s of a terminal command's
start-up), so the two render the same text.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["compile_chat_template", "render_chat"]

# The names a message's reasoning is passed under; templates read the first.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers marks the assistant's tokens
    with it): the body rendered as it is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _TemplateDict:
    """``dict(...)`` in a template, without the type's other attributes."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` refusing underscore names (no way to CPython's internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (jinja's own signature trick)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, "
                f"but got {name!r}."
            )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:  # noqa: A002 (the templates' keyword)
    return datetime.now().strftime(format)


def compile_chat_template(text: str) -> jinja2.Template:
    """The template compiled in transformers' sandboxed environment."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(text)


def _plain(value: Any) -> Any:
    """``value`` rebuilt from plain JSON types (anything else: a ``<TypeName>`` placeholder),
    so the sandbox never sees an object's methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if hasattr(value, "item") and callable(value.item) and type(value).__module__ == "numpy":
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models (the OpenAI SDK's)
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _message(message: Any, index: int) -> dict:
    """One message as the template sees it: None values dropped, reasoning aliased."""
    if callable(getattr(message, "model_dump", None)) or dataclasses.is_dataclass(message):
        message = _plain(message)
    if not isinstance(message, Mapping):
        raise ValueError(f"messages[{index}] must be a mapping, got {type(message).__name__}")
    out = {k: v for k, v in _plain(message).items() if v is not None}
    reasoning = next((out[k] for k in _REASONING_FIELDS if out.get(k) is not None), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def render_chat(
    template: jinja2.Template,
    messages: Sequence[Any],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    variables: Mapping[str, Any] | None = None,
) -> str:
    """The conversation rendered; ``variables``: the special tokens and the caller's extra
    template variables (the caller's win)."""
    if not messages:
        raise ValueError("cannot apply a chat template to an empty conversation")
    if tools is not None:
        for i, tool in enumerate(tools):
            if not isinstance(tool, Mapping):
                raise ValueError(
                    f"tools[{i}] must be a JSON schema (a mapping), got {type(tool).__name__}"
                )
    if documents is not None:
        for i, doc in enumerate(documents):
            if not isinstance(doc, Mapping):
                raise ValueError(f"documents[{i}] must be a mapping with 'title' and 'text'")
    return template.render(
        messages=[_message(m, i) for i, m in enumerate(messages)],
        tools=_plain(None if tools is None else list(tools)),
        documents=_plain(None if documents is None else list(documents)),
        add_generation_prompt=add_generation_prompt,
        **_plain(dict(variables or {})),
    )
