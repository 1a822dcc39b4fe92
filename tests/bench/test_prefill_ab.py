"""bench/prefill_ab.py without vLLM: its variant flags and its plot (the runs themselves need
vLLM's client, which CI does not install)."""

from __future__ import annotations

import argparse
import importlib
import json
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
    assert ab._split_env(["PYTHONPATH=/x", "A_1=", "--flag", "B=2"]) == (
        {"PYTHONPATH": "/x", "A_1": ""}, ["--flag", "B=2"])  # fmt: skip
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


def test_step_summary_names_the_slow_steps(tmp_path):
    ab = _module()
    steps = [{"ms": 30.0, "decodes": 16, "prefill": 0, "seqs": 16, "gc_ms": 0.0}] * 10
    steps += [{"ms": 120.0, "decodes": 15, "prefill": 48, "seqs": 16, "gc_ms": 0.0}] * 3
    steps += [{"ms": 100.0, "decodes": 16, "prefill": 0, "seqs": 16, "gc_ms": 50.0}]
    steps += [{"ms": 400.0, "decodes": 0, "prefill": 256, "seqs": 1, "gc_ms": 0.0}]
    steps += [{"ms": 5.0, "seqs": 0, "gc_ms": 0.0}]  # idle: left out
    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in steps))
    text = ab.summarize_steps(str(path))
    assert "decode 11 steps p50 30 p99 100 ms" in text
    assert "prefill+decode 3 steps p50 120" in text and "prefill 1 steps p50 400" in text
    assert "5 of 15 steps > 3x the median decode step (30 ms)" in text
    assert "{'15d+48p': 3, '16d+0p gc': 1, '0d+256p': 1}" in text
    assert "gc 50 ms in all, at most 50 ms" in text
    # one ITL per decode: 160 of 30 ms, 16 of 100 ms, 45 of 120 ms
    assert "engine ITL p50 30 p99 120 ms (4.0x)" in text


def test_ttft_split_from_the_per_request_lines():
    ab = _module()
    # a arrives 0.5 s before step 0 starts (t=10); its first chunk runs in step 0, the
    # next chunk in step 1, and step 2 collects its first token (ends at 10.7 s)
    steps = [
        {"t": 10.0, "ms": 200.0, "waits": {"a": 0.5}},
        {"t": 10.2, "ms": 200.0, "waits": {"b": 1.0}},
        {"t": 10.4, "ms": 300.0, "first_tokens": ["a"]},
        {"t": 10.7, "ms": 100.0, "first_tokens": ["b", "unknown"]},
    ]
    # a: TTFT 1.2 s = 0.5 wait + 0.7; b: 1.6 s = 1.0 + 0.6; medians of the two
    assert ab.ttft_split(steps) == (
        "server TTFT p50 1400 ms = wait p50 750 + from first chunk p50 650 (2 steps)"
    )
    assert ab.ttft_split(steps[:1]) == "no per-request lines"
