"""The gRPC admin call `jaxpaged.v1.Admin/UpdateWeights` on a real engine: after an update
from a checkpoint path, greedy outputs over gRPC equal transformers' on that checkpoint, nothing
compiles, a bad path is INVALID_ARGUMENT (the engine keeps its weights), and a server without
--enable-weight-updates answers UNIMPLEMENTED."""

from __future__ import annotations

import grpc
import pytest
import torch
import transformers

from jaxpaged.serving import admin_pb2, admin_pb2_grpc
from jaxpaged.serving import generation_pb2_grpc as pb_grpc
from jaxpaged.serving.client import build_request

PROMPTS = [[1, 500, 7000, 42, 9], list(range(100, 140))]
MAX_TOKENS = 6
KEY = (("authorization", "Bearer k"),)


def _checkpoint(folder, tokenizer, seed: int) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        initializer_range=0.2,
        max_position_embeddings=128,
    )
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return hf


def _hf_greedy(hf, prompt: list[int]) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, bundled_model_path):
    """Two random tiny Llamas on the bundled tokenizer: (folder, greedy tokens per prompt)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(bundled_model_path)
    out = []
    for seed in (1, 2):
        folder = tmp_path_factory.mktemp(f"tiny-{seed}")
        hf = _checkpoint(folder, tokenizer, seed)
        out.append((str(folder), [_hf_greedy(hf, p) for p in PROMPTS]))
    assert out[0][1] != out[1][1]
    return out


def _engine(folder: str):
    from jaxpaged.engine import AsyncEngine, LLMEngine

    return AsyncEngine(
        LLMEngine.from_args(
            folder,
            max_model_len=64,
            max_num_seqs=2,
            max_num_batched_tokens=64,
            num_kv_blocks=16,
            show_progress=False,
        )
    )


def _greedy(target: str) -> list[list[int]]:
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        out = []
        for p in PROMPTS:
            req = build_request(
                p, stream=False, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True
            )
            (msg,) = stub.Generate(req, metadata=KEY, timeout=120)
            out.append(list(msg.outputs[0].token_ids))
        return out


def test_update_weights_over_grpc(server_factory, checkpoints):
    (first, want_first), (second, want_second) = checkpoints
    engine = _engine(first)
    server = server_factory(engine, enable_weight_updates=True, api_key="k")
    assert _greedy(server.grpc_target) == want_first
    with grpc.insecure_channel(server.grpc_target) as channel:
        admin = admin_pb2_grpc.AdminStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            admin.UpdateWeights(admin_pb2.UpdateWeightsRequest(path=second), timeout=120)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        reply = admin.UpdateWeights(
            admin_pb2.UpdateWeightsRequest(path=second), metadata=KEY, timeout=120
        )
        assert reply.load_seconds > 0
        for bad in ("", "/nonexistent/checkpoint"):
            with pytest.raises(grpc.RpcError) as e:
                admin.UpdateWeights(
                    admin_pb2.UpdateWeightsRequest(path=bad), metadata=KEY, timeout=120
                )
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _greedy(server.grpc_target) == want_second
    assert engine.get_stats().num_compilations_after_warmup == 0


def test_admin_is_off_by_default(server_factory):
    from fakes import FakeAsyncEngine

    server = server_factory(FakeAsyncEngine())
    with grpc.insecure_channel(server.grpc_target) as channel:
        admin = admin_pb2_grpc.AdminStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            admin.UpdateWeights(admin_pb2.UpdateWeightsRequest(path="x"), timeout=30)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
