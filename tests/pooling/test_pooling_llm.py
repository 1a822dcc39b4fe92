"""``LLM(model, runner="pooling")`` on tiny random checkpoints: embeddings equal
sentence-transformers' (its pooling read from modules.json), cross-encoder scores equal
transformers' logits through the sigmoid, inputs over the limit refused or truncated as
``truncate_prompt_tokens`` says, Matryoshka ``dimensions``, nothing compiled after
warm-up, and generation and pooling calls each refused by the other runner."""

from __future__ import annotations

import json
import os
import types

import numpy as np
import pytest
import torch
from encoders import save_encoder, save_sentence_transformers_files, texts

from jaxpaged import LLM
from jaxpaged.args import EngineArgs
from jaxpaged.engine import LLMEngine
from jaxpaged.engine.runner_choice import choose_runner

MAX_LEN = 16  # sentence_bert_config's max_seq_length: sentence-transformers truncates there


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("bert-embed"))
    save_encoder(folder, "BertModel")
    save_sentence_transformers_files(folder, "mean", normalize=True, max_seq_length=MAX_LEN,
                                     dim=32)  # fmt: skip
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**config, "matryoshka_dimensions": [8, 16, 32]}, f)
    llm = LLM(folder, max_num_seqs=8, show_progress=False)
    yield folder, llm
    llm.close()


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("bert-cross"))
    hf = save_encoder(folder, "BertForSequenceClassification", num_labels=1)
    llm = LLM(folder, runner="pooling", max_num_seqs=4, max_model_len=16, show_progress=False)
    yield hf, folder, llm
    llm.close()


def test_embeddings_equal_sentence_transformers(embedder):
    from sentence_transformers import SentenceTransformer

    folder, llm = embedder
    sentences = texts(21, longest=MAX_LEN - 2)  # more inputs than rows: several batches
    outs = llm.embed(sentences)
    ours = np.array([o.outputs.embedding for o in outs])
    ref = SentenceTransformer(folder, device="cpu").encode(sentences)
    assert ours.shape == ref.shape == (21, 32)
    np.testing.assert_allclose(ours, ref, atol=2e-5)
    assert outs[0].prompt_token_ids[0] == 2  # [CLS]
    # token ids embed as their text does
    again = llm.embed([outs[3].prompt_token_ids])[0].outputs.embedding
    np.testing.assert_allclose(again, ours[3], atol=1e-6)
    # an embedding model scores by cosine similarity
    s = llm.score(sentences[0], sentences[1:3])
    np.testing.assert_allclose([o.outputs.score for o in s], ref[1:3] @ ref[0], atol=1e-5)
    assert llm.get_metrics()["num_compilations_after_warmup"] == 0


def test_inputs_over_the_limit_are_refused_or_truncated(embedder):
    from sentence_transformers import SentenceTransformer

    folder, llm = embedder
    long = texts(1, seed=5, longest=40)[0] + " w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13 w14"
    with pytest.raises(
        ValueError, match=rf"more than this model's maximum input length of {MAX_LEN}"
    ):
        llm.embed([long])
    cut = llm.embed([long], truncate_prompt_tokens=-1)[0]
    assert len(cut.prompt_token_ids) == MAX_LEN and cut.prompt_token_ids[-1] == 3  # [SEP] kept
    ref = SentenceTransformer(folder, device="cpu").encode([long])[0]  # truncates at 16 too
    np.testing.assert_allclose(cut.outputs.embedding, ref, atol=2e-5)
    assert len(llm.embed([long], truncate_prompt_tokens=5)[0].prompt_token_ids) == 5
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.embed(["w1"], truncate_prompt_tokens=MAX_LEN + 1)
    for bad, match in (([], "must not be empty"), ([""], r"input\[0\] is an empty string"),
                       ([[5, 10_000]], "token id 10000 outside")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            llm.embed(bad)
    assert llm.get_metrics()["num_compilations_after_warmup"] == 0


def test_matryoshka_dimensions(embedder):
    _, llm = embedder
    full = llm.embed(["w1 w2 w3"])[0].outputs.embedding
    short = llm.embed(["w1 w2 w3"], dimensions=8)[0].outputs.embedding
    assert len(short) == 8
    # the pooled vector truncated, then normalised: proportional to the full one's head
    head = np.array(full[:8])
    np.testing.assert_allclose(short, head / np.linalg.norm(head), atol=1e-6)
    with pytest.raises(ValueError, match=r"not one of this model's Matryoshka sizes \[8, 16, 32\]"):
        llm.embed(["w1"], dimensions=12)


def test_cross_encoder_scores_equal_transformers(cross_encoder):
    hf, folder, llm = cross_encoder
    query, docs = "w1 w7 w9", texts(6, seed=3, longest=10)
    outs = llm.score(query, docs)
    enc = llm.tokenizer([query] * len(docs), docs, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = hf(**enc).logits[:, 0].numpy()
    np.testing.assert_allclose([o.outputs.score for o in outs], 1 / (1 + np.exp(-logits)),
                               atol=1e-5)  # fmt: skip
    assert outs[0].prompt_token_ids == enc["input_ids"][0][enc["attention_mask"][0] > 0].tolist()
    from sentence_transformers import CrossEncoder  # the reference cross-encoder

    ref = CrossEncoder(folder, device="cpu").predict([(query, d) for d in docs])
    np.testing.assert_allclose([o.outputs.score for o in outs], ref, atol=1e-5)
    with pytest.raises(ValueError, match="cross-encoder"):
        llm.embed(["w1"])
    assert llm.get_metrics()["num_compilations_after_warmup"] == 0


def test_runners_refuse_each_others_calls(cross_encoder, bundled_model_path, tmp_path):
    _, folder, llm = cross_encoder
    with pytest.raises(ValueError, match=r"generate\(\) needs runner='generate'.*runner='pooling'"):
        llm.generate(["w1"])
    with pytest.raises(ValueError, match="is a pooling model"):
        LLMEngine.from_engine_args(EngineArgs(model=folder))
    with pytest.raises(ValueError, match="runner='generate' cannot run model"):
        choose_runner(EngineArgs(model=folder, runner="generate"))
    assert choose_runner(EngineArgs(model=bundled_model_path)) == "generate"
    # a decoder pools when asked (last-token embeddings: tests/pooling/test_decoder_embed.py)
    assert choose_runner(EngineArgs(model=bundled_model_path, runner="pooling")) == "pooling"
    generator = LLM.__new__(LLM)  # the refusal is decided before the engine is asked
    generator.engine = types.SimpleNamespace(runner=object())  # as an LLMEngine: its worker
    with pytest.raises(ValueError, match=r"embed\(\) needs runner='pooling'.*runner='generate'"):
        generator.embed(["hello"])


def test_roberta_cross_encoder_scores_with_one_segment(tmp_path):
    """A RoBERTa cross-encoder's scores through the engine equal transformers' (one token
    type: the engine passes no segment ids, whatever the tokenizer returns)."""
    hf = save_encoder(str(tmp_path), "RobertaForSequenceClassification", num_labels=1)
    query, docs = "w1 w2", texts(3, seed=4, longest=8)
    with LLM(str(tmp_path), max_num_seqs=2, max_model_len=16, show_progress=False) as llm:
        outs = llm.score(query, docs)
    for out in outs:
        with torch.no_grad():
            logit = hf(torch.tensor([out.prompt_token_ids])).logits[0, 0].item()
        assert abs(out.outputs.score - 1 / (1 + np.exp(-logit))) < 1e-5
