"""Speculative decoding's Prometheus counters carry vLLM's names (what dashboards and
routers built for vLLM read), filled from the engine's stats."""

from __future__ import annotations

import dataclasses
import types

from jaxpaged.engine.protocol import EngineStats
from jaxpaged.serving.metrics import ServingMetrics

ZERO = {f.name: 0 for f in dataclasses.fields(EngineStats) if f.default is dataclasses.MISSING}


def test_vllm_spec_decode_counters():
    stats = EngineStats(
        **{**ZERO, "kv_cache_usage": 0.0, "kv_cache_waste": 0.0},
        spec_decode_num_drafts=5,
        spec_decode_num_draft_tokens=15,
        spec_decode_num_accepted_tokens=9,
        spec_decode_num_accepted_tokens_per_pos=(5, 3, 1),
    )
    engine = types.SimpleNamespace(get_stats=lambda: stats)
    metrics = ServingMetrics()
    metrics.bind(types.SimpleNamespace(engine=engine, num_in_flight=0))
    text = metrics.render().decode()
    lines = set(text.splitlines())
    assert "vllm:spec_decode_num_drafts_total 5.0" in lines
    assert "vllm:spec_decode_num_draft_tokens_total 15.0" in lines
    assert "vllm:spec_decode_num_accepted_tokens_total 9.0" in lines
    for j, n in enumerate((5, 3, 1)):
        assert (
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{j}"}} {n}.0' in lines
        )
