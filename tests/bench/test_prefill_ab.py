"""bench/prefill_ab.py without vLLM: its variant flags and its plot (the runs themselves need
vLLM's client, which CI does not install)."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _module():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module("prefill_ab")


def test_variants_name_their_server_flags():
    ab = _module()
    assert ab._variant("capped=--max-prefill-tokens-with-decodes 64") == (
        "capped", ["--max-prefill-tokens-with-decodes", "64"])  # fmt: skip
    assert ab._variant("default=") == ("default", [])
    for bad in ("no-equals", "=--flag 1"):
        with pytest.raises(argparse.ArgumentTypeError, match="NAME=FLAGS"):
            ab._variant(bad)


def test_plot_writes_a_png(tmp_path):
    ab = _module()
    run = {"median_ttft_ms": 400.0, "p99_ttft_ms": 900.0, "median_itl_ms": 35.0,
           "p99_itl_ms": 410.0}  # fmt: skip
    path = tmp_path / "ab.png"
    ab.plot({"uncapped": [run, run], "default": [run]}, str(path), "title")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
