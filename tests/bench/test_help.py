"""Every benchmark of bench/ answers ``--help`` (what `jaxpaged bench NAME --help` shows), and
`jaxpaged bench` lists exactly the tools, not the helpers the scripts share."""

from __future__ import annotations

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


def test_the_listed_benchmarks_are_the_tools():
    assert set(bench_cli.benchmarks(ROOT / "bench")) == TOOLS


def test_every_tool_answers_help():
    env = script_env(JAX_PLATFORMS="cpu")
    procs = {
        name: subprocess.Popen(
            [sys.executable, f"bench/{name}.py", "--help"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for name in sorted(TOOLS)
    }
    procs["accelerator_check.sh"] = subprocess.Popen(
        ["bash", "bench/accelerator_check.sh", "--help"], cwd=ROOT, text=True,
        env={**env, "PYTHON": sys.executable, "OUT": ""},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{name}: rc {proc.returncode}\n{out[-2000:]}\n{err[-2000:]}"
        assert "usage:" in out and "--help" in out, name
