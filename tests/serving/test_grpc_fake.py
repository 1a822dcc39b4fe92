"""The gRPC service against the fake engine, through the project's generated stubs and the
`jaxpaged.serving.client` clients: results, status codes, health, reflection, cancel."""

from __future__ import annotations

import subprocess
import sys
import threading

import grpc
import pytest
from fakes import (
    VOCAB,
    FakeAsyncEngine,
    FakeTokenizer,
    expected_logprob,
    expected_text,
    wait_until,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from harness import ServerThread

from jaxpaged.outputs import RequestOutputKind
from jaxpaged.serving import generation_pb2 as pb
from jaxpaged.serving import generation_pb2_grpc as pb_grpc
from jaxpaged.serving.client import GenerationClient, build_request


def _ids(text: str) -> list[int]:
    return [ord(c) for c in text]


@pytest.fixture(scope="module")
def shared(request):
    server = ServerThread(FakeAsyncEngine(max_model_len=64))
    request.addfinalizer(server.stop)
    return server


@pytest.fixture
def stub(shared):
    with grpc.insecure_channel(shared.grpc_target) as channel:
        yield pb_grpc.GenerationStub(channel)


def test_generate_stream_and_unary(shared, stub):
    req = build_request("Hello", stream=True, max_tokens=6, request_id="r-1")
    msgs = list(stub.Generate(req, timeout=30))
    assert all(m.request_id == "r-1" for m in msgs)
    assert len(msgs) == 6  # one token per step
    assert list(msgs[0].prompt_token_ids) == _ids("Hello")
    text = "".join(d.text for m in msgs for d in m.outputs)
    ids = [t for m in msgs for d in m.outputs for t in d.token_ids]
    assert text == expected_text(_ids("Hello"), 6)
    assert ids == _ids(text)
    last = msgs[-1]
    assert last.finished and last.outputs[0].finish_reason == "length"
    assert not any(m.finished for m in msgs[:-1])
    assert last.usage.prompt_tokens == 5 and last.usage.completion_tokens == 6
    assert last.timings.e2e_latency_s >= last.timings.time_to_first_token_s > 0

    msgs = list(
        stub.Generate(
            build_request(
                [70, 80], stream=False, max_tokens=4, n=2, temperature=1.0, request_id="r-2"
            ),
            timeout=30,
        )
    )
    assert len(msgs) == 1 and msgs[0].finished
    assert {d.index: d.text for d in msgs[0].outputs} == {
        j: expected_text([70, 80], 4, j) for j in (0, 1)
    }
    assert msgs[0].usage.completion_tokens == 8 and msgs[0].usage.prompt_tokens == 2
    assert list(msgs[0].prompt_token_ids) == [70, 80]
    # not streamed: the engine was asked for FINAL_ONLY and sent one output
    engine = shared.engine
    assert [k for rid, _, _, k in engine.added if rid == "r-2"] == [RequestOutputKind.FINAL_ONLY]
    assert [o.finished for o in engine.outputs if o.request_id == "r-2"] == [True]
    assert [k for rid, _, _, k in engine.added if rid == "r-1"] == [RequestOutputKind.DELTA]


def test_interleaved_n2_stream_reassembles(server_factory):
    """Samples take turns and a delta holds up to 2 tokens: one message per engine output,
    each sample's deltas concatenate to its text, ids and logprobs, one finish_reason per
    sample (sample 0's before the last message), usage on the last message counts all."""
    engine = FakeAsyncEngine(interleave=True, tokens_per_step=2)
    server = server_factory(engine)
    with grpc.insecure_channel(server.grpc_target) as channel:
        req = build_request("pq", max_tokens=5, n=2, temperature=1.0, logprobs=0, request_id="i")
        msgs = list(pb_grpc.GenerationStub(channel).Generate(req, timeout=30))
    assert len(msgs) == len([o for o in engine.outputs if o.request_id == "i"])
    assert all(len(m.outputs) == 1 for m in msgs)
    assert [m.finished for m in msgs] == [False] * (len(msgs) - 1) + [True]
    for j in (0, 1):
        deltas = [d for m in msgs for d in m.outputs if d.index == j]
        text = "".join(d.text for d in deltas)
        assert text == expected_text(_ids("pq"), 5, j)
        assert [t for d in deltas for t in d.token_ids] == _ids(text)
        lps = [lp.logprob for d in deltas for lp in d.logprobs]
        assert lps == [expected_logprob(i) for i in range(5)]
        assert [d.finish_reason for d in deltas] == [""] * (len(deltas) - 1) + ["length"]
    assert msgs[-1].outputs[0].index == 1  # sample 0 finished in an earlier message
    assert msgs[-1].usage.completion_tokens == 10 and msgs[-1].usage.prompt_tokens == 2
    with GenerationClient(server.grpc_target) as client:
        done = client.generate("pq", max_tokens=5, n=2, temperature=1.0)
    assert [s.text for s in done.samples] == [expected_text(_ids("pq"), 5, j) for j in (0, 1)]
    assert done.usage["completion_tokens"] == 10


def test_sync_and_async_clients(shared):
    with GenerationClient(shared.grpc_target) as client:
        chunks = list(client.stream("abc", max_tokens=5, logprobs=1))
        assert "".join(c.text for c in chunks) == expected_text(_ids("abc"), 5)
        assert chunks[-1].finish_reason == "length" and chunks[-1].usage["completion_tokens"] == 5
        assert [lp[1] for c in chunks for lp in c.logprobs] == [-0.5, -1.0, -1.5, -0.5, -1.0]
        msgs = [{"role": "user", "content": "hi"}]
        done = client.generate(messages=msgs, max_tokens=3)
        chat_ids = FakeTokenizer().apply_chat_template(msgs, tokenize=True)["input_ids"]
        assert done.text == expected_text(chat_ids, 3)
        assert done.prompt_token_ids == tuple(chat_ids)
        assert client.model_info().vocab_size == VOCAB
        info = client.server_info()
        assert info.state == "serving" and info.num_kv_blocks == 256
        assert info.engine_config["block_size"] == "4"

    # grpc.aio supports one event loop per process and the server's runs in this one: the
    # asyncio client runs in a child process
    script = (
        "import asyncio, sys\n"
        "from jaxpaged.serving.client import AsyncGenerationClient\n"
        "async def run():\n"
        "    async with AsyncGenerationClient(sys.argv[1]) as client:\n"
        "        parts = [c.text async for c in client.stream('xyz', max_tokens=4)]\n"
        "        whole = await client.generate('xyz', max_tokens=4)\n"
        "        assert whole.text == ''.join(parts), (whole.text, parts)\n"
        "        print(whole.text)\n"
        "asyncio.run(run())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, shared.grpc_target],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == expected_text(_ids("xyz"), 4)


BAD = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"n": 0}, "n"),
    ({"logprobs": 99}, "logprobs"),
    ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"max_tokens": 60}, "max_tokens"),  # prompt + max_tokens > max_model_len 64
]


@pytest.mark.parametrize(("sampling", "field"), BAD)
def test_bad_sampling_params_are_invalid_argument(stub, sampling, field):
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(build_request("hello", **sampling), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.details()


@pytest.mark.parametrize(
    ("req", "field"),
    [
        (pb.GenerateRequest(), "input"),
        (pb.GenerateRequest(text=""), "prompt"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[])), "prompt"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, VOCAB])), "prompt"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 64)), "prompt"),
        (pb.GenerateRequest(chat=pb.Chat()), "messages"),
        (
            pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="wizard", content="x")])),
            "messages",
        ),
    ],
)
def test_bad_prompts_are_invalid_argument(stub, req, field):
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(req, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.details()


def test_health_and_reflection(shared):
    with grpc.insecure_channel(shared.grpc_target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "jaxpaged.v1.Generation"):
            r = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert r.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        (resp,) = refl.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
        )
        names = {s.name for s in resp.list_services_response.service}
        assert {"jaxpaged.v1.Generation", "grpc.health.v1.Health"} <= names
        (resp,) = refl.ServerReflectionInfo(
            iter(
                [
                    reflection_pb2.ServerReflectionRequest(
                        file_containing_symbol="jaxpaged.v1.Generation"
                    )
                ]
            ),
            timeout=10,
        )
        assert resp.file_descriptor_response.file_descriptor_proto


def test_cancel_and_deadline_abort(shared, stub):
    engine = shared.engine
    engine.step_delay = 0.01
    free0 = engine.get_stats().num_free_blocks
    engine.hold_after(2)
    call = stub.Generate(build_request("abcd", max_tokens=55, request_id="cancel-me"), timeout=30)
    next(call)
    assert engine.get_stats().num_free_blocks < free0
    call.cancel()
    assert wait_until(lambda: "cancel-me" in engine.aborted)
    assert wait_until(lambda: engine.get_stats().num_free_blocks == free0)

    engine.hold_after(2)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(build_request("abcd", max_tokens=55, request_id="late"), timeout=0.2))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_until(lambda: "late" in engine.aborted)
    assert wait_until(lambda: engine.get_stats().num_free_blocks == free0)

    # the sync client's iterator cancels when dropped early
    engine.hold_after(2)
    with GenerationClient(shared.grpc_target) as client:
        for _ in client.stream("abcd", max_tokens=55, request_id="dropped"):
            break
    assert wait_until(lambda: "dropped" in engine.aborted)
    assert wait_until(lambda: shared.frontend.num_in_flight == 0)

    # Abort RPC by id: the stream ends with finish_reason "abort"
    engine.hold_after(2)
    call = stub.Generate(build_request("abcd", max_tokens=55, request_id="by-id"), timeout=30)
    next(call)
    stub.Abort(pb.AbortRequest(request_id="by-id"), timeout=10)
    rest = list(call)
    assert rest[-1].finished and rest[-1].outputs[-1].finish_reason == "abort"
    assert wait_until(lambda: engine.get_stats().num_free_blocks == free0)
    stub.Abort(pb.AbortRequest(request_id="no-such-request"), timeout=10)  # ignored


def test_api_key(server_factory):
    server = server_factory(FakeAsyncEngine(), api_key="k")
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        for md in ((), (("authorization", "Bearer nope"),), (("authorization", "k"),)):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(build_request("a", max_tokens=1), metadata=md, timeout=10))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        health = health_pb2_grpc.HealthStub(channel)  # health needs no key
        assert (
            health.Check(health_pb2.HealthCheckRequest(), timeout=10).status
            == health_pb2.HealthCheckResponse.SERVING
        )
    with GenerationClient(server.grpc_target, api_key="k") as client:
        assert client.generate("a", max_tokens=2).text == expected_text(_ids("a"), 2)


def test_queue_full_is_resource_exhausted(server_factory):
    engine = FakeAsyncEngine(max_num_seqs=1, step_delay=0.02)
    server = server_factory(engine, max_queue_len=1)
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        first = stub.Generate(build_request("a", max_tokens=100), timeout=30)
        next(first)
        waiting = stub.Generate(build_request("b", max_tokens=2), timeout=30)
        assert wait_until(lambda: server.frontend.num_queued == 1)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(build_request("c", max_tokens=2), timeout=30))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        first.cancel()
        assert list(waiting)[-1].finished


def test_engine_failure(server_factory):
    engine = FakeAsyncEngine(step_delay=0.01)
    server = server_factory(engine)
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        watch = health.Watch(
            health_pb2.HealthCheckRequest(service="jaxpaged.v1.Generation"), timeout=30
        )
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        streams = [stub.Generate(build_request("a", max_tokens=200), timeout=30) for _ in range(3)]
        for s in streams:
            next(s)
        unary = {}
        t = threading.Thread(
            target=lambda: unary.setdefault(
                "e", _call_error(stub, build_request("b", stream=False, max_tokens=200))
            )
        )
        t.start()
        assert wait_until(lambda: server.frontend.num_in_flight == 4)
        server.call(lambda: engine.kill(RuntimeError("device lost")))
        for s in streams:
            with pytest.raises(grpc.RpcError) as e:
                list(s)
            assert e.value.code() == grpc.StatusCode.INTERNAL
            assert "device lost" in e.value.details()
        t.join(30)
        assert unary["e"].code() == grpc.StatusCode.INTERNAL
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()
        assert (
            health.Check(health_pb2.HealthCheckRequest(), timeout=10).status
            == health_pb2.HealthCheckResponse.NOT_SERVING
        )
        e = _call_error(stub, build_request("c", max_tokens=2))
        assert e.code() == grpc.StatusCode.UNAVAILABLE and "engine failed" in e.details()
        assert stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).state == "failed"


def _call_error(stub, req) -> grpc.RpcError:
    try:
        list(stub.Generate(req, timeout=30))
    except grpc.RpcError as e:
        return e
    raise AssertionError("the call succeeded")
