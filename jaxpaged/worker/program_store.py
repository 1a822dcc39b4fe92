"""Compiled programs kept on disk whole, so a process that needs a program another process
already built loads it instead of tracing and lowering it again.

JAX's persistent compilation cache skips only XLA's compilation: every new process still
traces the step function (the whole model, ~1 s) and lowers it to StableHLO (~1 s) before the
cache can answer, for each step shape. A terminal command (`jaxpaged generate`) that answers
one prompt pays that at every start. Here the compiled executable is serialized
(``jax.experimental.serialize_executable``) under a key of everything that determines it
(:mod:`jaxpaged.worker.program_key`), and loaded by the next process with the same key. A
program that cannot be keyed or serialized runs through ``jax.jit`` as usual.

Files are written whole (a temporary file, then renamed), so concurrent processes never read
a partial one; one that fails to load is ignored and replaced.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import pickle
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import jax
from jax.experimental import serialize_executable

try:  # the persistent cache's thread-local settings (JAX's own module)
    from jax._src import config as jax_config
except ImportError:  # a JAX that moved it: the store then keeps only fresh compiles
    jax_config = None

from jaxpaged.worker.program_key import Unkeyable, environment_text, program_key, source_digest

__all__ = ["ProgramStore", "StoredProgram", "compile_fresh", "default_program_cache_dir"]

logger = logging.getLogger(__name__)

FORMAT = b"jaxpaged-program-1\n"
# an XLA option that only formats dumps, and is part of the persistent cache's key
FRESH_COMPILE_OPTIONS = {"xla_dump_enable_mlir_pretty_form": True}
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
MAX_PROGRAMS = 64  # files a folder keeps (a step program of the bundled model: ~0.5 MB)


def default_program_cache_dir() -> str | None:
    """``$JAXPAGED_PROGRAM_CACHE``, else ``$JAXPAGED_CACHE/programs`` (default
    ``~/.cache/jaxpaged/programs``); None when ``JAXPAGED_PROGRAM_CACHE=0``."""
    setting = os.environ.get("JAXPAGED_PROGRAM_CACHE")
    if setting == "0":
        return None
    if setting:
        return setting
    root = os.environ.get("JAXPAGED_CACHE") or os.path.join("~", ".cache", "jaxpaged")
    return os.path.join(os.path.expanduser(root), "programs")


def compile_fresh(lowered: jax.stages.Lowered) -> tuple[jax.stages.Compiled, bool]:
    """Compiles ``lowered`` by XLA itself, not from the persistent compilation cache, and
    says whether it did. An executable the cache loaded cannot be serialized again whole
    (on the CPU it lacks its kernels' code: "Function wrapped_broadcast not found" when the
    copy runs), so the store takes only fresh ones. A dump-only XLA option gives the program
    a cache key of its own, and the cache's minimum compile time (this thread's, for this
    call) keeps it from being written there, so that key never hits. (A program this process
    compiled already comes from JAX's in-memory cache, without a compile: not stored again.)"""
    compiles: list[str] = []

    def on_event(event: str, duration_secs: float, **_: object) -> None:
        if event == BACKEND_COMPILE_EVENT:
            compiles.append(event)

    no_cache_write = getattr(jax_config, "persistent_cache_min_compile_time_secs", None)
    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        with contextlib.nullcontext() if no_cache_write is None else no_cache_write(math.inf):
            compiled = lowered.compile(compiler_options=FRESH_COMPILE_OPTIONS)
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
    return compiled, bool(compiles)


class ProgramStore:
    """One folder of serialized programs, shared by the :class:`StoredProgram` s of an
    engine. The environment's text and the source digest are computed once, at the first
    program keyed."""

    def __init__(self, folder: str) -> None:
        if not isinstance(folder, str) or not folder:
            raise ValueError(f"program store folder must be a non-empty str, got {folder!r}")
        self.folder = folder
        self._lock = threading.Lock()
        self._environment: tuple[str, str] | None = None
        self.loaded = 0  # programs loaded from the folder
        self.stored = 0  # programs compiled here and written to it

    def environment(self) -> tuple[str, str]:
        """(environment text, source digest), computed once."""
        with self._lock:
            if self._environment is None:
                self._environment = (environment_text(), source_digest())
            return self._environment

    def wrap(self, jitted: Any, name: str, static_argnames: tuple[str, ...]) -> StoredProgram:
        """``jitted`` (a ``jax.jit`` function whose static arguments are passed by the
        names in ``static_argnames``) answering from this store."""
        return StoredProgram(self, jitted, name, static_argnames)

    def path(self, key: str) -> str:
        return os.path.join(self.folder, f"{key}.jpprog")

    def load(self, key: str) -> jax.stages.Compiled | None:
        """The program stored under ``key``, or None (absent, or unreadable: logged)."""
        try:
            with open(self.path(key), "rb") as f:
                if f.read(len(FORMAT)) != FORMAT:
                    return None
                blob, in_tree, out_tree = pickle.load(f)
            compiled = serialize_executable.deserialize_and_load(blob, in_tree, out_tree)
        except FileNotFoundError:
            return None
        except Exception as exc:  # a stale or partial file: compile again, then replace it
            logger.warning("program store: %s unreadable (%s); compiling it", key[:16], exc)
            return None
        self.loaded += 1
        return compiled

    def save(self, key: str, compiled: jax.stages.Compiled) -> None:
        """Writes ``compiled`` under ``key``; a program that cannot be serialized is skipped
        (logged), as is a folder that cannot be written."""
        try:
            blob, in_tree, out_tree = serialize_executable.serialize(compiled)
            data = pickle.dumps((blob, in_tree, out_tree), protocol=pickle.HIGHEST_PROTOCOL)
            os.makedirs(self.folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(FORMAT + data)
                os.replace(tmp, self.path(key))
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except Exception as exc:
            logger.info("program store: not storing %s (%s)", key[:16], exc)
            return
        self.stored += 1
        self.prune()

    def prune(self, keep: int = MAX_PROGRAMS) -> None:
        """Deletes all but the ``keep`` most recently written programs (each edit of
        jaxpaged's code or change of settings keys new ones; the old ones are never loaded
        again)."""
        try:
            files = [e for e in os.scandir(self.folder) if e.name.endswith(".jpprog")]
            files.sort(key=lambda e: e.stat().st_mtime, reverse=True)
            for entry in files[keep:]:
                os.unlink(entry.path)
        except OSError as exc:  # another process pruning too
            logger.info("program store: pruning %s: %s", self.folder, exc)


class StoredProgram:
    """Called as the jitted function it wraps. Each distinct set of static arguments keeps
    its programs, most recently used first; a call goes to the first whose argument types
    match (a compiled program checks them, raising TypeError before it runs), else the
    program is loaded from the store or compiled (``jitted.lower(...).compile()``, which
    still uses JAX's persistent compilation cache) and stored."""

    def __init__(
        self, store: ProgramStore, jitted: Any, name: str, static_argnames: tuple[str, ...]
    ) -> None:
        self.store = store
        self.jitted = jitted
        self.name = name
        self.static_argnames = frozenset(static_argnames)
        self._programs: dict[tuple[tuple[str, Any], ...], list[Callable[..., Any]]] = {}
        self._keys: dict[str, Callable[..., Any]] = {}

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        return self.jitted.lower(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        static = {k: v for k, v in kwargs.items() if k in self.static_argnames}
        dynamic = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        group = tuple(sorted(static.items()))
        programs = self._programs.setdefault(group, [])
        for i, program in enumerate(programs):
            try:
                out = program(*args, **dynamic)
            except TypeError:  # compiled for other argument types (checked before running)
                continue
            if i:
                programs.insert(0, programs.pop(i))
            return out
        program = self._program(static, args, dynamic)
        if program is None:  # unkeyable, or a type the compiled programs refuse
            return self.jitted(*args, **kwargs)
        programs.insert(0, program)
        return program(*args, **dynamic)

    def _program(
        self, static: dict[str, Any], args: tuple[Any, ...], dynamic: dict[str, Any]
    ) -> Callable[..., Any] | None:
        environment, source = self.store.environment()
        try:
            key = program_key(
                self.name, static, (args, dynamic), environment=environment, source=source
            )
        except Unkeyable as exc:
            logger.info("program store: %s not stored (%s)", self.name, exc)
            return None
        if key in self._keys:  # its program refused these arguments: let jit decide
            return None
        compiled = self.store.load(key)
        if compiled is None:
            compiled, fresh = compile_fresh(self.jitted.lower(*args, **dynamic, **static))
            if fresh:
                self.store.save(key, compiled)
        self._keys[key] = compiled
        return compiled
