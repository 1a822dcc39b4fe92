"""A structural check that a class implements one of the engine's protocols
(``EngineClient``, ``DeviceRunner``) member by member: ``isinstance`` on a runtime-checkable
protocol checks only that the names exist, this also checks properties, async-ness and
parameters. The tests run it on the real classes and on every fake, so a fake cannot lack
(or differ in) what the engine and the servers rely on."""

from __future__ import annotations

import inspect

__all__ = ["assert_implements", "protocol_members", "protocol_problems"]


def protocol_members(protocol: type) -> dict[str, object]:
    """A protocol's members as it declares them: name -> property or function."""
    return {name: v for name, v in vars(protocol).items() if not name.startswith("_")}


def _property_problems(obj: object, cls: type, name: str) -> list[str]:
    got = inspect.getattr_static(cls, name, None)
    if isinstance(got, property):
        return []
    if not isinstance(obj, type) and name in getattr(obj, "__dict__", {}):
        return []  # a plain instance attribute also satisfies a protocol property
    return [f"{name}: must be a property (or, checking an instance, an attribute)"]


def _parameter_problems(name: str, want: inspect.Signature, got: inspect.Signature) -> list[str]:
    """Every protocol parameter exists with the same name, kind, position (if positional)
    and default; any extra parameter of the implementation is optional."""
    problems = []
    want_params = [p for p in want.parameters.values() if p.name != "self"]
    got_params = {p.name: p for p in got.parameters.values() if p.name != "self"}
    got_order = [p.name for p in got.parameters.values() if p.name != "self"]
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    for i, p in enumerate(want_params):
        q = got_params.get(p.name)
        if q is None:
            problems.append(f"{name}: no parameter {p.name!r}")
            continue
        if q.kind != p.kind:
            problems.append(f"{name}: parameter {p.name!r} is {q.kind.description}, "
                            f"the protocol's is {p.kind.description}")  # fmt: skip
        elif p.kind in positional and got_order.index(p.name) != i:
            problems.append(f"{name}: parameter {p.name!r} is not at position {i}")
        if p.default is not inspect.Parameter.empty and q.default != p.default:
            problems.append(f"{name}: parameter {p.name!r} defaults to {q.default!r}, "
                            f"the protocol's to {p.default!r}")  # fmt: skip
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    for q in got_params.values():
        extra = q.name not in {p.name for p in want_params}
        if extra and q.kind not in variadic and q.default is inspect.Parameter.empty:
            problems.append(f"{name}: extra parameter {q.name!r} has no default")
    return problems


def _method_problems(cls: type, name: str, want: object) -> list[str]:
    got = inspect.getattr_static(cls, name, None)
    if got is None:
        return [f"{name}: missing"]
    if isinstance(got, (staticmethod, classmethod)) or not inspect.isfunction(got):
        return [f"{name}: must be a plain method, got {type(got).__name__}"]
    if inspect.iscoroutinefunction(want) != inspect.iscoroutinefunction(got):
        how = "async def" if inspect.iscoroutinefunction(want) else "def (not async)"
        return [f"{name}: must be {how}"]
    return _parameter_problems(name, inspect.signature(want), inspect.signature(got))


def protocol_problems(protocol: type, obj_or_cls: object) -> list[str]:
    """What keeps ``obj_or_cls`` (a class, or an instance when some protocol properties are
    plain instance attributes) from implementing ``protocol``: each member must exist,
    properties as properties, methods async exactly where the protocol's are, with the
    protocol's parameter names, kinds, positions and defaults (extra parameters optional).
    ``isinstance`` on a runtime-checkable protocol checks only that the names exist."""
    cls = obj_or_cls if isinstance(obj_or_cls, type) else type(obj_or_cls)
    problems = []
    for name, want in protocol_members(protocol).items():
        if isinstance(want, property):
            problems += _property_problems(obj_or_cls, cls, name)
        else:
            problems += _method_problems(cls, name, want)
    return problems


def assert_implements(protocol: type, obj_or_cls: object) -> None:
    """Fails, naming every problem (:func:`protocol_problems`), unless ``obj_or_cls``
    implements ``protocol``."""
    problems = protocol_problems(protocol, obj_or_cls)
    cls = obj_or_cls if isinstance(obj_or_cls, type) else type(obj_or_cls)
    assert not problems, (
        f"{cls.__name__} does not implement {protocol.__name__}:\n  " + "\n  ".join(problems)
    )
