"""The package's shape: imports form no cycle, not even through imports inside functions,
and dependencies point one way (serving -> engine -> sched and worker -> models and kernels;
sched imports no JAX; kernels import nothing else of jaxpaged's). Read from the sources with
``ast``, so nothing is imported."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = {"jaxpaged": REPO / "jaxpaged", "jaxpaged.kernels": REPO / "kernels",
         "jaxpaged.models": REPO / "models", "jaxpaged.serving": REPO / "serving"}  # fmt: skip


def _modules() -> dict[str, Path]:
    out = {}
    for package, root in ROOTS.items():
        for path in root.rglob("*.py"):
            if "proto" in path.parts or path.name.endswith("_pb2.py"):
                continue
            rel = path.relative_to(root).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    # the mapped subpackages are not also modules under jaxpaged/
    return out


def _imports(name: str, path: Path, known: set[str], *, in_functions: bool) -> set[str]:
    """jaxpaged modules imported by ``name``: at module level, and with ``in_functions``
    also inside functions and the modules it imports by name (``importlib.import_module``
    over a table of module names, as models/registry.py does). An import inside a function
    forms no import-time cycle, but it is a dependency all the same: a cycle through one
    only waits for the first call."""
    tree = ast.parse(path.read_text())
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def add(target: str) -> None:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)

    nodes = ast.walk(tree) if in_functions else tree.body
    by_name = False
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name if is_package else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    pkg = pkg.rpartition(".")[0]
                base = f"{pkg}.{base}" if base else pkg
            for alias in node.names:
                add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
        elif isinstance(node, ast.Attribute) and node.attr == "import_module":
            by_name = True
    if by_name:  # every string of the module that names a module, absolute or in its package
        package = name if is_package else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for target in (node.value, f"{package}.{node.value}"):
                    if target in known and target != name:
                        found.add(target)
    return found


def _graph(*, in_functions: bool = False) -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {m: _imports(m, p, known, in_functions=in_functions) for m, p in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []
    cycles = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for dep in sorted(graph[m]):
            # a package importing its own submodules is how packages export names
            if m.startswith(dep + ".") or dep.startswith(m + "."):
                continue
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return cycles


def test_no_import_cycles():
    cycles = _cycles(_graph())
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_no_import_cycles_through_imports_inside_functions():
    cycles = _cycles(_graph(in_functions=True))
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_cycle_check_sees_imports_inside_functions(tmp_path, monkeypatch):
    """The check fails on a cycle hidden in a function-level import (as models/config.py
    <-> models/gpt.py once was) and on one through a by-name import."""
    pkg = tmp_path / "fake"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import x\n")
    (pkg / "c.py").write_text(
        "import importlib\nT = {'k': 'd'}\ndef g(m):\n    return importlib.import_module(m)\n"
    )
    (pkg / "d.py").write_text("from .c import T\n")
    monkeypatch.setitem(ROOTS, "jaxpaged.fake", pkg)
    cycles = _cycles(_graph(in_functions=True))
    assert ["jaxpaged.fake.a", "jaxpaged.fake.b", "jaxpaged.fake.a"] in cycles
    assert ["jaxpaged.fake.c", "jaxpaged.fake.d", "jaxpaged.fake.c"] in cycles
    assert not any("jaxpaged.fake.a" in c for c in _cycles(_graph()))


def _imports_of(prefix: str) -> dict[str, set[str]]:
    graph = _graph(in_functions=True)
    return {m: deps for m, deps in graph.items() if m == prefix or m.startswith(prefix + ".")}


def test_sched_is_plain_python():
    for m, path in _modules().items():
        if m.startswith("jaxpaged.sched"):
            assert not re.search(r"^\s*(import|from)\s+jax\b", path.read_text(), re.M), m
    for m, deps in _imports_of("jaxpaged.sched").items():
        bad = {d for d in deps if d.split(".")[1] in ("engine", "worker", "serving", "kernels")}
        assert not bad, (m, bad)


def test_importing_sched_imports_no_jax():
    """Also through what it imports (its settings' config, the models' plain ModelConfig)."""
    import subprocess
    import sys

    names = sorted(m for m in _modules() if m.startswith("jaxpaged.sched"))
    code = f"import sys\nfor m in {names!r}: __import__(m)\nprint('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_dependencies_point_one_way():
    rules = {  # package -> jaxpaged packages it must not import
        "jaxpaged.kernels": {"engine", "worker", "sched", "serving", "models", "distributed",
                             "cli", "llm", "generate", "args"},
        "jaxpaged.models": {"engine", "worker", "sched", "serving", "cli", "llm"},
        "jaxpaged.worker": {"engine", "serving", "cli", "llm"},
        "jaxpaged.engine": {"serving", "cli"},
    }  # fmt: skip
    for package, banned in rules.items():
        for m, deps in _imports_of(package).items():
            bad = {d for d in deps if d.split(".")[1] in banned and not d.startswith(package)}
            assert not bad, (m, bad)
