"""Every benchmark of bench/ answers ``--help`` (what `jaxpaged bench NAME --help` shows), and
`jaxpaged bench` lists exactly the tools, not the helpers the scripts share."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench_env import script_env

from jaxpaged.cli import bench as bench_cli

ROOT = Path(__file__).resolve().parents[2]
TOOLS = {
    "accelerator_check", "cold_start", "embed", "gpu_decode", "attention_backends", "kv_offload", "overlap", "quant",
    "q4_vs_float", "quant_quality",
    "roofline", "serving", "speculative", "step_breakdown", "structured_json", "throughput",
    "vision",
}  # fmt: skip

# Runs each tool as `python bench/NAME.py --help` would (as __main__, its folder first on
# sys.path), all in one interpreter: one start instead of one per tool, the imports shared.
_RUN_ALL_HELP = """
import contextlib, io, json, os, runpy, sys
bench = os.path.abspath("bench")
sys.path.insert(0, bench)
results = {}
for name in sys.argv[1:]:
    path = os.path.join(bench, name + ".py")
    sys.argv = [path, "--help"]
    out, err, code = io.StringIO(), io.StringIO(), None
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        code = e.code
    except BaseException as e:
        code = repr(e)
    results[name] = [code, out.getvalue(), err.getvalue()]
print(json.dumps(results))
"""


def test_the_listed_benchmarks_are_the_tools():
    assert set(bench_cli.benchmarks(ROOT / "bench")) == TOOLS


def test_every_tool_answers_help():
    env = script_env(JAX_PLATFORMS="cpu")
    shell = subprocess.Popen(
        ["bash", "bench/accelerator_check.sh", "--help"], cwd=ROOT, text=True,
        env={**env, "PYTHON": sys.executable, "OUT": ""},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", _RUN_ALL_HELP, *sorted(TOOLS)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(results) == TOOLS
    out, err = shell.communicate(timeout=300)
    results["accelerator_check.sh"] = [shell.returncode, out, err]
    for name, (code, out, err) in results.items():
        assert code in (0, None), f"{name}: exit {code}\n{out[-2000:]}\n{err[-2000:]}"
        assert "usage:" in out and "--help" in out, name
