"""Checks that need several devices, run in ONE subprocess with simulated CPU devices (the
pytest process and the rest of the suite keep a single device): the script runs the checks
it is asked for and writes a JSON mapping each check to "ok" or its traceback. Shared by
tests/parallel (tensor parallelism) and tests/engine/test_data_parallel.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["assert_ok", "run_checks"]


def run_checks(
    script: Path,
    work: Path,
    checks: Sequence[str] = (),
    *,
    num_devices: int = 4,
    timeout: float = 1500,
) -> tuple[dict[str, str], str]:
    """Runs ``script --workdir work --out work/results.json [checks...]`` on
    ``num_devices`` simulated CPU devices; returns (its results, the tail of its output)."""
    out = work / "results.json"
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={num_devices}"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, str(script), "--workdir", str(work), "--out", str(out), *checks],
        env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    found = json.loads(out.read_text()) if out.exists() else {}
    return found, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"


def assert_ok(results: tuple[dict[str, str], str], check: str) -> None:
    """The check ran and passed (else its traceback, or the script's output if it did not
    run)."""
    found, log = results
    assert check in found, f"check {check!r} did not run:\n{log}"
    assert found[check] == "ok", f"{check}: {found[check]}\n{log}"
