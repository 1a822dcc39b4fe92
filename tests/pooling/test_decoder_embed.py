"""Decoder rerankers and a decoder's non-last-token pooling, against transformers on tiny
random Qwen3 checkpoints: a converted reranker (``Qwen3ForSequenceClassification``: a score
head on the last token) and the original Qwen3-Reranker form (a ``Qwen3ForCausalLM`` scoring
with its "yes" and "no" logits, through vLLM's ``hf_overrides``) run as pooling requests in
a paged engine; a sentence-transformers mean pooling runs on the dense pooling runner."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from decoders import ENGINE, TINY, VOCAB, hidden_states, save_causal, word_tokenizer
from encoders import save_sentence_transformers_files

from jaxpaged import LLM
from jaxpaged.args import EngineArgs
from jaxpaged.engine.paged_pooling import PagedPoolingWorker
from jaxpaged.worker.pooling_runner import PoolingRunner

# compiled as the steps need them: these tests check values (test_paged_pooling.py counts
# compilations on a warmed-up engine)
EAGER = dict(ENGINE, enforce_eager=True)
QUERY, DOCS = "w9 w10", ["w11 w12 w13", "w40", "w7 w8 w9 w10 w11 w12", "w90 w91"]
ORIGINAL_RERANKER = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True,
}


@pytest.fixture(scope="module")
def causal(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3-causal")
    return str(folder), save_causal(folder, "qwen3", seed=2)


def test_qwen3_sequence_classification_scores_equal_transformers(tmp_path):
    """A converted reranker (the decoder body and a score head on the last token) pools by
    itself; its scores are transformers' logits through the sigmoid."""
    torch.manual_seed(1)
    config = transformers.Qwen3Config(**dict(TINY, num_labels=1, pad_token_id=0))
    hf = transformers.Qwen3ForSequenceClassification(config).eval()
    hf.save_pretrained(tmp_path)
    word_tokenizer().save_pretrained(tmp_path)
    with LLM(str(tmp_path), **EAGER) as llm:
        assert isinstance(llm.engine.worker, PagedPoolingWorker)
        outs = llm.score(QUERY, DOCS)
        with pytest.raises(ValueError, match="needs runner='generate'"):
            llm.generate(["w6"])
    for out, doc in zip(outs, DOCS, strict=True):
        ids = out.prompt_token_ids
        assert ids == llm.tokenizer(QUERY, doc)["input_ids"]
        with torch.no_grad():
            logit = hf(torch.tensor([ids])).logits[0, 0].item()
        assert abs(out.outputs.score - 1 / (1 + np.exp(-logit))) < 1e-5


def test_original_qwen3_reranker_scores_with_yes_no_logits(causal):
    """vLLM's overrides for Qwen3-Reranker: the score is softmax([logit(no), logit(yes)])
    of yes at the last token, as the model card computes it with transformers."""
    folder, hf = causal
    with LLM(folder, hf_overrides=ORIGINAL_RERANKER, **EAGER) as llm:  # runner chosen: pooling
        outs = llm.score(QUERY, DOCS)
        probs = llm.classify(["w20 w21 w22"])[0].outputs.probs
        assert len(probs) == 1
    for out in outs:
        with torch.no_grad():
            logits = hf(torch.tensor([out.prompt_token_ids])).logits[0, -1]
        yes = torch.softmax(logits[[5, 4]], dim=-1)[1].item()  # "no" is id 5, "yes" id 4
        assert abs(out.outputs.score - yes) < 1e-3
    with pytest.raises(ValueError, match="'temperature'"):
        EngineArgs(hf_overrides={**ORIGINAL_RERANKER, "temperature": 2})
    with pytest.raises(ValueError, match="classifier_from_token 'maybe' is not in the vocab"):
        LLM(folder, hf_overrides={**ORIGINAL_RERANKER, "classifier_from_token": ["no", "maybe"]},
            **EAGER)  # fmt: skip
    with pytest.raises(ValueError, match="runner='generate' cannot run"):
        LLM(folder, runner="generate", hf_overrides=ORIGINAL_RERANKER, **EAGER)


def test_decoder_mean_pooling_runs_on_the_dense_runner(causal, tmp_path):
    """Pooling other than the last token (here sentence-transformers' mean) needs every
    hidden state of an input: the dense pooling runner computes it."""
    folder, hf = causal
    import shutil

    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    save_sentence_transformers_files(str(tmp_path), "mean", normalize=True, max_seq_length=16,
                                     dim=TINY["hidden_size"])  # fmt: skip
    rng = np.random.default_rng(3)
    prompts = [rng.integers(6, VOCAB, n).tolist() for n in (3, 11, 16)]
    with LLM(str(tmp_path), runner="pooling", max_num_seqs=2, show_progress=False) as llm:
        assert isinstance(llm.engine.worker, PoolingRunner)
        ours = np.array([o.outputs.embedding for o in llm.embed(prompts)])
    for ids, got in zip(prompts, ours, strict=True):
        want = hidden_states(hf, ids).mean(axis=0)
        np.testing.assert_allclose(got, want / np.linalg.norm(want), atol=2e-5)


def test_hf_overrides_are_checked_by_name():
    arch = {"architectures": ["Qwen3ForSequenceClassification"]}
    assert EngineArgs(hf_overrides=json.dumps(ORIGINAL_RERANKER)).hf_overrides == ORIGINAL_RERANKER
    for bad, words in (
        ({"architectures": ["Qwen3ForCausalLM"]}, "one \\*ForSequenceClassification"),
        ({"classifier_from_token": ["no", "yes"]}, "need architectures"),
        ({**arch, "classifier_from_token": ["a", "b", "c"], "method": "from_2_way_softmax"},
         "needs two tokens"),
        ({**arch, "classifier_from_token": ["no", "yes"], "method": "mean"}, "method 'mean'"),
        ("[1, 2]", "must be a JSON object"),
        ("{", "not valid JSON"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=words):
            EngineArgs(hf_overrides=bad)
