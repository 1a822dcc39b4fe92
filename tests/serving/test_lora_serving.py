"""LoRA adapters over HTTP (the real `openai` client, vLLM's load/unload endpoints) and gRPC
(the ``lora_name`` field), against transformers + PEFT on a tiny random Llama.

The adapters and PEFT's reference tokens come from tests/engine/test_lora.py's fixture. One
engine (enforce_eager: only the shapes used are compiled) with one adapter slot: requests of
two adapters at once take turns for it. The same server (VLLM_SERVER_DEV_MODE on) serves
vLLM's sleep-mode endpoints, checked last.
"""

from __future__ import annotations

import os
import pathlib
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import pytest
from harness import ServerThread

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "engine"))
from test_lora import PROMPTS, folders  # noqa: E402, F401 - the module-scoped fixture

from jaxpaged.serving import generation_pb2_grpc as pb_grpc  # noqa: E402
from jaxpaged.serving.client import build_request  # noqa: E402


@pytest.fixture(scope="module")
def server(folders):  # noqa: F811 - the fixture imported above
    from jaxpaged.engine import LLMEngine
    from jaxpaged.engine.async_engine import AsyncEngine
    from jaxpaged.models import default_model_path, load_tokenizer
    from jaxpaged.models.loader import load_model
    from jaxpaged.worker.logits_processors import no_repeat_ngram

    base, paths, _ = folders
    config, params = load_model(base, progress=False)
    # the bundled model's tokenizer: its first 128 ids decode as they do for any model
    tokenizer = load_tokenizer(default_model_path())
    engine = LLMEngine.from_params(
        config,
        params,
        tokenizer,
        max_model_len=64,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        num_kv_blocks=32,
        show_progress=False,
        enforce_eager=True,
        enable_lora=True,
        max_loras=1,
        max_lora_rank=8,
        lora_modules={"r2qv": paths["r2qv"]},
        logits_processors=(no_repeat_ngram(),),
    )
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # read when the app is made
    try:
        srv = ServerThread(AsyncEngine(engine), allow_runtime_lora_updating=True)
    finally:
        del os.environ["VLLM_SERVER_DEV_MODE"]
    yield srv, tokenizer
    srv.stop()
    engine.close()


def _complete(client: openai.OpenAI, model: str, i: int) -> str:
    out = client.completions.create(
        model=model,
        prompt=PROMPTS[i],
        max_tokens=8,
        temperature=0,
        # PEFT's reference ignores EOS too; its ids < 128 include the tokenizer's special ones
        extra_body={"ignore_eos": True, "skip_special_tokens": False},
    )
    return out.choices[0].text


def test_http_models_completions_load_and_unload(server, folders):  # noqa: F811
    srv, tok = server
    _, paths, want = folders
    client = openai.OpenAI(base_url=srv.http + "/v1", api_key="x", max_retries=0)
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"test-model", "r2qv"}
    assert cards["r2qv"].parent == "test-model" and cards["r2qv"].root == paths["r2qv"]

    def text(name, i):
        return tok.decode(want[name, i], skip_special_tokens=False)

    assert _complete(client, "r2qv", 0) == text("r2qv", 0)
    assert _complete(client, "test-model", 0) == text(None, 0)
    with pytest.raises(openai.BadRequestError, match="nope"):
        _complete(client, "nope", 0)

    r = httpx.post(
        srv.http + "/v1/load_lora_adapter",
        json={"lora_name": "r4all", "lora_path": paths["r4all"]},
    )
    assert r.status_code == 200, r.text
    r = httpx.post(srv.http + "/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/"})
    assert r.status_code == 400 and "adapter_config.json" in r.text
    assert "r4all" in {m.id for m in client.models.list().data}
    # two adapters, one slot: the requests take turns, each with its own adapter
    jobs = [("r4all", 3), ("r2qv", 3), ("r4all", 2), ("test-model", 2), ("r2qv", 0)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: _complete(client, *job), jobs))
    assert got == [text(None if m == "test-model" else m, i) for m, i in jobs]

    r = httpx.post(srv.http + "/v1/unload_lora_adapter", json={"lora_name": "r4all"})
    assert r.status_code == 200, r.text
    with pytest.raises(openai.BadRequestError):
        _complete(client, "r4all", 0)
    r = httpx.post(srv.http + "/v1/unload_lora_adapter", json={"lora_name": "r4all"})
    assert r.status_code == 404
    stats = srv.engine.get_stats()
    assert stats.num_free_blocks == stats.num_kv_blocks  # nothing leaked


def test_grpc_lora_name(server, folders):  # noqa: F811
    srv, _ = server
    _, _, want = folders
    with grpc.insecure_channel(srv.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        req = build_request(PROMPTS[1], stream=False, max_tokens=8, temperature=0, ignore_eos=True)
        req.lora_name = "r2qv"
        (resp,) = list(stub.Generate(req))
        assert list(resp.outputs[0].token_ids) == want["r2qv", 1]
        req.lora_name = "missing"
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(req))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "missing" in err.value.details()


def _scrape(url: str) -> dict[str, list]:
    """/metrics parsed by prometheus_client's own parser: metric name -> its samples."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def test_router_metrics_under_load(server, folders, monkeypatch):  # noqa: F811
    """vLLM's router metrics (what llm-d / the Gateway API inference extension read) from the
    real server while requests of two adapters compete for its one adapter slot: equal to
    the engine snapshot the scrape read, never more than one running adapter, and empty
    once every request is done."""
    srv, _ = server
    snapshots: list = []  # every engine snapshot the server read
    get_stats = srv.engine.get_stats

    def recording_get_stats():
        stats = get_stats()
        snapshots.append(stats)
        return stats

    monkeypatch.setattr(srv.engine, "get_stats", recording_get_stats)
    _, paths, _ = folders
    r = httpx.post(
        srv.http + "/v1/load_lora_adapter",
        json={"lora_name": "r8mlp", "lora_path": paths["r8mlp"]},
    )
    assert r.status_code == 200, r.text
    client = openai.OpenAI(base_url=srv.http + "/v1", api_key="x", max_retries=0, timeout=120)

    def stream(model: str, i: int) -> int:
        chunks = client.completions.create(
            model=model, prompt=PROMPTS[i % 4], max_tokens=40, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return sum(1 for _ in chunks)

    jobs = [("r2qv", 0), ("r8mlp", 2), ("r2qv", 3), ("test-model", 0), ("r8mlp", 0), ("r2qv", 2)]
    seen: list = []  # (snapshots the server read during a scrape, the scrape)
    waiting_adapters: set[str] = set()
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(stream, *job) for job in jobs]
        while not all(f.done() for f in futures):
            del snapshots[:]
            m = _scrape(srv.http)
            seen.append((list(snapshots), m))
            info = m["vllm:lora_requests_info"]
            assert len(info) == 1
            running = info[0].labels["running_lora_adapters"]
            assert running in ("", "r2qv", "r8mlp")  # one slot: one adapter runs at a time
            waiting = info[0].labels["waiting_lora_adapters"]
            waiting_adapters.update(filter(None, waiting.split(",")))
            assert info[0].labels["max_lora"] == "1"
        assert all(f.result() > 0 for f in futures)
    assert waiting_adapters & {"r2qv", "r8mlp"}, "no request ever waited for the adapter slot"
    label = {"model_name": "test-model"}

    def matches(stats, m) -> bool:
        (info,) = m["vllm:lora_requests_info"]
        got = [
            *((s.labels, s.value) for s in m["vllm:num_requests_running"]),
            *((s.labels, s.value) for s in m["vllm:num_requests_waiting"]),
            *((s.labels, round(s.value, 9)) for s in m["vllm:kv_cache_usage_perc"]),
            *((s.labels, round(s.value, 9)) for s in m["vllm:gpu_cache_usage_perc"]),
            m["jaxpaged:num_requests_running"][0].value,
            info.labels["running_lora_adapters"],
            info.labels["waiting_lora_adapters"],
        ]
        usage = round(stats.kv_cache_usage, 9)
        return got == [
            (label, stats.num_running), (label, stats.num_waiting), (label, usage),
            (label, usage), stats.num_running, ",".join(stats.running_lora_adapters),
            ",".join(stats.waiting_lora_adapters),
        ]  # fmt: skip

    busy = 0
    for read, m in seen:
        assert any(matches(stats, m) for stats in read), (read, m)
        busy += any(s.num_running and s.kv_cache_usage > 0 for s in read)
    assert busy, "no scrape saw a running request"
    assert all(s.num_running <= 4 for read, _ in seen for s in read)  # max_num_seqs

    m = _scrape(srv.http)  # all done: nothing running, waiting or held
    (cache,) = m["vllm:cache_config_info"]  # the fixture's pool: 32 blocks of 16 tokens
    assert cache.labels == {"block_size": "16", "num_gpu_blocks": "32"} and cache.value == 1
    assert [s.value for s in m["vllm:num_requests_running"]] == [0]
    assert [s.value for s in m["vllm:num_requests_waiting"]] == [0]
    (info,) = m["vllm:lora_requests_info"]
    assert info.labels["running_lora_adapters"] == info.labels["waiting_lora_adapters"] == ""
    assert httpx.post(srv.http + "/v1/unload_lora_adapter", json={"lora_name": "r8mlp"}).is_success


def test_sleep_mode_over_http(server, folders):  # noqa: F811
    srv, tok = server
    _, _, want = folders
    client = openai.OpenAI(base_url=srv.http + "/v1", api_key="x", max_retries=0)
    assert httpx.get(srv.http + "/is_sleeping").json() == {"is_sleeping": False}
    assert httpx.post(srv.http + "/sleep?level=3").status_code == 400
    assert httpx.post(srv.http + "/sleep?level=1").status_code == 200
    assert httpx.get(srv.http + "/is_sleeping").json() == {"is_sleeping": True}
    with pytest.raises(openai.APIStatusError, match="asleep") as err:
        _complete(client, "r2qv", 0)
    assert err.value.status_code == 503
    assert httpx.post(srv.http + "/wake_up").status_code == 200
    assert httpx.get(srv.http + "/is_sleeping").json() == {"is_sleeping": False}
    assert _complete(client, "r2qv", 2) == tok.decode(want["r2qv", 2], skip_special_tokens=False)


def test_http_logits_processor_by_name(server, folders):  # noqa: F811
    """A registered processor chosen per request over HTTP equals transformers' own
    ``no_repeat_ngram_size`` on the base model; an unknown name is a 400."""
    import torch
    import transformers

    srv, tok = server
    base = folders[0]
    client = openai.OpenAI(base_url=srv.http + "/v1", api_key="x", max_retries=0)
    prompt = [5, 6, 5, 7, 9]
    hf = transformers.LlamaForCausalLM.from_pretrained(base).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ref = hf.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
            do_sample=False, no_repeat_ngram_size=2, pad_token_id=0, eos_token_id=None,
        )[0, len(prompt):].tolist()  # fmt: skip

    def text(extra):
        out = client.completions.create(
            model="test-model", prompt=prompt, max_tokens=16, temperature=0,
            extra_body={"ignore_eos": True, "skip_special_tokens": False, **extra},
        )  # fmt: skip
        return out.choices[0].text

    got = text({"logits_processor": "no_repeat_ngram", "logits_processor_args": [2]})
    assert got == tok.decode(ref, skip_special_tokens=False)
    with pytest.raises(openai.BadRequestError, match="nope"):
        text({"logits_processor": "nope"})
