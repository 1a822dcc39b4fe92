"""Prometheus metrics of one server, in its own registry (never the process-global one, so two
servers in one process, e.g. in tests, do not collide).

Engine-side numbers (queue lengths, KV usage, token and preemption totals) are read from
``EngineClient.get_stats()`` at scrape time; latency histograms are observed by the serving
layer from each finished request's :class:`RequestTotals` (counted from its outputs as they
arrive, so no output is kept). The gauges that load- and LoRA-aware routers read are also
exposed under vLLM's names (``vllm:num_requests_waiting``, ...) beside the ``jaxpaged:`` ones.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxpaged.outputs import RequestMetrics, RequestOutput

__all__ = ["CONTENT_TYPE", "RequestTotals", "ServingMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip


@dataclasses.dataclass(kw_only=True)
class RequestTotals:
    """What one request's outputs add up to: token counts per sample, finish reasons and the
    latest timings. Usage and the latency metrics read these; the text is never kept."""

    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_tokens: dict[int, int] = dataclasses.field(default_factory=dict)  # sample -> tokens
    finish_reasons: dict[int, str] = dataclasses.field(default_factory=dict)  # sample -> reason
    metrics: RequestMetrics | None = None  # from the latest output
    finished: bool = False  # the request's final output arrived

    @property
    def num_completion_tokens(self) -> int:
        return sum(self.num_tokens.values())

    def add(self, out: RequestOutput) -> int:
        """Counts one output (a delta, or a FINAL_ONLY output holding everything); returns
        how many tokens it brought."""
        self.num_prompt_tokens = len(out.prompt_token_ids)
        self.num_cached_tokens = out.num_cached_tokens
        self.metrics = out.metrics
        self.finished = self.finished or out.finished
        new = 0
        for c in out.outputs:
            new += len(c.token_ids)
            self.num_tokens[c.index] = self.num_tokens.get(c.index, 0) + len(c.token_ids)
            if c.finish_reason is not None:
                self.finish_reasons[c.index] = c.finish_reason
        return new


class _EngineCollector:
    """Gauges and counters read from the engine's stats at scrape time."""

    def __init__(self, metrics: ServingMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> list:
        return []

    def collect(self):
        frontend = self._metrics.frontend
        engine = None if frontend is None else frontend.engine
        # EngineStats' fields (a dead engine's last snapshot); none before the engine is there
        values = {} if engine is None else dataclasses.asdict(engine.get_stats())

        def get(name: str) -> float:
            return float(values[name]) if values else 0.0

        gauges = [
            ("jaxpaged:num_requests_running", "Requests in the running batch.", "num_running"),
            ("jaxpaged:num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting"),
            ("jaxpaged:num_requests_swapped", "Requests preempted to host memory.", "num_swapped"),
            (
                "jaxpaged:kv_cache_usage_perc",
                "Fraction of KV blocks in use (0..1).",
                "kv_cache_usage",
            ),
            ("jaxpaged:num_kv_blocks", "KV blocks in the pool.", "num_kv_blocks"),
            ("jaxpaged:num_free_kv_blocks", "Free KV blocks.", "num_free_blocks"),
            (
                "jaxpaged:kv_offload_blocks",
                "Blocks the prefix cache's host tier holds.",
                "kv_offload_num_blocks",
            ),
            (
                "jaxpaged:kv_offload_capacity_blocks",
                "Blocks the prefix cache's host tier can hold (0: off).",
                "kv_offload_capacity_blocks",
            ),
        ]
        for name, doc, attr in gauges:
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], get(attr))
            yield g
        counters = [
            ("jaxpaged:num_preemptions", "Preemptions so far.", "num_preemptions"),
            (
                "jaxpaged:prefix_cache_queries",
                "Prompt blocks looked up in the prefix cache.",
                "prefix_cache_queries",
            ),
            (
                "jaxpaged:prefix_cache_hits",
                "Prompt blocks found in the prefix cache.",
                "prefix_cache_hits",
            ),
            (
                "jaxpaged:kv_offload_hits",
                "Prompt tokens loaded back from the prefix cache's host tier.",
                "kv_offload_hits",
            ),
            (
                "jaxpaged:kv_offload_stored_blocks",
                "KV blocks copied from the device to the host tier.",
                "kv_offload_blocks_stored",
            ),
            (
                "jaxpaged:kv_offload_loaded_blocks",
                "KV blocks copied from the host tier to the device.",
                "kv_offload_blocks_loaded",
            ),
            (
                "jaxpaged:kv_offload_disk_stored_blocks",
                "KV blocks written from the host tier to the disk tier.",
                "kv_offload_disk_blocks_stored",
            ),
            (
                "jaxpaged:kv_offload_disk_loaded_blocks",
                "KV blocks read from the disk tier to the device.",
                "kv_offload_disk_blocks_loaded",
            ),
            (
                "jaxpaged:kv_offload_stored_bytes",
                "Bytes copied from the device to the host tier.",
                "kv_offload_bytes_stored",
            ),
            (
                "jaxpaged:kv_offload_loaded_bytes",
                "Bytes copied from the host tier to the device.",
                "kv_offload_bytes_loaded",
            ),
            ("jaxpaged:prompt_tokens", "Prompt tokens processed.", "prompt_tokens_total"),
            ("jaxpaged:generation_tokens", "Tokens generated.", "generation_tokens_total"),
            ("jaxpaged:num_compilations", "XLA compilations so far.", "num_compilations"),
        ]
        for name, doc, attr in counters:
            c = CounterMetricFamily(name, doc)  # exposed as <name>_total
            c.add_metric([], get(attr))
            yield c
        # speculative decoding and the encoder cache, under vLLM's names (exposed as
        # <name>_total, as vLLM's); the encoder cache's evictions and time under ours
        spec = [
            ("vllm:mm_cache_queries", "Images looked up in the encoder cache.", "mm_cache_queries"),
            ("vllm:mm_cache_hits", "Images found in the encoder cache.", "mm_cache_hits"),
            (
                "jaxpaged:mm_cache_evictions",
                "Encoded images evicted from the encoder cache.",
                "mm_cache_evictions",
            ),
            (
                "jaxpaged:mm_encoder_seconds",
                "Wall time of the image encoder.",
                "mm_encoder_seconds",
            ),
            ("vllm:spec_decode_num_drafts", "Draft verifications run.", "spec_decode_num_drafts"),
            (
                "vllm:spec_decode_num_draft_tokens",
                "Draft tokens proposed.",
                "spec_decode_num_draft_tokens",
            ),
            (
                "vllm:spec_decode_num_accepted_tokens",
                "Draft tokens accepted.",
                "spec_decode_num_accepted_tokens",
            ),
        ]
        for name, doc, attr in spec:
            c = CounterMetricFamily(name, doc)
            c.add_metric([], get(attr))
            yield c
        c = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft.",
            labels=["position"],
        )
        for j, n in enumerate(values.get("spec_decode_num_accepted_tokens_per_pos", ())):
            c.add_metric([str(j)], float(n))
        yield c
        g = GaugeMetricFamily("jaxpaged:num_requests_in_flight", "Requests open at the server.")
        g.add_metric([], float(frontend.num_in_flight) if frontend is not None else 0.0)
        yield g
        yield from _replica_families(values.get("replicas", ()))
        yield from _vllm_families(frontend, values)


# data parallelism: each replica's gauges under vLLM's per-engine label, beside the sums
# above (which stay one series per name, as routers read them)
_REPLICA_GAUGES = (
    ("jaxpaged:replica_alive", "1 while the data-parallel replica serves, 0 once it died.",
     "alive"),
    ("jaxpaged:replica_num_requests_running", "Requests in the replica's running batch.",
     "num_running"),
    ("jaxpaged:replica_num_requests_waiting", "Requests waiting (or swapped) in the replica.",
     "num_waiting"),
    ("jaxpaged:replica_kv_cache_usage_perc", "Fraction of the replica's KV blocks in use.",
     "kv_cache_usage"),
)  # fmt: skip


def _replica_families(replicas: Any):  # noqa: ANN201 - a generator
    """Per-replica gauges (label ``engine``: the replica's rank) and requests routed to
    each; nothing for one engine."""
    if not replicas:
        return
    for name, doc, attr in _REPLICA_GAUGES:
        g = GaugeMetricFamily(name, doc, labels=["engine"])
        for rank, replica in enumerate(replicas):
            g.add_metric([str(rank)], float(replica[attr]))
        yield g
    c = CounterMetricFamily(
        "jaxpaged:replica_requests", "Requests routed to the replica.", labels=["engine"]
    )
    for rank, replica in enumerate(replicas):
        c.add_metric([str(rank)], float(replica["requests_total"]))
    yield c


# vLLM's names for the gauges that routers read (llm-d's and the Gateway API inference
# extension's endpoint pickers, KServe): name, help, EngineStats field
_VLLM_GAUGES = (
    ("vllm:num_requests_running", "Number of requests in model execution batches.", "num_running"),
    ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", "num_waiting"),
    ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_cache_usage"),
    # the name vLLM used before 0.10 (older endpoint pickers read it)
    ("vllm:gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_cache_usage"),
)


def _vllm_families(frontend: Any, values: dict[str, Any]):  # noqa: ANN201 - a generator
    """The same engine numbers under vLLM's names and labels (``model_name``), so that a
    router configured for vLLM pods reads jaxpaged pods unchanged. ``vllm:lora_requests_info``
    is, as in vLLM, a gauge whose value is the snapshot's time and whose labels carry the
    comma-separated adapter names (routers pick the series with the latest value)."""
    # a bare front end (tests bind one with only an engine) has no config: no model name
    config = getattr(frontend, "config", None)
    model = getattr(config, "served_model_name", "")
    for name, doc, attr in _VLLM_GAUGES:
        g = GaugeMetricFamily(name, doc, labels=["model_name"])
        g.add_metric([model], float(values[attr]) if values else 0.0)
        yield g
    g = GaugeMetricFamily(
        "vllm:lora_requests_info",
        "Running stats on lora requests.",
        labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
    )
    if values:
        g.add_metric(
            [
                str(values["max_loras"]),
                ",".join(values["running_lora_adapters"]),
                ",".join(values["waiting_lora_adapters"]),
            ],
            time.time(),
        )
    yield g
    # the KV cache's shape, which prefix-aware routers read (value 1, the facts are labels)
    g = GaugeMetricFamily(
        "vllm:cache_config_info",
        "Information of the KV cache config.",
        labels=["block_size", "num_gpu_blocks"],
    )
    if values and config is not None:
        block_size = frontend.engine.engine_config.get("block_size", "")
        g.add_metric([str(block_size), str(values["num_kv_blocks"])], 1.0)
    yield g


class ServingMetrics:
    """The metric set of one server; `bind` it to the Frontend whose engine it reads."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.frontend: Any = None
        r = self.registry
        self.ttft = Histogram(
            "jaxpaged:time_to_first_token_seconds",
            "Arrival to first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "jaxpaged:inter_token_latency_seconds",
            "Time between successive tokens of a stream.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "jaxpaged:e2e_request_latency_seconds",
            "Arrival to finish.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "jaxpaged:request_queue_time_seconds",
            "Arrival to first scheduled.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.finished = Counter(
            "jaxpaged:request_success",
            "Finished requests by finish reason.",
            ["finished_reason"],
            registry=r,
        )
        self.rejected = Counter(
            "jaxpaged:request_rejected", "Requests refused at admission.", ["reason"], registry=r
        )
        r.register(_EngineCollector(self))

    def bind(self, frontend: Any) -> None:
        self.frontend = frontend

    def observe_inter_token(self, seconds: float, num_tokens: int) -> None:
        """A stream update brought `num_tokens` new tokens `seconds` after the previous one."""
        per = seconds / max(1, num_tokens)
        for _ in range(num_tokens):
            self.itl.observe(per)

    def observe_finished(self, totals: RequestTotals) -> None:
        """Latencies and finish reasons of a request whose final output arrived."""
        m = totals.metrics
        if m is None:
            return
        if m.first_token_time is not None:
            self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
        if m.first_scheduled_time is not None:
            self.queue_time.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        if m.finished_time is not None:
            self.e2e.observe(max(0.0, m.finished_time - m.arrival_time))
        for index in sorted(totals.num_tokens.keys() | totals.finish_reasons.keys()):
            reason = totals.finish_reasons.get(index, "unknown")
            self.finished.labels(finished_reason=reason).inc()

    def count_rejected(self, reason: str) -> None:
        self.rejected.labels(reason=reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
