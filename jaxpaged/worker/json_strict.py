"""The strict reading of a JSON schema that structured output uses by default, as OpenAI's
strict schemas and xgrammar's strict mode read one: an object schema that declares its
``properties`` takes no others unless it says so (``additionalProperties``,
``patternProperties`` or ``unevaluatedProperties``). Without it a small model at temperature
0 invents key after key until ``max_tokens`` and its JSON never closes.

An object schema that declares no properties (``{"type": "object"}``) stays open: any
properties are what it asks for. The branches of an ``allOf`` stay open too (closing each
would forbid its siblings' properties); their parent is closed over the union.
"""

from __future__ import annotations

from typing import Any

__all__ = ["close_schema"]

_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SCHEMA_VALUES = (
    "items", "additionalProperties", "not", "if", "then", "else", "contains",
    "propertyNames", "unevaluatedItems", "unevaluatedProperties",
)  # fmt: skip


def close_schema(schema: Any) -> Any:
    """A copy of ``schema`` whose object schemas take only their declared properties."""
    return _close(schema, in_all_of=False)


def _close(node: Any, *, in_all_of: bool) -> Any:
    if isinstance(node, list):  # "items" as a list (draft 4)
        return [_close(s, in_all_of=False) for s in node]
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            out[key] = {k: _close(v, in_all_of=False) for k, v in node[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            out[key] = [_close(s, in_all_of=False) for s in node[key]]
    for key in _SCHEMA_VALUES:
        if isinstance(node.get(key), (dict, list)):
            out[key] = _close(node[key], in_all_of=False)
    if isinstance(node.get("allOf"), list):
        out["allOf"] = [_close(s, in_all_of=True) for s in node["allOf"]]
        declared = any(isinstance(s, dict) and "properties" in s for s in node["allOf"])
    else:
        declared = False
    declared = declared or isinstance(node.get("properties"), dict)
    if declared and not in_all_of and not any(k in node for k in _OPEN_KEYS):
        out["additionalProperties"] = False
    return out
