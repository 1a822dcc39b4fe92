"""`jaxpaged bench NAME [flags]`: runs the benchmark script bench/NAME.py of a source checkout
(the benchmarks are scripts beside the package, not part of the installed wheel)."""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["bench_dir", "benchmarks", "main"]

# helpers the scripts import, and the scripts bench/vllm_peer.py runs under vLLM's own Python
_NOT_BENCHMARKS = (
    "common",
    "accelerator_kernels",
    "vllm_peer",
    "vllm_offline",
    "vllm_bench_client",
)


def bench_dir() -> Path | None:
    """bench/ of the checkout jaxpaged runs from ($JAXPAGED_BENCH_DIR overrides), or None."""
    if os.environ.get("JAXPAGED_BENCH_DIR"):
        return Path(os.environ["JAXPAGED_BENCH_DIR"])
    import jaxpaged

    folder = Path(jaxpaged.__file__).resolve().parents[1] / "bench"
    return folder if folder.is_dir() else None


def benchmarks(folder: Path) -> list[str]:
    """The runnable scripts of ``folder``: those with a ``__main__`` block."""
    return sorted(
        p.stem
        for p in folder.glob("*.py")
        if p.stem not in _NOT_BENCHMARKS and 'if __name__ == "__main__"' in p.read_text()
    )


def main(argv: Sequence[str] | None = None, prog: str = "jaxpaged bench") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    folder = bench_dir()
    if folder is None:
        print(
            f"error: {prog} runs the benchmarks of a source checkout, and this jaxpaged is "
            "installed without one; clone the repository and `pip install -e .` there "
            "(or set JAXPAGED_BENCH_DIR to its bench/ folder)",
            file=sys.stderr,
        )
        return 2
    names = benchmarks(folder)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: {prog} NAME [flags]   ({prog} NAME --help for a benchmark's flags)")
        print(f"benchmarks in {folder}: {', '.join(names)}")
        return 0 if argv else 2
    name, rest = argv[0].removesuffix(".py"), argv[1:]
    if name not in names:
        print(f"error: no benchmark {name!r}; choose one of: {', '.join(names)}", file=sys.stderr)
        return 2
    script = folder / f"{name}.py"
    # the scripts import each other by bare name, as when run as `python bench/NAME.py`
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv, sys.path[:0] = [str(script), *rest], [str(folder)]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return 0
