"""Speculative decoding with LoRA adapters, every method, on a tiny random model: the target
runs each request's adapter and verifies; the drafter (n-gram lookup, a draft model, an
EAGLE-3 head reading the adapted target's hidden states) drafts without adapters. A request
with an adapter and one without, batched, must give the greedy tokens of an engine without
speculation (an adapter's and the base model's, which differ), and the adapter
request must have drafts accepted (a step emitting more than one token), so the test fails
if speculation silently turned off for it. The adapter is a PEFT folder written here
(adapter_config.json + adapter_model.safetensors) with small random weights: it changes the
output, and the unadapted drafters still agree with it often enough to be accepted."""

from __future__ import annotations

import dataclasses
import json
import os
from collections import Counter

import numpy as np
import pytest
from eagle3_heads import write_eagle3_head
from safetensors.numpy import save_file

from jaxpaged import LoRARequest, SamplingParams
from jaxpaged.config import CacheConfig, LoraConfig, SchedulerConfig
from jaxpaged.engine import LLMEngine
from jaxpaged.models.lora import lora_layout
from jaxpaged.models.testing import random_params, tiny_config
from jaxpaged.spec import SpeculativeConfig

CONFIG = tiny_config()
K = 3
MAX_TOKENS = 16
SCHED = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
             max_prefill_tokens_with_decodes=32)  # fmt: skip
PROMPT = [5, 17, 40, 9, 61, 8, 12, 70, 3, 5, 17, 40]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _write_adapter(path, *, rank: int = 4, std: float = 0.15, seed: int = 7) -> None:
    """A PEFT LoRA folder targeting every linear of every layer, lora_A and lora_B random."""
    rng = np.random.default_rng(seed)
    layout = lora_layout(CONFIG)
    tensors = {}
    for i in range(CONFIG.num_layers):
        for name, m in layout.modules.items():
            key = f"base_model.model.{layout.layer_prefix.format(i)}{name}"
            a = rng.normal(0, std, (rank, m.in_features)).astype(np.float32)
            b = rng.normal(0, std, (m.out_features, rank)).astype(np.float32)
            tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b
    path.mkdir(parents=True, exist_ok=True)
    modules = sorted({n.rpartition(".")[2] for n in layout.modules})
    cfg = dict(peft_type="LORA", r=rank, lora_alpha=2 * rank, target_modules=modules)
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(path / "adapter_model.safetensors"))


def _engine(params, **kw) -> LLMEngine:
    return LLMEngine(
        model_config=CONFIG,
        params=params,
        tokenizer=None,
        scheduler_config=SchedulerConfig(**SCHED),
        cache_config=CacheConfig(block_size=8, num_kv_blocks=32),
        lora_config=LoraConfig(enable_lora=True, max_loras=1, max_lora_rank=4),
        enforce_eager=True,
        show_progress=False,
        **kw,
    )


def _run(engine: LLMEngine, lora: LoRARequest, speculative: bool):
    """Greedy tokens of (the adapter request, the plain one), run together, and the most
    tokens one step emitted for the adapter request."""
    params = dataclasses.replace(GREEDY, speculative=speculative)
    engine.add_request("a", PROMPT, params, lora_request=lora)
    engine.add_request("b", PROMPT, params)
    tokens, most = {"a": [], "b": []}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            new = out.outputs[0].token_ids
            tokens[out.request_id] += new
            if out.request_id == "a":
                most = max(most, len(new))
    pool = engine.scheduler.pool
    assert pool.num_free_blocks == pool.num_blocks
    return tokens["a"], tokens["b"], most


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    params = random_params(CONFIG, seed=1)
    adapter = tmp_path_factory.mktemp("lora") / "adapter"
    _write_adapter(adapter)
    return params, LoRARequest("ad", 1, str(adapter)), tmp_path_factory.mktemp("eagle3")


def _spec_engine(method: str, params, head_dir, adapted: list[int]) -> LLMEngine:
    spec = dict(num_speculative_tokens=K, disable_by_batch_size=8)
    if method == "ngram":
        cfg = SpeculativeConfig(method="ngram", prompt_lookup_min=1, prompt_lookup_max=3, **spec)
        return _engine(params, speculative_config=cfg)
    if method == "draft_model":  # the target's own weights, without the adapter
        cfg = SpeculativeConfig(method="draft_model", model="in-memory", **spec)
        return _engine(params, speculative_config=cfg, draft=(CONFIG, params))
    from jaxpaged.models.eagle3 import load_eagle3

    # a head whose draft vocabulary is the adapted output's two commonest tokens: a random
    # head drafts one of them, often enough right to be accepted
    keep = [t for t, _ in Counter(adapted).most_common(2)]
    write_eagle3_head(head_dir, target=CONFIG, aux=(1, 0, 1), keep=keep)
    cfg = SpeculativeConfig(method="eagle3", model=str(head_dir), **spec)
    return _engine(params, speculative_config=cfg, eagle=load_eagle3(str(head_dir)))


@pytest.fixture(scope="module")
def reference(setup):
    """Greedy tokens without speculation (a plain LoRA engine): the adapter's, the base's."""
    params, lora, _ = setup
    engine = _engine(params)
    try:
        a, b, most = _run(engine, lora, speculative=False)
    finally:
        engine.close()
    assert most == 1
    assert a != b, "the adapter changes nothing: the test would not see it dropped"
    return a, b


_FULL = os.environ.get("JAXPAGED_TEST_FULL") == "1"


# the draft model is the case that needs its own runner to leave adapters out; n-gram and
# EAGLE-3 draft without any LoRA input (~25 s of compiling each on a cold cache: FULL only)
@pytest.mark.parametrize(
    "method",
    [
        pytest.param(m, marks=pytest.mark.skipif(not _FULL, reason="JAXPAGED_TEST_FULL=1 runs it"))
        if m != "draft_model"
        else m
        for m in ("ngram", "draft_model", "eagle3")
    ],
)
def test_lora_requests_speculate_exactly(setup, reference, method):
    params, lora, head_dir = setup
    engine = _spec_engine(method, params, head_dir, reference[0])
    try:
        got = _run(engine, lora, speculative=True)
    finally:
        engine.close()
    assert got[:2] == reference
    assert got[2] > 1, f"{method}: no draft of the adapter request was accepted"
