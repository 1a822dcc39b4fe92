"""transformers' reference for the real-model serving tests (loaded once per process)."""

from __future__ import annotations

import functools

import numpy as np
import pytest


@functools.cache
def _hf_model(model_path: str):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def hf_prompt_logprobs(model_path: str, ids: list[int]) -> np.ndarray:
    """transformers' float32 log-probability of each prompt token after the first."""
    torch = pytest.importorskip("torch")
    hf = _hf_model(model_path)
    with torch.no_grad():
        logp = hf(torch.tensor([ids])).logits[0].log_softmax(-1).numpy()
    return logp[np.arange(len(ids) - 1), ids[1:]]
