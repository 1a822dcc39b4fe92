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
