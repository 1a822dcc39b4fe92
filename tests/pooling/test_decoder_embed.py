"""A decoder as an embedder (``runner="pooling"``, as Qwen3-Embedding): its last token's
final hidden state, normalised, equal to transformers' on a tiny random Qwen3; the rows'
right padding changes nothing (causal attention never reads it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from jaxpaged import LLM
from jaxpaged.engine.async_pooling import AsyncPoolingEngine

VOCAB = 96


def _tokenizer() -> transformers.PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i for i in range(4, VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                                pad_token="<pad>", eos_token="</s>")  # fmt: skip


def test_qwen3_last_token_embeddings_equal_transformers(tmp_path):
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        initializer_range=0.2, tie_word_embeddings=True,
    )  # fmt: skip
    hf = transformers.Qwen3ForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    _tokenizer().save_pretrained(tmp_path)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, VOCAB, n).tolist() for n in (3, 11, 7, 1, 16)]
    with LLM(str(tmp_path), runner="pooling", max_model_len=16, max_num_seqs=2,
             show_progress=False) as llm:  # fmt: skip
        ours = np.array([o.outputs.embedding for o in llm.embed(prompts)])
        assert llm.get_metrics()["num_compilations_after_warmup"] == 0
        served = AsyncPoolingEngine(llm.engine).engine_config  # what the server logs
        assert served["dtype"] == "float32" and served["pooling"] == "last"
    for ids, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            h = hf.model(torch.tensor([ids])).last_hidden_state[0, -1].numpy()
        np.testing.assert_allclose(got, h / np.linalg.norm(h), atol=2e-5)


def test_qwen3_sequence_classification_scores_equal_transformers(tmp_path):
    """A converted reranker (Qwen3ForSequenceClassification: the decoder body and a score
    head on the last token) pools by itself; its scores are transformers' logits through
    the sigmoid."""
    torch.manual_seed(1)
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        initializer_range=0.2, num_labels=1, pad_token_id=0,
    )  # fmt: skip
    hf = transformers.Qwen3ForSequenceClassification(config).eval()
    hf.save_pretrained(tmp_path)
    _tokenizer().save_pretrained(tmp_path)
    query, docs = "w5 w9", ["w11 w12 w13", "w40", "w7 w8 w9 w10 w11 w12", "w90 w91"]
    with LLM(str(tmp_path), max_model_len=16, max_num_seqs=2, show_progress=False) as llm:
        outs = llm.score(query, docs)
        with pytest.raises(ValueError, match="needs runner='generate'"):
            llm.generate(["w5"])
    for out, doc in zip(outs, docs, strict=True):
        ids = out.prompt_token_ids
        assert ids == llm.tokenizer(query, doc)["input_ids"]
        with torch.no_grad():
            logit = hf(torch.tensor([ids])).logits[0, 0].item()
        assert abs(out.outputs.score - 1 / (1 + np.exp(-logit))) < 1e-5
