"""Speculative decoding on the bundled SmolLM2 (float32): greedy chat replies that copy their
prompt's text are token-identical with and without n-gram drafts, and with the model's own
4-bit GGUF drafting for it; a stop string inside an accepted run ends the text and the tokens
where it does without drafts, and drafts are accepted. Engines are eager (compiled on first
use): this module proves identity on a real model; compile counting is test_spec_decode's
and test_spec_draft's."""

from __future__ import annotations

import os

import pytest

from jaxpaged import LLM, SamplingParams

# two SmolLM2 engines cost ~40 s of the default suite's 15 minutes; tests/engine/
# test_spec_decode.py proves the same identity on a tiny model in every scheduling mode
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("JAXPAGED_TEST_FULL") != "1",
        reason="greedy identity on the bundled SmolLM2 (~40 s): JAXPAGED_TEST_FULL=1 runs it",
    ),
]

TEXT = (
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun while the fox "
    "runs into the forest, where the trees are tall and the river is cold."
)
ASKS = [
    f"Repeat this text exactly, word for word: {TEXT}",
    f"Rewrite this text with 'fox' replaced by 'cat': {TEXT}",
    "Write the numbers from one to twenty in words, separated by commas.",
]
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
        "prompt_lookup_max": 4, "disable_by_batch_size": 8}  # fmt: skip


KW = dict(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=128,
          enforce_eager=True, show_progress=False, num_kv_blocks=64)  # fmt: skip


def _chats_and_params():
    chats = [[{"role": "user", "content": a}] for a in ASKS]
    params = [
        SamplingParams(temperature=0, max_tokens=48),
        SamplingParams(temperature=0, max_tokens=48, stop=["forest"]),
        SamplingParams(temperature=0, max_tokens=40),
    ]
    return chats, params


def _assert_same(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        assert list(g.outputs[0].token_ids) == list(w.outputs[0].token_ids)
        assert g.outputs[0].text == w.outputs[0].text
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason


@pytest.fixture(scope="module")
def engines(bundled_model_path):
    kw = KW
    plain = LLM(bundled_model_path, **kw)
    spec = LLM(bundled_model_path, speculative_config=SPEC, **kw)
    yield plain, spec
    plain.close()
    spec.close()


def test_greedy_identical_on_smollm2(engines):
    plain, spec = engines
    chats, params = _chats_and_params()
    want = plain.chat(chats, params)
    _assert_same(spec.chat(chats, params), want)
    assert want[1].outputs[0].finish_reason == "stop"  # the stop string was met
    m = spec.get_metrics()
    assert m["spec_decode_num_accepted_tokens"] > 0
    pool = spec.engine.scheduler.pool
    assert pool.num_free_blocks == pool.num_blocks


@pytest.mark.skipif(
    os.environ.get("JAXPAGED_TEST_FULL") != "1",
    reason="a third SmolLM2 engine (~30 s); the default suite covers draft models on a tiny "
    "model (test_spec_draft.py); JAXPAGED_TEST_FULL=1 runs it",
)
def test_quantized_self_draft_on_smollm2(engines, bundled_model_path):
    """The bundled Q4_1 GGUF, kept 4-bit, drafts for the float32 model it came from."""
    from jaxpaged.models.bundled import bundled_gguf_path

    plain, _ = engines
    spec = {"model": str(bundled_gguf_path()), "quantization": "gguf",
            "num_speculative_tokens": 3, "disable_by_batch_size": 8}  # fmt: skip
    draft = LLM(bundled_model_path, speculative_config=spec, **KW)
    try:
        chats, params = _chats_and_params()
        _assert_same(draft.chat(chats, params), plain.chat(chats, params))
        m = draft.get_metrics()
        assert m["spec_decode_acceptance_rate"] > 0.5  # the same model, 4-bit: mostly agrees
        pool = draft.engine.scheduler.pool
        assert pool.num_free_blocks == pool.num_blocks
    finally:
        draft.close()


@pytest.mark.skipif(
    os.environ.get("JAXPAGED_TEST_FULL") != "1",
    reason="another SmolLM2 engine (~30 s); JAXPAGED_TEST_FULL=1 runs it",
)
def test_random_eagle3_head_on_smollm2(engines, bundled_model_path, tmp_path):
    """A random EAGLE-3 head of SmolLM2's shape, with vLLM's default aux layers (2, 15, 27):
    the replies are the model's own, token for token."""
    from test_spec_eagle3 import _write_head

    from jaxpaged.models.config import ModelConfig
    from jaxpaged.models.registry import load_config

    plain, _ = engines
    target: ModelConfig = load_config(bundled_model_path)
    _write_head(tmp_path, target=target, aux=None, num_heads=target.num_heads)
    spec = {"method": "eagle3", "model": str(tmp_path), "num_speculative_tokens": 3,
            "disable_by_batch_size": 8}  # fmt: skip
    eagle = LLM(bundled_model_path, speculative_config=spec, **KW)
    try:
        chats, params = _chats_and_params()
        _assert_same(eagle.chat(chats, params), plain.chat(chats, params))
        assert eagle.get_metrics()["spec_decode_num_draft_tokens"] > 0
    finally:
        eagle.close()
