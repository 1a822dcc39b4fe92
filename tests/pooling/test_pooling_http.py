"""The pooling APIs over HTTP on tiny random encoders: ``/v1/embeddings`` through the real
``openai`` client (float and base64) equal to the offline embeddings, ``/pooling``,
``/score`` and ``/rerank`` equal to transformers' cross-encoder, hostile inputs answered
with 400s naming the problem while the server keeps serving, and each runner's endpoints
refused by the other's server."""

from __future__ import annotations

import os
import sys
import time

import httpx
import numpy as np
import openai
import pytest
import torch
from encoders import save_encoder, save_sentence_transformers_files, texts

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "serving"))
from fakes import FakeAsyncEngine  # noqa: E402
from harness import ServerThread  # noqa: E402

from jaxpaged.args import EngineArgs  # noqa: E402
from jaxpaged.engine.async_pooling import AsyncPoolingEngine  # noqa: E402
from jaxpaged.engine.pooling import PoolingEngine  # noqa: E402


def _serve(folder: str, **args) -> tuple[PoolingEngine, ServerThread]:
    engine = PoolingEngine.from_engine_args(EngineArgs(model=folder, show_progress=False, **args))
    return engine, ServerThread(AsyncPoolingEngine(engine), served_model_name="enc")


@pytest.fixture(scope="module")
def embed_server(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("http-embed"))
    save_encoder(folder, "BertModel")
    save_sentence_transformers_files(folder, "mean", normalize=True, max_seq_length=16, dim=32)
    engine, server = _serve(folder, max_num_seqs=8)  # the shapes of test_pooling_llm's
    yield engine, server
    server.stop()
    engine.close()


@pytest.fixture(scope="module")
def rerank_server(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("http-cross"))
    hf = save_encoder(folder, "BertForSequenceClassification", num_labels=1, seed=1)
    engine, server = _serve(folder, max_num_seqs=4, max_model_len=16)
    yield hf, engine, server
    server.stop()
    engine.close()


def test_openai_embeddings_equal_offline_embeddings(embed_server):
    engine, server = embed_server
    sentences = texts(5, seed=7, longest=12)
    want = np.array([o.outputs.embedding for o in engine.embed(sentences)])
    client = openai.OpenAI(base_url=f"{server.http}/v1", api_key="none")
    got = client.embeddings.create(model="enc", input=sentences)  # the client asks for base64
    assert [d.index for d in got.data] == list(range(5))
    np.testing.assert_allclose([d.embedding for d in got.data], want, atol=1e-6)
    assert got.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in engine.embed(sentences))
    floats = client.embeddings.create(model="enc", input=sentences[0], encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, want[0], atol=1e-6)
    ids = engine.embed(sentences[1])[0].prompt_token_ids
    by_ids = client.embeddings.create(model="enc", input=[ids], encoding_format="float")
    np.testing.assert_allclose(by_ids.data[0].embedding, want[1], atol=1e-6)
    pooled = httpx.post(f"{server.http}/pooling", json={"input": sentences[:2]}).json()
    np.testing.assert_allclose([d["data"] for d in pooled["data"]], want[:2], atol=1e-6)


def test_hostile_inputs_get_400s_and_the_server_keeps_serving(embed_server):
    _, server = embed_server
    url = f"{server.http}/v1/embeddings"
    for body, words in (
        ({"input": []}, "input must not be empty"),
        ({"input": ""}, "empty string"),
        ({"input": ["w1", ""]}, r"input[1] is an empty string"),
        ({"input": ["w1"] * 10_000}, "at most 2048"),
        ({"input": [[5, 99999]]}, "token id 99999 outside"),
        ({"input": "w1", "dimensions": 8}, "does not support Matryoshka"),
        ({"input": " ".join(["w1"] * 40)}, "maximum input length of 16"),
        ({"input": "w1", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "w1", "model": "other"}, "does not exist"),
        ({"input": "w1", "prompt_name": "query"}, "prompt_name 'query' is not one of"),
    ):
        r = httpx.post(url, json=body)
        assert r.status_code == 400 and words in r.json()["error"]["message"], (body, r.text)
    r = httpx.post(url, json={"input": " ".join(["w1"] * 40), "truncate_prompt_tokens": -1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 16
    r = httpx.post(f"{server.http}/v1/completions", json={"prompt": "w1", "max_tokens": 2})
    assert r.status_code == 400 and "runs the pooling runner" in r.json()["error"]["message"]
    assert httpx.get(f"{server.http}/health").status_code == 200


def test_score_and_rerank_equal_transformers(rerank_server):
    hf, engine, server = rerank_server
    query, docs = "w3 w4", texts(5, seed=11, longest=10)
    enc = engine.tokenizer([query] * len(docs), docs, padding=True, return_tensors="pt")
    with torch.no_grad():
        want = torch.sigmoid(hf(**enc).logits[:, 0]).numpy()
    scored = httpx.post(f"{server.http}/score", json={"text_1": query, "text_2": docs}).json()
    np.testing.assert_allclose([d["score"] for d in scored["data"]], want, atol=1e-4)
    body = {"query": query, "documents": docs, "top_n": 3}
    for path in ("/rerank", "/v1/rerank"):
        r = httpx.post(f"{server.http}{path}", json=body).json()
        order = np.argsort(-want)[:3]
        assert [x["index"] for x in r["results"]] == order.tolist()
        np.testing.assert_allclose([x["relevance_score"] for x in r["results"]], want[order],
                                   atol=1e-4)  # fmt: skip
        assert r["results"][0]["document"]["text"] == docs[order[0]]
    r = httpx.post(f"{server.http}/v1/embeddings", json={"input": "w1"})
    assert r.status_code == 400 and "cross-encoder" in r.json()["error"]["message"]
    assert engine.get_stats().num_compilations_after_warmup == 0


def test_a_generation_server_refuses_pooling_requests():
    server = ServerThread(FakeAsyncEngine(), served_model_name="gen")
    try:
        for path, body in (("/v1/embeddings", {"input": "hi"}),
                           ("/rerank", {"query": "q", "documents": ["d"]})):  # fmt: skip
            r = httpx.post(f"{server.http}{path}", json=body)
            assert r.status_code == 400
            assert "needs a pooling model" in r.json()["error"]["message"]
        import grpc

        from jaxpaged.serving import generation_pb2 as pb
        from jaxpaged.serving import generation_pb2_grpc as pb_grpc

        with grpc.insecure_channel(server.grpc_target) as channel:
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.GenerationStub(channel).Embed(
                    pb.EmbedRequest(inputs=[pb.EmbedInput(text="hi")])
                )
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "needs a pooling model" in err.value.details()
    finally:
        server.stop()


def test_grpc_embed(embed_server, rerank_server):
    import grpc

    from jaxpaged.serving import generation_pb2 as pb
    from jaxpaged.serving import generation_pb2_grpc as pb_grpc

    engine, server = embed_server
    sentences = texts(3, seed=9, longest=10)
    want = np.array([o.outputs.embedding for o in engine.embed(sentences)])
    ids = engine.embed(sentences[2])[0].prompt_token_ids
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        inputs = [pb.EmbedInput(text=t) for t in sentences[:2]]
        inputs.append(pb.EmbedInput(token_ids=pb.TokenIds(ids=ids)))
        reply = stub.Embed(pb.EmbedRequest(inputs=inputs))
        np.testing.assert_allclose([list(e.values) for e in reply.embeddings], want, atol=1e-6)
        assert reply.prompt_tokens == sum(e.prompt_tokens for e in reply.embeddings) > 0
        with pytest.raises(grpc.RpcError) as err:
            stub.Embed(pb.EmbedRequest(inputs=[pb.EmbedInput(text="w1")], dimensions=4))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "Matryoshka" in err.value.details()
    with grpc.insecure_channel(rerank_server[2].grpc_target) as channel:
        with pytest.raises(grpc.RpcError) as err:  # a cross-encoder has no embeddings
            pb_grpc.GenerationStub(channel).Embed(
                pb.EmbedRequest(inputs=[pb.EmbedInput(text="w1")])
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_concurrent_requests_share_batches_and_each_gets_its_own(embed_server):
    from concurrent.futures import ThreadPoolExecutor

    engine, server = embed_server
    requests = [texts(1 + i % 3, seed=100 + i, longest=14) for i in range(12)]
    want = [np.array([o.outputs.embedding for o in engine.embed(r)]) for r in requests]
    calls = []
    run_jobs = engine.run_jobs
    # the counter is process-wide: other engines' warm-ups count too, so compare
    compiled = engine.get_stats().num_compilations_after_warmup

    def counted(jobs):
        if not calls:  # the others queue meanwhile, and must then run together
            time.sleep(1.0)
        calls.append(len(jobs))
        return run_jobs(jobs)

    engine.run_jobs = counted
    try:

        def post(body):
            return httpx.post(f"{server.http}/v1/embeddings", json=body, timeout=60)

        bodies = [{"input": r, "encoding_format": "float"} for r in requests]
        bodies.insert(5, {"input": [[5, 99999]]})  # a bad one among them fails alone
        with ThreadPoolExecutor(len(bodies)) as pool:
            replies = list(pool.map(post, bodies))
    finally:
        del engine.run_jobs
    assert replies.pop(5).status_code == 400
    for reply, w in zip(replies, want, strict=True):
        got = [d["embedding"] for d in reply.json()["data"]]
        np.testing.assert_allclose(got, w, atol=1e-6)
    assert sum(calls) == 12 and len(calls) < 12  # some requests ran in one batch
    assert engine.get_stats().num_compilations_after_warmup == compiled
