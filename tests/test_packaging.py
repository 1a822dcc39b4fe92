"""kernels/, models/ and serving/ are importable as jaxpaged.* both from the editable install
and from a normal wheel (setuptools package-dir mapping)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUBPACKAGES = ("kernels", "models", "serving")
PROBE = (
    "import jaxpaged, jaxpaged.kernels, jaxpaged.models, jaxpaged.serving;"
    "print(jaxpaged.kernels.__file__); print(jaxpaged.models.__file__);"
    "print(jaxpaged.serving.__file__)"
)


def _probe(cwd: Path, env: dict[str, str] | None = None) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=cwd, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_editable_install_maps_subpackages(tmp_path):
    files = _probe(tmp_path)  # outside the repository: only the installed finder can help
    for name, f in zip(SUBPACKAGES, files, strict=True):
        assert Path(f) == REPO / name / "__init__.py"


def test_wheel_contains_and_imports_subpackages(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(REPO),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("jaxpaged-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for sub in SUBPACKAGES:
        assert f"jaxpaged/{sub}/__init__.py" in names
    assert not any(n.startswith(("kernels/", "models/", "serving/", "tests/")) for n in names)
    # the native kernels' sources: built on first use
    for src in ("cpu_native.cc", "cpu_linear.cc", "cpu_argmax.cc", "cpu_parallel.h", "cpu_simd.h"):
        assert f"jaxpaged/kernels/cpu/{src}" in names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # Only the unpacked wheel may provide jaxpaged: run with -S-free path, editable finder off.
    env = dict(os.environ, PYTHONPATH=str(site), PYTHONNOUSERSITE="1")
    no_editable = (
        "import sys; sys.meta_path[:] = [f for f in sys.meta_path "
        "if 'editable' not in type(f).__module__.lower()];"
    )
    code = no_editable + PROBE
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    for name, f in zip(SUBPACKAGES, out.stdout.split(), strict=True):
        assert Path(f) == site / "jaxpaged" / name / "__init__.py"
    # The installed kernel sources are the ones this checkout builds: the library is keyed by
    # sources, flags and CPU, so a cache seeded with this process's build is reused (no second
    # g++ run, ~40 s) exactly when the wheel's sources equal the checkout's.
    if not (shutil.which("g++") or shutil.which("c++")):
        return
    from jaxpaged.kernels import cpu

    built = cpu._build()
    seeded = tmp_path / "cache" / "native"
    seeded.mkdir(parents=True)
    shutil.copy2(built, seeded / built.name)
    build = no_editable + "from jaxpaged.kernels import cpu; print(cpu._register(), cpu.__file__)"
    env["JAXPAGED_CACHE"] = str(tmp_path / "cache")
    out = subprocess.run(
        [sys.executable, "-c", build], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [
        "None",
        str(site / "jaxpaged" / "kernels" / "cpu" / "__init__.py"),
    ]
    assert [p.name for p in seeded.glob("kernels_*.so")] == [built.name], "sources differ"


def _top_level_kernels(drop: bool) -> str:
    """Where `import kernels` resolves in `python -m`'s sys.path (the checkout root first)."""
    code = (
        "import importlib.util, sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "import jaxpaged\n"
        "from jaxpaged.cli.checkout_path import drop_checkout_root\n"
        f"if {drop}: drop_checkout_root({str(REPO)!r})\n"
        "spec = importlib.util.find_spec('kernels')\n"
        "print(spec.origin if spec else None)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_python_m_from_the_checkout_does_not_shadow_the_kernels_distribution():
    """transformers >= 5.25 imports the `kernels` distribution: the checkout's kernels/ must
    not stand in for it when `python -m jaxpaged ...` runs from the checkout root."""
    assert _top_level_kernels(drop=False) == str(REPO / "kernels" / "__init__.py")
    assert _top_level_kernels(drop=True) != str(REPO / "kernels" / "__init__.py")


def test_the_suite_does_not_see_the_checkout_kernels_as_a_distribution():
    import importlib.util

    spec = importlib.util.find_spec("kernels")
    assert spec is None or spec.origin != str(REPO / "kernels" / "__init__.py")
    assert os.environ.get("PYTHONSAFEPATH") == "1"  # the subprocesses the tests start
