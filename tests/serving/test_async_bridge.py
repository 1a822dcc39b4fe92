"""The serving stack over the real `jaxpaged.engine.async_engine.AsyncEngine` (engine thread +
asyncio bridge) driving a fake synchronous engine: concurrency, cancel and step failure go
through the same code as with the model, in seconds."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import pytest
from fake_llm_engine import FakeLLMEngine
from fakes import expected_text, wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxpaged.engine.async_engine import AsyncEngine
from jaxpaged.serving.client import GenerationClient


@pytest.fixture
def bridged(server_factory):
    core = FakeLLMEngine(busy=0.005)
    server = server_factory(AsyncEngine(core))
    server.core = core
    return server


def test_32_concurrent_streams_over_the_real_async_engine(bridged):
    free0 = bridged.core.get_stats().num_free_blocks
    lengths = [3 + i % 6 for i in range(32)]
    oai = openai.OpenAI(base_url=bridged.http + "/v1", api_key="none", max_retries=0)

    def grpc_job(i):
        chunks = list(client.stream(f"p{i}", max_tokens=lengths[i], ignore_eos=True))
        return "".join(c.text for c in chunks), chunks[-1].finish_reason

    def http_job(i):
        text, finish = "", None
        for chunk in oai.completions.create(
            model="test-model", prompt=f"p{i}", max_tokens=lengths[i], stream=True
        ):
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    with GenerationClient(bridged.grpc_target) as client, ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda i: (grpc_job if i % 2 else http_job)(i), range(32)))
    want = [(expected_text([ord(c) for c in f"p{i}"], n), "length") for i, n in enumerate(lengths)]
    assert results == want
    assert wait_until(lambda: bridged.core.get_stats().num_free_blocks == free0)


def test_cancel_over_the_real_async_engine(bridged):
    """The engine is held after its first few tokens until the abort arrives, so the
    client's cancel (not the length limit) must be what ends the request and frees it."""
    core = bridged.core
    free0 = core.get_stats().num_free_blocks
    core.hold_after(4)  # not 2: the loop collects a step behind, so 2 held the first token
    with GenerationClient(bridged.grpc_target) as client:
        stream = client.stream("abc", max_tokens=200, ignore_eos=True)
        next(stream)
        assert core.get_stats().num_free_blocks < free0
        stream.close()
    assert wait_until(lambda: len(core.aborted) == 1)
    assert wait_until(lambda: core.get_stats().num_free_blocks == free0)
    assert wait_until(lambda: bridged.frontend.num_in_flight == 0)
    assert core.get_stats().generation_tokens_total < 200


def test_step_failure_over_the_real_async_engine(bridged):
    core = bridged.core.core  # the EngineCore the engine thread drives
    real_step = core.step
    calls = {"n": 0}

    def failing_step():
        calls["n"] += 1
        # after a few tokens, wait for all three to be in flight (none can finish first)
        if calls["n"] > 3 and wait_until(lambda: bridged.frontend.num_in_flight == 3):
            raise RuntimeError("injected step failure")
        return real_step()

    core.step = failing_step
    errors = []

    def consume(i):
        try:
            with GenerationClient(bridged.grpc_target) as client:
                list(client.stream(f"q{i}", max_tokens=100, ignore_eos=True))
        except grpc.RpcError as e:
            errors.append(e)

    with ThreadPoolExecutor(3) as pool:
        list(pool.map(consume, range(3)))
    assert [e.code() for e in errors] == [grpc.StatusCode.INTERNAL] * 3
    assert all("injected step failure" in e.details() for e in errors)
    with grpc.insecure_channel(bridged.grpc_target) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
    r = httpx.post(bridged.http + "/v1/completions", json={"prompt": "a"}, timeout=10)
    assert r.status_code == 503


def test_admission_does_not_stall_the_loop(server_factory):
    """The engine thread alone touches the engine, and callers only queue: while it waits out a
    long device step, a new request is admitted at once and health checks answer promptly
    (they used to wait for the step's lock)."""
    engine = FakeLLMEngine()
    server = server_factory(AsyncEngine(engine))
    with GenerationClient(server.grpc_target) as client, ThreadPoolExecutor(2) as pool:
        first = client.stream("abc", max_tokens=100, ignore_eos=True)
        next(first)
        engine.runner.stall = 3.0  # every device step now takes 3 s
        time.sleep(0.3)  # the engine thread is now inside a long step
        t0 = time.monotonic()
        second = pool.submit(lambda: client.generate("xyz", max_tokens=2).text)
        assert wait_until(lambda: "xyz" in {r.prompt for r in engine.core.outputs._groups.values()}
                          or not engine.core._inbox.empty(), timeout=1.5)  # fmt: skip
        assert time.monotonic() - t0 < 1.5  # queued while the step runs
        with grpc.insecure_channel(server.grpc_target) as ch:
            t0 = time.monotonic()
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert time.monotonic() - t0 < 1.5
        t0 = time.monotonic()
        assert httpx.get(server.http + "/health", timeout=10).status_code == 200
        assert time.monotonic() - t0 < 1.5
        engine.runner.stall = 0.0
        assert second.result(30) == expected_text([ord(c) for c in "xyz"], 2)
        first.close()


def test_a_request_the_step_cannot_take_is_refused_and_the_engine_keeps_serving(bridged):
    """min_tokens with more stop_token_ids than the step's ban list holds (and a request
    longer than the KV pool) are refused at admission with 400 / INVALID_ARGUMENT naming the
    field; the same engine then serves the next request."""
    from jaxpaged.sampling_params import MAX_BANNED_IDS

    too_many = list(range(10, 10 + MAX_BANNED_IDS + 8))
    r = httpx.post(
        bridged.http + "/v1/completions",
        json={"prompt": "abc", "max_tokens": 8, "min_tokens": 3, "stop_token_ids": too_many},
        timeout=10,
    )
    assert r.status_code == 400, r.text
    assert "stop_token_ids" in r.json()["error"]["message"]
    with GenerationClient(bridged.grpc_target) as client:
        with pytest.raises(grpc.RpcError) as e:
            client.generate("abc", max_tokens=8, min_tokens=3, stop_token_ids=too_many)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "stop_token_ids" in e.value.details()
        # as many as fit are fine, and without min_tokens any number is
        ok = client.generate("abc", max_tokens=4, min_tokens=3, stop_token_ids=too_many[:20])
        assert ok.text == expected_text([ord(c) for c in "abc"], 4)
        ok = client.generate("abc", max_tokens=4, stop_token_ids=too_many)
        assert ok.text == expected_text([ord(c) for c in "abc"], 4)
    assert not bridged.frontend.engine.errored


def test_a_request_larger_than_the_kv_pool_is_refused(server_factory):
    server = server_factory(AsyncEngine(FakeLLMEngine(num_kv_blocks=8)))  # 32 token slots
    r = httpx.post(server.http + "/v1/completions", json={"prompt": "abc", "max_tokens": 40})
    assert r.status_code == 400 and "KV blocks" in r.json()["error"]["message"], r.text
    r = httpx.post(server.http + "/v1/completions", json={"prompt": "abc", "max_tokens": 20})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected_text(
        [97, 98, 99], 20
    )


def test_a_request_id_in_use_is_refused_by_the_engine(bridged):
    """The engine alone checks request ids: a second request with the id of a running one is
    INVALID_ARGUMENT naming request_id (the first goes on); once the first has ended, the id
    may be used again."""
    core = bridged.core
    core.hold_after(4)  # the first tokens are out (the loop collects a step behind), then it holds
    with GenerationClient(bridged.grpc_target) as client:
        first = client.stream("abc", request_id="dup", max_tokens=200, ignore_eos=True)
        next(first)
        with pytest.raises(grpc.RpcError) as e:
            client.generate("xyz", request_id="dup", max_tokens=2)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "request_id 'dup' is already in use" in e.value.details()
        first.close()
        # the engine, not the server, lets the id go: once the abort has ended the request
        assert wait_until(lambda: bridged.frontend.engine.num_in_flight == 0)
        again = client.generate("xyz", request_id="dup", max_tokens=2)
        assert again.text == expected_text([ord(c) for c in "xyz"], 2)
    assert core.aborted == ["dup"]
