"""Speculative decoding's Prometheus counters carry vLLM's names (what dashboards and
routers built for vLLM read), filled from the engine's stats."""

from __future__ import annotations

import dataclasses
import time
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


def _stats(**kw) -> EngineStats:
    return EngineStats(**{**ZERO, "kv_cache_usage": 0.25, "kv_cache_waste": 0.0, **kw})


def test_stats_log_lines_are_vllms():
    """The serve log's periodic lines: vLLM's throughput line, and its SpecDecoding line with
    the interval's mean acceptance length (1 + accepted / verifications), throughputs,
    counts, per-position acceptance and acceptance rate."""
    from jaxpaged.serving.stats_log import StatsLog

    log = StatsLog()
    assert log.lines(_stats(), 100.0) == []  # the first snapshot only starts the interval
    assert log.lines(_stats(), 110.0) == []  # idle: nothing
    later = _stats(
        num_running=2, prompt_tokens_total=300, generation_tokens_total=100,
        prefix_cache_queries=200, prefix_cache_hits=50, spec_decode_num_drafts=20,
        spec_decode_num_draft_tokens=60, spec_decode_num_accepted_tokens=30,
        spec_decode_num_accepted_tokens_per_pos=(16, 10, 4),
    )  # fmt: skip
    assert log.lines(later, 120.0) == [
        "Engine 000: Avg prompt throughput: 30.0 tokens/s, Avg generation throughput: 10.0 "
        "tokens/s, Running: 2 reqs, Waiting: 0 reqs, KV cache usage: 25.0%, Prefix cache hit "
        "rate: 25.0%",
        "SpecDecoding metrics: Mean acceptance length: 2.50, Accepted throughput: 3.00 "
        "tokens/s, Drafted throughput: 6.00 tokens/s, Accepted: 30 tokens, Drafted: 60 tokens, "
        "Per-position acceptance rate: 0.800, 0.500, 0.200, Avg Draft acceptance rate: 50.0%",
    ]
    # the next interval counts only what happened in it; no drafts: no SpecDecoding line
    more = dataclasses.replace(later, generation_tokens_total=120)
    (line,) = log.lines(more, 130.0)
    assert "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 2.0" in line


def test_serve_logs_the_stats_lines(server_factory, caplog):
    from fakes import FakeAsyncEngine

    engine = FakeAsyncEngine(max_model_len=64)
    snapshots = iter([_stats(), _stats(num_running=1, generation_tokens_total=5,
                      spec_decode_num_drafts=2, spec_decode_num_draft_tokens=6,
                      spec_decode_num_accepted_tokens=3,
                      spec_decode_num_accepted_tokens_per_pos=(2, 1, 0))])  # fmt: skip
    last = _stats()
    engine.get_stats = lambda: next(snapshots, last)
    with caplog.at_level("INFO", logger="jaxpaged.serving"):
        server_factory(engine, log_stats_interval=0.05)
        deadline = time.monotonic() + 10
        while "SpecDecoding metrics" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
    assert "SpecDecoding metrics: Mean acceptance length: 2.50" in caplog.text
    assert "Engine 000: Avg prompt throughput" in caplog.text
