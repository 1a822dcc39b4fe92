"""Tiny random-weight encoders saved by transformers (with a WordPiece tokenizer over
made-up words), and sentence-transformers' files for their pooling."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import transformers

WORDS = 200  # made-up words w0..w199 after the five special tokens
VOCAB = WORDS + 5
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    initializer_range=0.2,
)


def tokenizer(folder: str) -> transformers.PreTrainedTokenizerFast:
    """A BERT WordPiece tokenizer over [PAD] [UNK] [CLS] [SEP] [MASK] w0 .. w199."""
    path = os.path.join(folder, "vocab.txt")
    with open(path, "w") as f:
        f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
                          + [f"w{i}" for i in range(WORDS)]) + "\n")  # fmt: skip
    return transformers.BertTokenizerFast(vocab_file=path, model_max_length=512)


def save_encoder(folder: str, kind: str, *, seed: int = 0, **config: Any) -> torch.nn.Module:
    """Saves a random transformers model of ``kind`` (a transformers class name, e.g.
    "BertModel", "RobertaForSequenceClassification") with its tokenizer into ``folder``;
    returns the model (eval mode)."""
    torch.manual_seed(seed)
    roberta = kind.startswith(("Roberta", "XLMRoberta"))
    conf_cls = transformers.XLMRobertaConfig if kind.startswith("XLM") else (
        transformers.RobertaConfig if roberta else transformers.BertConfig
    )  # fmt: skip
    fields = dict(TINY)
    if roberta:  # positions from pad_token_id + 1, one token type
        fields.update(pad_token_id=1, max_position_embeddings=66, type_vocab_size=1)
    else:
        fields.update(max_position_embeddings=64)
    fields.update(config)
    model = getattr(transformers, kind)(conf_cls(**fields)).eval()
    model.save_pretrained(folder)
    tokenizer(folder).save_pretrained(folder)
    return model


def save_sentence_transformers_files(
    folder: str, mode: str, *, normalize: bool, max_seq_length: int, dim: int
) -> None:
    """modules.json (Transformer, Pooling, and Normalize if asked), 1_Pooling/config.json
    and sentence_bert_config.json, as sentence-transformers saves them."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]  # fmt: skip
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})  # fmt: skip
    with open(os.path.join(folder, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(folder, "1_Pooling"), exist_ok=True)
    pooling = {
        "word_embedding_dimension": dim,
        "pooling_mode_cls_token": mode == "cls",
        "pooling_mode_mean_tokens": mode == "mean",
        "pooling_mode_max_tokens": mode == "max",
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_lasttoken": mode == "last",
    }
    with open(os.path.join(folder, "1_Pooling", "config.json"), "w") as f:
        json.dump(pooling, f)
    with open(os.path.join(folder, "sentence_bert_config.json"), "w") as f:
        json.dump({"max_seq_length": max_seq_length, "do_lower_case": False}, f)


def texts(n: int, seed: int = 0, longest: int = 20) -> list[str]:
    """``n`` sentences of made-up words, of varied lengths."""
    import random

    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(WORDS)}" for _ in range(rng.randint(1, longest)))
            for _ in range(n)]  # fmt: skip
