"""The benchmark scripts run end to end on a tiny random Llama, so they cannot rot; and their
workload, statistics and roofline arithmetic agree with independent computations."""

from __future__ import annotations

import csv
import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from bench_env import script_env

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


def _load(name: str):
    """Imports a bench module (bench/ is a folder of scripts that import each other by bare
    name, so it goes on sys.path)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, bundled_model_path) -> str:
    """A 2-layer random Llama (hidden 32) with the bundled SmolLM2 tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    cfg = LlamaConfig(
        vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, rope_theta=10000.0,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out)
    for f in os.listdir(bundled_model_path):
        if f.startswith("tokenizer") or f == "special_tokens_map.json":
            shutil.copy(os.path.join(bundled_model_path, f), out)
    return str(out)


# ------------------------------------------------------------------ pure helpers (fast)
def test_summarize_matches_numpy():
    common = _load("common")
    rng = np.random.default_rng(1)
    xs = rng.exponential(size=37).tolist()
    s = common.summarize(xs)
    assert s["mean"] == pytest.approx(np.mean(xs))
    assert s["p50"] == pytest.approx(np.percentile(xs, 50))
    assert s["p99"] == pytest.approx(np.percentile(xs, 99))
    assert s["max"] == max(xs)
    assert np.isnan(common.summarize([])["p50"])


def test_workload_seeded_and_in_range(bundled_model_path):
    from transformers import AutoTokenizer

    common = _load("common")
    tok = AutoTokenizer.from_pretrained(bundled_model_path)
    a = common.make_workload(tok, num_prompts=6, seed=3, min_output=5, max_output=9)
    b = common.make_workload(tok, num_prompts=6, seed=3, min_output=5, max_output=9)
    c = common.make_workload(tok, num_prompts=6, seed=4, min_output=5, max_output=9)
    assert a == b and a != c
    for r in a:
        assert 5 <= r.max_tokens <= 9
        # chat-formatted: the ids are what the tokenizer's own template gives
        text = tok.apply_chat_template(list(r.messages), add_generation_prompt=True, tokenize=False)
        assert tok.decode(list(r.prompt_token_ids)) == text
    with pytest.raises(ValueError, match="num_prompts"):
        common.make_workload(tok, num_prompts=0)


def test_jsonl_workload(tmp_path, bundled_model_path):
    from transformers import AutoTokenizer

    common = _load("common")
    tok = AutoTokenizer.from_pretrained(bundled_model_path)
    p = tmp_path / "w.jsonl"
    p.write_text(
        '{"prompt": "hi", "max_tokens": 7}\n\n{"messages": [{"role": "user", "content": "yo"}]}\n'
    )
    work = common.load_jsonl_workload(str(p), tok, min_output=3, max_output=3)
    assert [r.max_tokens for r in work] == [7, 3]
    p.write_text('{"max_tokens": 7}\n')
    with pytest.raises(ValueError, match="w.jsonl:1"):
        common.load_jsonl_workload(str(p), tok)


def test_roofline_counts_match_hf_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from jaxpaged.models.config import ModelConfig

    roofline = _load("roofline")
    hf = LlamaConfig(vocab_size=300, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                     num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                     tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    n_hf = sum(p.numel() for p in LlamaForCausalLM(hf).parameters())
    cfg = ModelConfig(model_type="llama", vocab_size=300, hidden_size=48, intermediate_size=80,
                      num_layers=3, num_heads=6, num_kv_heads=2, head_dim=8,
                      tie_word_embeddings=True)  # fmt: skip
    assert roofline.param_count(cfg)["total"] == n_hf
    cost = roofline.decode_step_cost(cfg, [10, 20], dtype_bytes=4)
    # by hand: per layer q,k,v,o = 48*(6+2+2)*8 + 48*48 and mlp 3*48*80; lm_head 300*48
    layer = 48 * 80 + 48 * 48 + 3 * 48 * 80
    assert cost.flops == 2 * 2 * (3 * layer + 300 * 48) + 4 * 3 * 6 * 8 * 30
    assert cost.kv_bytes == 4 * 2 * 3 * 2 * 8 * 30
    assert cost.weight_bytes == 4 * (3 * (layer + 2 * 48) + 300 * 48)
    peaks = roofline.MachinePeaks(matmul_flops=1e9, mem_bandwidth=1e9, dtype="float32", detail={})
    assert cost.roofline_seconds(peaks) == max(cost.flops, cost.bytes) / 1e9
    # matmuls then attention, by hand: at equal rates the weights' bytes (4 * 67680) outweigh
    # the matmuls' FLOPs (4 * 67392), and the attention's FLOPs (17280) its KV bytes (11520)
    assert cost.serial_seconds(peaks) == pytest.approx((4 * 67680 + 17280) / 1e9)
    slow_memory = roofline.MachinePeaks(matmul_flops=1e9, mem_bandwidth=1e6, dtype="float32",
                                        detail={})  # fmt: skip
    assert cost.serial_seconds(slow_memory) == pytest.approx(cost.bytes / 1e6)


def test_prefill_flops_by_hand():
    from jaxpaged.models.config import ModelConfig

    roofline = _load("roofline")
    cfg = ModelConfig(model_type="llama", vocab_size=300, hidden_size=48, intermediate_size=80,
                      num_layers=3, num_heads=6, num_kv_heads=2, head_dim=8,
                      tie_word_embeddings=True)  # fmt: skip
    layer = 48 * 80 + 48 * 48 + 3 * 48 * 80  # q, k, v, o and the MLP, as above
    pairs = sum(i + 1 for i in range(5))  # causal: token i sees i + 1 positions
    attention = 3 * 6 * pairs * (2 * 8 + 2 * 8)  # q.k and p.v, per layer and head
    assert roofline.prefill_flops(cfg, 5) == 2 * 5 * 3 * layer + 2 * 300 * 48 + attention


# ------------------------------------------------------------------- scripts (subprocess)
def test_throughput_smoke(tmp_path, tiny_model, capsys):
    """Every figure the script reports, on a tiny model; and a peer that fails (a stand-in
    "Python" that imports vLLM but whose offline run exits 1) is reported while the other
    systems' figures still come out. main() runs in-process: this worker has JAX, torch and
    transformers imported already, a child would import them again."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\nif [ "$1" = "-c" ]; then echo 0.0-fake; exit 0; fi\nexit 1\n')
    fake.chmod(0o755)
    out = tmp_path / "t.json"
    rc = _load("throughput").main([
        "--model", tiny_model, "--num-prompts", "3", "--batch-size", "2",
        "--min-output", "3", "--max-output", "6", "--max-prompt-words", "10",
        "--max-model-len", "256", "--max-num-seqs", "4", "--enforce-eager", "--no-hf-cb-warmup",
        "--peaks-small", "--decode-batch", "2", "--decode-steps", "2", "--decode-rounds", "2",
        "--json-out", str(out),
        "--rounds", "2", "--prefill-lengths", "8", "24", "--prefill-repeats", "2",
        "--max-num-batched-tokens", "16", "--vllm-python", str(fake),
    ])  # fmt: skip
    stdout = capsys.readouterr().out
    assert rc == 0, stdout[-3000:]
    assert "vLLM's offline run failed with exit code 1" in stdout
    report = json.loads(out.read_text())
    assert len(report["rounds"]) == 2 and len(report["ratios_vs_hf-cb"]) == 2
    assert report["ratio_vs_hf-cb"] == statistics.median(report["ratios_vs_hf-cb"])
    res = report["results"]
    assert set(res) == {"jaxpaged", "hf-static", "hf-cb"}
    useful = {k: v["useful_tokens"] for k, v in res.items()}
    assert len(set(useful.values())) == 1 and 9 <= useful["jaxpaged"] <= 18, useful
    # static batching pads each batch to its longest request
    assert res["hf-static"]["generated_tokens"] >= res["hf-static"]["useful_tokens"]
    assert res["jaxpaged"]["extra"]["compilations_after_warmup"] >= 0
    step = report["decode_step"]
    assert step["batch"] == 2 and step["roofline_s"] > 0 and len(step["rounds"]) == 2
    assert step["ratio"] == statistics.median(r["ratio"] for r in step["rounds"])
    for r in step["rounds"]:
        assert len(r["step_seconds"]) == 2 and r["median_s"] / r["roofline_s"] == r["ratio"]
        assert (
            r["serial_s"] >= r["roofline_s"] and r["median_s"] / r["serial_s"] == r["serial_ratio"]
        )
    assert step["serial_ratio"] == statistics.median(r["serial_ratio"] for r in step["rounds"])
    assert "ratio jaxpaged / hf-static" in stdout and "roofline" in stdout
    # prefill alone: a 24-token prompt over a 16-token budget takes two steps
    prefill = report["prefill"]
    assert [(r["prompt_len"], r["steps"], len(r["seconds"])) for r in prefill] == [
        (8, 1, 2), (24, 2, 2)]  # fmt: skip
    assert all(r["median_s"] > 0 and r["share"] == r["flops"] / r["median_s"] / r["peak_flops"]
               for r in prefill)  # fmt: skip


_FAKE_LLAMA_SERVER = """#!{python}
# a stand-in llama-server: /health, and /completion predicting n_predict tokens
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def _send(self, obj):
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        self._send({{"status": "ok"}})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["temperature"] == 0.0 and body["ignore_eos"] and body["prompt"]
        self._send({{"tokens_predicted": body["n_predict"]}})
HTTPServer(("127.0.0.1", port), H).serve_forever()
"""

_FAKE_LLAMA_BENCH = """#!/bin/sh
echo '[{{"n_prompt": 256, "n_gen": 0, "avg_ts": 236.5}}, {{"n_prompt": 0, "n_gen": 128, "avg_ts": 89.25}}]'
"""


def test_llamacpp_peer_offline_run_and_llama_bench(tmp_path):
    """The llama.cpp peer against stand-in binaries: the server launched, every request's
    token count back, llama-bench's pp / tg figures parsed; bad paths refused by name."""
    peer = _load("llamacpp_peer")
    common = _load("common")
    server = tmp_path / "llama-server"
    server.write_text(_FAKE_LLAMA_SERVER.format(python=sys.executable))
    bench = tmp_path / "llama-bench"
    bench.write_text(_FAKE_LLAMA_BENCH.format())
    for f in (server, bench):
        f.chmod(0o755)
    work = [common.BenchRequest(messages=(), prompt_token_ids=(1, 2, 3 + i), max_tokens=4 + i)
            for i in range(5)]  # fmt: skip
    with peer.launched_llama_server(str(server), model="m.gguf", host="127.0.0.1", parallel=2,
                                    ctx_per_slot=64, threads=2, timeout=60) as port:  # fmt: skip
        run = peer.run_llama_offline(port, "127.0.0.1", work, parallel=2)
    assert run.token_counts == [4, 5, 6, 7, 8] and run.seconds > 0
    got = peer.llama_bench(str(server), model="m.gguf", threads=2, prompt=256, gen=128)
    assert got == {"pp": 236.5, "tg": 89.25}
    with pytest.raises(ValueError, match="not an executable"):
        peer.check_llama_server(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=".gguf"):
        peer.gguf_file(str(tmp_path))


def test_throughput_rejects_unknown_system(capsys):
    # main() in-process: the same exit status the script gives (`raise SystemExit(main())`),
    # without a Python start per refusal
    assert _load("throughput").main(["--systems", "jaxpaged,bogus"]) == 2
    assert "unknown ['bogus']" in capsys.readouterr().err


def test_throughput_rejects_zero_decode_rounds(capsys):
    assert _load("throughput").main(["--decode-rounds", "0"]) == 2
    assert "--decode-rounds must be >= 1" in capsys.readouterr().err


def test_step_breakdown_smoke(tmp_path, tiny_model):
    """main() in-process, as test_throughput_smoke."""
    out = tmp_path / "b.json"
    rc = _load("step_breakdown").main([
        "--model", tiny_model, "--batch", "2", "--steps", "2", "--max-model-len", "256",
        "--max-num-seqs", "4", "--max-prompt-words", "10", "--enforce-eager",
        "--json-out", str(out),
    ])  # fmt: skip
    assert rc == 0
    b = json.loads(out.read_text())
    assert b["bucket"]["decode_only"] and b["bucket"]["num_seqs"] >= 2
    assert all(v >= 0 for v in b["host_and_step_ms"].values())
    assert set(b["device_parts_ms"]) >= {
        "sampler (greedy)",
        "write_kv + paged attention, all layers",
    }


# the engine's shapes of test_throughput_smoke (--max-num-batched-tokens 16 too), so that the
# server loads the programs that test compiled from the persistent compile cache
_SERVER_ARGS = ["--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "16",
                "--enforce-eager"]  # fmt: skip


@pytest.fixture(scope="module")
def launched(tmp_path_factory, tiny_model):
    """One server (HTTP and gRPC ports) for both load-generator tests, started as
    `bench/serving.py --launch` starts it: the script's parser and its launched_server."""
    serving = _load("serving")
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = serving.build_parser().parse_args(
        ["--launch", "--model", tiny_model, "--server-log", str(log), "--server-args",
         *_SERVER_ARGS]
    )  # fmt: skip
    with serving.launched_server(args):
        yield serving, ["--model", tiny_model, "--host", args.host, "--port", str(args.port),
                        "--grpc-port", str(args.grpc_port)]  # fmt: skip


def test_serving_sweep_http_launch(tmp_path, launched):
    """The load generator runs in-process against the launched server (it builds no engine):
    a Python start fewer than the script, and one server for this test and the next."""
    serving, target = launched
    prefix = tmp_path / "sweep"
    rc = serving.main([
        *target, "--num-prompts", "3", "--min-output", "3", "--max-output", "5",
        "--max-prompt-words", "10", "--sweep", "1,2", "--out-prefix", str(prefix),
    ])  # fmt: skip
    assert rc == 0
    rows = list(csv.DictReader(open(f"{prefix}.csv")))
    assert [int(r["concurrency"]) for r in rows] == [1, 2]
    for r in rows:
        assert int(r["completed"]) == 3 and int(r["failed"]) == 0
        assert 9 <= int(r["output_tokens"]) <= 15
        assert 0 < float(r["ttft_p50_ms"]) <= float(r["e2e_p50_ms"])
    assert Path(f"{prefix}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_serving_grpc_launch(tmp_path, launched):
    """The same server over gRPC."""
    serving, target = launched
    out = tmp_path / "g.json"
    rc = serving.main([
        *target, "--backend", "grpc", "--num-prompts", "3", "--equal-length", "4",
        "--max-prompt-words", "10", "--concurrency", "3", "--json-out", str(out),
    ])  # fmt: skip
    assert rc == 0
    (row,) = json.loads(out.read_text())
    assert row["completed"] == 3 and row["output_tokens"] == 12
    assert row["tpot_mean_ms"] > 0 and row["itl_p50_ms"] > 0


def test_gpu_decode_dry_run(tmp_path):
    proc = subprocess.run(
        [sys.executable, "bench/gpu_decode.py", "--dry-run", "--concurrency", "1,2",
         "--decode-steps", "2", "--warm-steps", "1", "--json-out", str(tmp_path / "gpu.json")],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env=script_env(JAX_PLATFORMS="cpu"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert [r["concurrency"] for r in result["rows"]] == [1, 2]
    assert all(r["running"] == r["concurrency"] and r["tok_s"] > 0 for r in result["rows"])
