"""bench/serving_sim.py: the closed-loop workload through the real scheduler, against
figures computed by hand for a cost model simple enough to follow step by step."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _sim():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module("serving_sim")


def test_one_client_at_a_time_is_hand_computable():
    sim = _sim()
    # every step costs 1: a 40-token prompt in one step (TTFT 1), then 4 decodes (ITL 1)
    cost = sim.parse_cost("d1=1 d16=1 16=1 512=1")
    args = sim.engine_args([], {"max_num_seqs": 4, "max_model_len": 256})
    r = sim.simulate(args, cost, num_prompts=3, concurrency=1, input_len=40, output_len=5)
    assert r["TTFT p50"] == 1 and r["wait p50"] == 0 and r["ITL p50"] == r["ITL p99"] == 1
    assert r["steps"] == 3 * 5 and r["tok/unit"] == 1 and r["mixed share"] == pytest.approx(1 / 5)


def test_capped_chunks_beside_decodes():
    sim = _sim()
    # budget 48, cap 16; mixed steps cost 3, decode steps 1. Step 1 (no decodes): a's 40
    # tokens + b's first 8; steps 2-3: a decodes beside b's chunks of 16 (b's first token at
    # 9); steps 4-5: b decodes. a's tokens at 3, 6, 9; b's at 9, 10, 11.
    cost = sim.parse_cost("d1=1 d16=1 16=3 512=3")
    flags = ["--max-prefill-tokens-with-decodes", "16", "--max-num-batched-tokens", "48"]
    args = sim.engine_args(flags, {"max_num_seqs": 2, "max_model_len": 256})
    r = sim.simulate(args, cost, num_prompts=2, concurrency=2, input_len=40, output_len=3)
    assert r["steps"] == 5 and r["mixed share"] == pytest.approx(3 / 5)
    assert r["TTFT p50"] == 6 and r["wait p50"] == 0 and r["prefill p50"] == 6
    assert r["ITL p50"] == 2 and r["ITL p99"] == pytest.approx(3)  # ITLs 3, 3, 1, 1
    assert r["tok/unit"] == pytest.approx(6 / 11)


def test_cost_needs_both_kinds():
    with pytest.raises(ValueError, match="decode"):
        _sim().parse_cost("16=1 32=2")
