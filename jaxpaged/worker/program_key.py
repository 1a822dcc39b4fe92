"""The key of a compiled program kept on disk (:mod:`jaxpaged.worker.program_store`): a text
naming everything that determines it, so a program is reused only where tracing and lowering
again would give the same one.

What determines a jitted function's program: its code and the code it calls (jaxpaged's own
source files, hashed; the installed versions of JAX, jaxlib, Flax, NumPy and ml_dtypes); its
static arguments; the structure, shapes, dtypes and shardings of its array arguments; JAX's
configuration and the environment variables JAX, XLA and jaxpaged read; and the machine (the
devices, and on a CPU its instruction-set flags: XLA compiles for the host it runs on). A
static argument whose text is not stable across processes (an object printed with its
address, a function defined inside another) makes the program unkeyable: it is then traced
as usual, never loaded.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import importlib.metadata
import os
import platform
import re
import sys
import types
from collections.abc import Iterable
from typing import Any

import jax

__all__ = ["Unkeyable", "argument_text", "environment_text", "program_key", "source_digest"]

# JAX's own, XLA's and jaxpaged's settings from the environment
ENV_PREFIXES = ("JAX_", "XLA_", "JAXPAGED_", "TPU_", "LIBTPU")
# the packages whose files are jaxpaged's code (the models and kernels are packages of their own)
SOURCE_PACKAGES = ("jaxpaged", "jaxpaged.models", "jaxpaged.kernels")
SOURCE_SUFFIXES = (".py", ".cc", ".h", ".c", ".cu")
DEPENDENCIES = ("jax", "jaxlib", "flax", "numpy", "ml_dtypes")
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")


class Unkeyable(ValueError):
    """An argument whose text would differ between processes (or hide what it holds)."""


def source_digest(packages: Iterable[str] = SOURCE_PACKAGES) -> str:
    """sha256 over the path and bytes of every source file of ``packages`` (their folders,
    walked in sorted order): any edit to jaxpaged's code gives a new digest."""
    digest = hashlib.sha256()
    for name in packages:
        module = sys.modules.get(name) or __import__(name, fromlist=["_"])
        for folder in getattr(module, "__path__", ()):
            for root, dirs, files in sorted(os.walk(folder)):
                dirs[:] = sorted(d for d in dirs if d != "__pycache__")
                for file in sorted(files):
                    if file.endswith(SOURCE_SUFFIXES):
                        path = os.path.join(root, file)
                        digest.update(os.path.relpath(path, folder).encode() + b"\0")
                        with open(path, "rb") as f:
                            digest.update(f.read())
    return digest.hexdigest()


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.processor()


def environment_text(devices: Iterable[Any] | None = None) -> str:
    """The versions, machine, JAX configuration and environment a program depends on besides
    its arguments and code (``devices``: default, JAX's)."""
    devices = list(jax.devices() if devices is None else devices)
    versions = []
    for name in DEPENDENCIES:
        try:
            versions.append(f"{name}={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{name}=none")
    client = devices[0].client if devices else None
    parts = [
        f"python={sys.version}",
        ",".join(versions),
        f"machine={platform.machine()} cpu={_cpu_flags()}",
        f"platform={getattr(client, 'platform', '')} {getattr(client, 'platform_version', '')}",
        "devices=" + ";".join(f"{d.id}:{d.platform}:{d.device_kind}" for d in devices),
        "config=" + repr(sorted((k, repr(v)) for k, v in jax.config.values.items())),
        "env=" + repr(sorted((k, v) for k, v in os.environ.items() if k.startswith(ENV_PREFIXES))),
    ]
    return "\n".join(parts)


def argument_text(value: Any) -> str:
    """A stable text of a static argument: what it holds, never an address. An object may
    give its own with a ``program_key()`` method (a model's graph definition). Unkeyable
    where no stable text is known."""
    out: list[str] = []
    _write(value, out)
    return "".join(out)


def _write(value: Any, out: list[str]) -> None:
    key = getattr(type(value), "program_key", None)
    if key is not None:
        out.append(f"{_name(type(value))}<{value.program_key()}>")
    elif value is None or isinstance(value, bool | int | float | complex | str | bytes):
        out.append(f"{type(value).__name__}:{value!r}")
    elif isinstance(value, enum.Enum):
        out.append(f"{_name(type(value))}.{value.name}")
    elif isinstance(value, tuple | list):
        out.append(f"{_name(type(value))}(")
        for item in value:
            _write(item, out)
            out.append(",")
        out.append(")")
    elif isinstance(value, dict):
        out.append("dict{")
        for k in sorted(value, key=repr):
            _write(k, out)
            out.append(":")
            _write(value[k], out)
            out.append(",")
        out.append("}")
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        out.append(f"{_name(type(value))}(")
        for field in dataclasses.fields(value):
            out.append(f"{field.name}=")
            _write(getattr(value, field.name), out)
            out.append(",")
        out.append(")")
    elif isinstance(value, functools.partial):
        out.append("partial(")
        _write((value.func, value.args, value.keywords), out)
        out.append(")")
    elif isinstance(value, types.FunctionType | types.BuiltinFunctionType | type):
        name = _name(value)
        if "<locals>" in name or "<lambda>" in name:
            raise Unkeyable(f"{name}: a function made at run time (what it closes over is unseen)")
        out.append(f"fn:{name}")
    else:
        text = repr(value)
        if _ADDRESS.search(text) or type(value).__repr__ is object.__repr__:
            raise Unkeyable(f"{_name(type(value))}: its text names no contents: {text[:80]}")
        out.append(f"{_name(type(value))}:{text}")


def _name(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def _aval_text(leaf: Any) -> str:
    aval = jax.typeof(leaf)
    sharding = getattr(leaf, "sharding", None)
    return f"{aval.str_short(short_dtypes=False)}{'~' if getattr(aval, 'weak_type', False) else ''}@{sharding}"


def program_key(
    name: str,
    static: dict[str, Any],
    dynamic: tuple[tuple[Any, ...], dict[str, Any]],
    *,
    environment: str,
    source: str,
) -> str:
    """sha256 (hex) of one program: the jitted function's ``name``, its ``static`` arguments,
    the tree and array types of its ``dynamic`` ones ((args, kwargs)), the ``environment``
    (:func:`environment_text`) and the ``source`` digest. Unkeyable as
    :func:`argument_text`."""
    leaves, tree = jax.tree_util.tree_flatten(dynamic)
    text = "\n".join(
        [
            f"name={name}",
            "static=" + argument_text(dict(static)),
            f"tree={tree}",
            "avals=" + ";".join(map(_aval_text, leaves)),
            f"source={source}",
            environment,
        ]
    )
    if _ADDRESS.search(f"{tree}"):
        raise Unkeyable(f"{name}: an argument's tree names an address: {tree}")
    return hashlib.sha256(text.encode()).hexdigest()
