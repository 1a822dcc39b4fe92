"""The servers' admin features against the fake engine, through ``EngineClient`` alone (so
they need nothing the protocol lacks): LoRA adapters over HTTP (vLLM's load / unload
endpoints, ``model`` naming an adapter) and gRPC (``lora_name``), vLLM's sleep-mode dev
endpoints, and the gRPC Admin service's weight updates with each of its status codes. The
real engine's versions of these run in test_lora_serving.py and test_admin_grpc.py."""

from __future__ import annotations

import os

import grpc
import httpx
import openai
import pytest
from fakes import FakeAsyncEngine, expected_text, wait_until
from harness import ServerThread

from jaxpaged.serving import admin_pb2, admin_pb2_grpc
from jaxpaged.serving import generation_pb2_grpc as pb_grpc
from jaxpaged.serving.client import build_request

PROMPT = [70, 71, 72]


@pytest.fixture(scope="module")
def served(request):
    engine = FakeAsyncEngine(max_model_len=64)
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # read when the app is made
    try:
        server = ServerThread(engine, allow_runtime_lora_updating=True)
    finally:
        del os.environ["VLLM_SERVER_DEV_MODE"]
    request.addfinalizer(server.stop)
    return server, engine


def _complete(server: ServerThread, model: str) -> str:
    client = openai.OpenAI(base_url=server.http + "/v1", api_key="x", max_retries=0)
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=4)
    return out.choices[0].text


def test_lora_adapters_over_http_and_grpc(served):
    server, engine = served
    post = lambda path, body: httpx.post(server.http + path, json=body)  # noqa: E731
    r = post("/v1/load_lora_adapter", {"lora_name": "ad", "lora_path": "/adapters/ad"})
    assert r.status_code == 200, r.text
    r = post("/v1/load_lora_adapter", {"lora_name": "ad", "lora_path": "/adapters/ad"})
    assert r.status_code == 400 and "already been loaded" in r.text
    cards = {m["id"]: m for m in httpx.get(server.http + "/v1/models").json()["data"]}
    assert cards["ad"]["parent"] == "test-model" and cards["ad"]["root"] == "/adapters/ad"

    assert _complete(server, "ad") == expected_text(PROMPT, 4)
    assert _complete(server, "test-model") == expected_text(PROMPT, 4)
    named = [engine.lora_names[rid] for rid, *_ in engine.added[-2:]]
    assert named == ["ad", None]
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        req = build_request(PROMPT, stream=False, max_tokens=2)
        req.lora_name = "ad"
        (msg,) = list(stub.Generate(req, timeout=30))
        assert engine.lora_names[msg.request_id] == "ad"
        req.lora_name = "missing"
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(req, timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "'missing' is not loaded" in err.value.details()

    assert post("/v1/unload_lora_adapter", {"lora_name": "ad"}).status_code == 200
    assert "ad" not in engine.list_loras()
    with pytest.raises(openai.BadRequestError, match="does not exist"):
        _complete(server, "ad")
    assert post("/v1/unload_lora_adapter", {"lora_name": "ad"}).status_code == 404


def test_sleep_mode_endpoints(served):
    server, engine = served
    url = server.http
    assert httpx.post(url + "/sleep?level=3").status_code == 400
    # refused while a request runs
    engine.hold_after(2)
    client = httpx.Client(base_url=url, timeout=30)
    body = {"model": "test-model", "prompt": PROMPT, "max_tokens": 50, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as stream:
        lines = stream.iter_lines()  # kept: a dropped iterator closes the stream
        assert next(lines).startswith("data: ")
        r = httpx.post(url + "/sleep?level=1")
        assert r.status_code == 400 and "unfinished" in r.text
    assert wait_until(lambda: engine.get_stats().num_running == 0)
    assert httpx.post(url + "/sleep?level=2").status_code == 200
    assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": True}
    r = httpx.post(url + "/v1/completions", json={**body, "stream": False})
    assert r.status_code == 503 and "asleep" in r.text
    assert httpx.post(url + "/wake_up").status_code == 200
    assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": False}
    assert _complete(server, "test-model") == expected_text(PROMPT, 4)


class _ParamsOnlyEngine(FakeAsyncEngine):
    """An engine built on params in hand: it cannot load a checkpoint by path."""

    async def update_weights_from(self, path: str) -> float:
        raise NotImplementedError("this engine cannot load weights by path")


@pytest.mark.parametrize(
    ("engine_cls", "path", "code"),
    [
        (FakeAsyncEngine, "exists", grpc.StatusCode.OK),
        (FakeAsyncEngine, "/nonexistent/checkpoint", grpc.StatusCode.INVALID_ARGUMENT),
        (FakeAsyncEngine, "", grpc.StatusCode.INVALID_ARGUMENT),
        (_ParamsOnlyEngine, "exists", grpc.StatusCode.FAILED_PRECONDITION),
    ],
)
def test_update_weights_status_codes(server_factory, tmp_path, engine_cls, path, code):
    engine = engine_cls()
    server = server_factory(engine, enable_weight_updates=True)
    path = str(tmp_path) if path == "exists" else path
    with grpc.insecure_channel(server.grpc_target) as channel:
        admin = admin_pb2_grpc.AdminStub(channel)
        request = admin_pb2.UpdateWeightsRequest(path=path)
        if code == grpc.StatusCode.OK:
            reply = admin.UpdateWeights(request, timeout=30)
            assert reply.load_seconds == 0.0 and engine.weight_paths == [path]
            return
        with pytest.raises(grpc.RpcError) as err:
            admin.UpdateWeights(request, timeout=30)
        assert err.value.code() == code
        assert engine.weight_paths == []
