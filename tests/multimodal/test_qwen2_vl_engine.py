"""Qwen2.5-VL through the paged engine against transformers' generate on a tiny random
checkpoint, with the processor's outputs as transformers' inputs: greedy tokens of prompts
with one and two images of different sizes batched with a text-only one, prefilled in
chunks that split images, with prefix caching on; M-RoPE positions carried into decoding;
chat messages through the template; nothing compiles after warm-up."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from PIL import Image

from jaxpaged import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
IMAGE = 127
PAD = "<|vision_start|><|image_pad|><|vision_end|>"


def _image(seed: int, size=(45, 30)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def _hf_greedy(tiny, text: str, images: list, max_new_tokens: int = 8) -> tuple[list, list]:
    """(prompt ids, greedy ids) of transformers on the processor's outputs."""
    inputs = tiny.inputs(text, images)
    with torch.no_grad():
        out = tiny.hf.generate(
            **inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
            eos_token_id=None,
        )  # fmt: skip
    n = inputs["input_ids"].shape[1]
    return inputs["input_ids"][0].tolist(), out[0, n:].tolist()


@pytest.fixture(scope="module")
def llm(tiny_qwen_vl):
    engine = LLM(
        model=tiny_qwen_vl.folder, max_model_len=128, block_size=4, num_kv_blocks=120,
        max_num_seqs=4, max_num_batched_tokens=16, enable_prefix_caching=True,
        limit_mm_per_prompt={"image": 2}, encoder_cache_images=2,
    )  # fmt: skip
    yield engine
    engine.engine.close()


TEXT_1 = f"<|im_start|>user w1 w2 {PAD} w4 w5<|im_end|> <|im_start|>assistant "
TEXT_2 = f"<|im_start|>user w6 {PAD} w7 {PAD} w8 w9"
TEXT_ONLY = "<|im_start|>user w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20 w21"


def test_greedy_matches_transformers_batched_chunked_cached(tiny_qwen_vl, llm):
    # 24 tokens (4 x 6 merged, one window row of 3), 12 (6 x 2), 36 (6 x 6: 3 x 3 windows)
    a, b, c = _image(1), _image(2, (20, 44)), _image(3, (64, 64))
    cases = [(TEXT_1, [a]), (TEXT_2, [b, c]), (TEXT_ONLY, []), (TEXT_1, [b])]
    prompts = [{"prompt": t, "multi_modal_data": {"image": im}} if im else t for t, im in cases]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for (text, images), out in zip(cases, outs, strict=True):
        ids, want = _hf_greedy(tiny_qwen_vl, text, images)
        assert list(out.prompt_token_ids) == ids  # the processor's expansion
        assert list(out.outputs[0].token_ids) == want
    assert [outs[i].prompt_token_ids.count(IMAGE) for i in (0, 1, 3)] == [24, 48, 12]
    # the same text with another image gives other tokens (the features reach the decoder)
    assert outs[0].outputs[0].token_ids != outs[3].outputs[0].token_ids
    assert llm.engine.runner.images.num_encoded == 3  # image b, in two prompts, encoded once

    # the prefix cache: prompt 1 again hits up to its last full block; with image c in
    # place of a, only the blocks before the image's are shared
    before = llm.get_metrics()["prefix_cache_hits"]
    again = llm.generate([{"prompt": TEXT_1, "multi_modal_data": {"image": a}}], GREEDY,
                         use_tqdm=False)  # fmt: skip
    hits_same = llm.get_metrics()["prefix_cache_hits"] - before
    other = llm.generate([{"prompt": TEXT_1, "multi_modal_data": {"image": c}}], GREEDY,
                         use_tqdm=False)  # fmt: skip
    hits_other = llm.get_metrics()["prefix_cache_hits"] - before - hits_same
    n = len(outs[0].prompt_token_ids)
    offset = outs[0].prompt_token_ids.index(IMAGE)
    assert hits_same == (n - 1) // 4 * 4
    assert hits_other == offset // 4 * 4 < hits_same
    assert list(again[0].outputs[0].token_ids) == list(outs[0].outputs[0].token_ids)
    assert list(other[0].outputs[0].token_ids) == _hf_greedy(tiny_qwen_vl, TEXT_1, [c])[1]
    assert llm.get_metrics()["num_compilations_after_warmup"] == 0


def test_chat_and_refusals(tiny_qwen_vl, llm):
    image = _image(4, (33, 50))
    messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": "w3 w4"}]}]  # fmt: skip
    out = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    text = tiny_qwen_vl.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert list(out.outputs[0].token_ids) == _hf_greedy(tiny_qwen_vl, text, [image])[1]
    with pytest.raises(ValueError, match="image placeholder tokens for 2 images"):
        llm.generate({"prompt": TEXT_1, "multi_modal_data": {"image": [image] * 2}})
    with pytest.raises(ValueError, match="more than the limit of 2"):
        llm.generate({"prompt": TEXT_2, "multi_modal_data": {"image": [image] * 3}})
    assert llm.get_metrics()["num_compilations_after_warmup"] == 0


@pytest.mark.skipif(
    os.environ.get("JAXPAGED_TEST_FULL") != "1",
    reason="preemption with M-RoPE (its own engine, about a minute; Gemma 3 tests the shared "
    "machinery by default): "
    "JAXPAGED_TEST_FULL=1 runs it",
)
def test_preempted_requests_recompute_mrope_exactly(tiny_qwen_vl):
    """Four two-image prompts running to 64 tokens need 124 blocks of a 64-block pool:
    some are preempted and recomputed, their prompt and output tokens refed at their
    M-RoPE positions."""
    llm = LLM(
        model=tiny_qwen_vl.folder, max_model_len=128, block_size=4, num_kv_blocks=64,
        max_num_seqs=4, max_num_batched_tokens=16, limit_mm_per_prompt={"image": 2},
    )  # fmt: skip
    try:
        cases = [(TEXT_2, [_image(20 + i, (20, 44)), _image(30 + i, (64, 64))]) for i in range(4)]
        prompts = [{"prompt": t, "multi_modal_data": {"image": im}} for t, im in cases]
        long = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        outs = llm.generate(prompts, long, use_tqdm=False)
        assert llm.get_metrics()["num_preemptions"] > 0
        assert llm.get_metrics()["num_compilations_after_warmup"] == 0
    finally:
        llm.engine.close()
    for (text, images), out in zip(cases, outs, strict=True):
        assert list(out.outputs[0].token_ids) == _hf_greedy(tiny_qwen_vl, text, images, 64)[1]


def test_openai_image_url_equals_offline_chat(llm):
    """The real ``openai`` client sends a PNG data URL to a server over the same engine
    and gets the text offline ``LLM.chat`` gives (last: the server takes the engine over)."""
    import base64
    import io

    import openai
    from harness import ServerThread

    from jaxpaged.engine.async_engine import AsyncEngine

    buf = io.BytesIO()
    _image(5, (40, 24)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    chat = [{"role": "user", "content": [{"type": "text", "text": "w1"},
                                         {"type": "image_url", "image_url": {"url": url}}]}]  # fmt: skip
    ref = llm.chat(chat, GREEDY, use_tqdm=False)[0]
    server = ServerThread(AsyncEngine(llm.engine), served_model_name="tiny-qwen-vl")
    try:
        client = openai.OpenAI(base_url=server.http + "/v1", api_key="x", max_retries=0)
        reply = client.chat.completions.create(
            model="tiny-qwen-vl", messages=chat, max_tokens=8, temperature=0.0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
    finally:
        server.stop()
    assert reply.choices[0].message.content == ref.outputs[0].text
    assert reply.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert ref.prompt_token_ids.count(IMAGE) == 15  # 40 x 24: 5 x 3 merged
