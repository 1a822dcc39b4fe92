"""bench/accelerator_check.sh in its CPU dry run: every stage runs (kernels in interpret mode,
tiny shapes) and writes its lines as it goes, so the hardware script cannot rot unseen."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_accelerator_check_dry_run_runs_every_stage(tmp_path):
    proc = subprocess.run(
        ["bash", "bench/accelerator_check.sh", "--dry-run"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable,
             "ACCELERATOR_CHECK_DEADLINE_S": "500"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = (tmp_path / "accelerator_check.md").read_text()
    for heading in ("jax ", "## Compile", "## Correctness", "## Decode attention timing",
                    "## Engine run", "## Speculative decoding", "## Per-row causal limits",
                    "## EAGLE-3 drafting"):  # fmt: skip
        assert heading in report
    assert "- decode: compiled" in report and "- prefill: compiled" in report
    assert "| jaxpaged pallas |" in report and "| jax paged_attention |" in report
    assert report.count("greedy tokens equal the CPU engine's") == 3  # with speculation too
    assert "- PASS 6q/2kv d16 bs8 window 7 float32" in report  # causal limits
    assert "FAIL" not in report and "skipped" not in report and "failures: 0" in report


def test_accelerator_check_stops_at_its_deadline(tmp_path):
    """With no time left every stage after the versions says it was skipped, and the run
    still ends with its summary line."""
    proc = subprocess.run(
        ["bash", "bench/accelerator_check.sh", "--dry-run"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable,
             "ACCELERATOR_CHECK_DEADLINE_S": "0"},
    )  # fmt: skip
    report = (tmp_path / "accelerator_check.md").read_text()
    assert "skipped: deadline" in report and "failures:" in report, proc.stdout[-2000:]
