"""Decoder checkpoints saved as transformers' ``*ForSequenceClassification`` (the decoder
family's body under ``model.*`` and a ``score`` linear [num_labels, D] without bias on the
last token's final hidden state), the form converted rerankers ship in (Qwen3-Reranker as
``Qwen3ForSequenceClassification``, its one label the "yes" row of the vocabulary less the
"no" row). The body is the decoder family's own (its ``*ForCausalLM`` architecture); these
architectures are not in the family registry, whose model types are the decoder
families': the pooling engine loads them through `load_decoder_classifier`."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig
from .loader import DTYPES, load_host_params, put_on_device
from .registry import ARCHITECTURES, parse_config
from .safetensors_index import SafetensorsIndex, TensorError, safetensors_files
from .types import Params

SUFFIX = "ForSequenceClassification"


def is_decoder_classifier(d: Mapping[str, Any]) -> bool:
    """Whether a config.json is a decoder's ``*ForSequenceClassification`` (one jaxpaged
    runs as a ``*ForCausalLM`` body)."""
    archs = d.get("architectures") or ()
    if not archs or not archs[0].endswith(SUFFIX) or archs[0] in ARCHITECTURES:
        return False
    return archs[0].removesuffix(SUFFIX) + "ForCausalLM" in ARCHITECTURES


def num_labels_of(d: Mapping[str, Any]) -> int:
    return int(d.get("num_labels") or len(d.get("id2label") or {}) or 2)


def load_decoder_classifier(
    folder: str, *, dtype: str | None = None, progress: bool = False
) -> tuple[ModelConfig, Params, jax.Array, int]:
    """(config of the decoder body, its params on the device, the score head [C, D] on the
    device, C) of a ``*ForSequenceClassification`` folder; ValueError naming what does not
    fit."""
    with open(os.path.join(folder, "config.json")) as f:
        d = json.load(f)
    if not is_decoder_classifier(d):
        raise ValueError(f"{folder!r} is not a decoder *ForSequenceClassification checkpoint")
    causal = {
        **d,
        "architectures": [d["architectures"][0].removesuffix(SUFFIX) + "ForCausalLM"],
        "tie_word_embeddings": True,  # the body only: no vocabulary projection to read
    }
    config = parse_config(causal)
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    np_dtype = np.dtype(DTYPES[dtype or "float32"])
    host = load_host_params(folder, config, np_dtype, progress=progress)
    n = num_labels_of(d)
    st = SafetensorsIndex(safetensors_files(folder))
    want = (n, config.hidden_size)
    if "score.weight" not in st or st.shape("score.weight") != want:
        raise TensorError(f"checkpoint {folder!r} needs a score.weight of shape {want}")
    head = jnp.asarray(np.asarray(st.get("score.weight"), dtype=np_dtype))
    return config, put_on_device(host), head, n


def vocab_rows_head(
    folder: str,
    token_ids: Sequence[int],
    *,
    two_way: bool,
) -> np.ndarray:  # float32 [C, D]
    """A classifier head made of the language-model head's rows of ``token_ids`` (the
    embeddings' when the checkpoint ties them), as vLLM's ``classifier_from_token``:
    ``two_way`` (from_2_way_softmax) gives one row, the second token's less the first's,
    whose sigmoid is the second token's softmax probability against the first."""
    st = SafetensorsIndex(safetensors_files(folder))
    name = "lm_head.weight" if "lm_head.weight" in st else "model.embed_tokens.weight"
    if name not in st:
        raise TensorError(f"checkpoint {folder!r} has neither lm_head.weight nor embeddings")
    weight = st.get(name)  # [V, D]
    for t in token_ids:
        if not 0 <= t < weight.shape[0]:
            raise ValueError(f"classifier token id {t} is outside the vocabulary")
    rows = np.asarray(weight[list(token_ids)], dtype=np.float32)  # [len, D]
    return rows[1:2] - rows[0:1] if two_way else rows
