"""Gemma 3 with images through the paged engine against transformers' generate on a tiny
random checkpoint, with the processor's outputs as transformers' inputs: greedy tokens of
image prompts batched with a text-only one, prefilled in chunks that split an image's
placeholders, with prefix caching on; a repeated image encoded once; two prompts that differ
only in the image share no block holding it; nothing compiles after warm-up.

transformers gets the processor's ``token_type_ids``: an image's tokens attend to each other
both ways, as in Gemma 3's own mask; the engine feeds each image in one prefill chunk."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from jaxpaged import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)


def _image(seed: int, size=(40, 52)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


def _hf_greedy(
    tiny_vl, text: str, images: list, max_new_tokens: int = 8
) -> tuple[list[int], list[int], np.ndarray]:
    """(prompt ids, greedy ids, log-probabilities [steps, V]) of transformers on the
    processor's outputs, token types included (an image's tokens see each other)."""
    p = tiny_vl.processor
    inputs = p(text=text, images=images or None, return_tensors="pt")
    kw = {}
    if images:
        kw = {"pixel_values": inputs["pixel_values"], "token_type_ids": inputs["token_type_ids"]}
        assert int(inputs["token_type_ids"].sum()) == 4 * len(images)
    with torch.no_grad():
        out = tiny_vl.hf.generate(
            input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], **kw,
            max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None,
            output_scores=True, return_dict_in_generate=True,
        )  # fmt: skip
    n = inputs["input_ids"].shape[1]
    logprobs = torch.log_softmax(torch.cat(out.scores).float(), -1).numpy()
    return inputs["input_ids"][0].tolist(), out.sequences[0, n:].tolist(), logprobs


@pytest.fixture(scope="module")
def llm(tiny_vl):
    engine = LLM(
        model=tiny_vl.folder, max_model_len=64, block_size=4, num_kv_blocks=40,
        max_num_seqs=4, max_num_batched_tokens=8, enable_prefix_caching=True,
        limit_mm_per_prompt={"image": 2}, encoder_cache_images=2,
    )  # fmt: skip
    yield engine
    engine.engine.close()


TEXT_1 = "<bos><start_of_turn>user w1 w2 <start_of_image> w4 w5<end_of_turn> <start_of_turn>model "
TEXT_2 = "<bos>w6 <start_of_image> w7 <start_of_image> w8 w9"
TEXT_ONLY = "<bos>w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20 w21"


def test_greedy_matches_transformers_batched_chunked_cached(tiny_vl, llm):
    a, b, c = _image(1), _image(2, (30, 20)), _image(3, (64, 64))
    cases = [(TEXT_1, [a]), (TEXT_2, [b, c]), (TEXT_ONLY, []), (TEXT_1, [b])]
    prompts = [{"prompt": t, "multi_modal_data": {"image": im}} if im else t for t, im in cases]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    # an 8-token first step would end inside the first prompt's image (positions 7..10):
    # the scheduler stops that chunk before the image and feeds the image whole in the next
    assert outs[0].prompt_token_ids.index(127) == 7
    for (text, images), out in zip(cases, outs, strict=True):
        ids, want, logprobs = _hf_greedy(tiny_vl, text, images)
        assert list(out.prompt_token_ids) == ids  # the processor's expansion
        assert list(out.outputs[0].token_ids) == want
        for got, ref in zip(out.outputs[0].logprobs, logprobs, strict=True):
            top = np.argsort(-ref)[:3]
            assert list(got.top) == top.tolist()
            np.testing.assert_allclose(list(got.top.values()), ref[top], atol=2e-4)
    # the same text with another image gives other tokens (the features reach the decoder)
    assert outs[0].outputs[0].token_ids != outs[3].outputs[0].token_ids
    images = llm.engine.runner.images
    assert images.num_encoded == 3  # image b, in two prompts of one batch, encoded once

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
    offset = outs[0].prompt_token_ids.index(127)  # the image's first placeholder
    assert hits_same == (n - 1) // 4 * 4
    assert hits_other == offset // 4 * 4 < hits_same
    assert again[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert list(other[0].outputs[0].token_ids) == _hf_greedy(tiny_vl, TEXT_1, [c])[1]
    assert list(again[0].outputs[0].token_ids) == list(outs[0].outputs[0].token_ids)
    assert llm.get_metrics()["num_compilations_after_warmup"] == 0


def test_bad_image_prompts_are_refused(llm):
    with pytest.raises(ValueError, match="2 image placeholder tokens|4 image placeholder"):
        llm.generate({"prompt": TEXT_1, "multi_modal_data": {"image": [_image(1)] * 2}})
    with pytest.raises(ValueError, match="more than the limit of 2"):
        llm.generate({"prompt": TEXT_2, "multi_modal_data": {"image": [_image(1)] * 3}})
    with pytest.raises(ValueError, match="4 image placeholder tokens for 0 images"):
        llm.generate({"prompt": TEXT_1})


def test_preempted_image_requests_recompute_exactly(tiny_vl, llm):
    """Four image prompts running to 40 tokens need 60 blocks of a 40-block pool: some are
    preempted and recomputed, their images taken from the encoder cache or encoded again."""
    before = llm.get_metrics()["num_preemptions"]
    cases = [(TEXT_1, [_image(10 + i)]) for i in range(3)] + [(TEXT_2, [_image(1), _image(2)])]
    prompts = [{"prompt": t, "multi_modal_data": {"image": im}} for t, im in cases]
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, long, use_tqdm=False)
    assert llm.get_metrics()["num_preemptions"] > before
    for (text, images), out in zip(cases, outs, strict=True):
        assert list(out.outputs[0].token_ids) == _hf_greedy(tiny_vl, text, images, 40)[1]
    assert llm.get_metrics()["num_compilations_after_warmup"] == 0


def test_new_weights_reencode_cached_images(tiny_vl, llm):
    """update_weights forgets the encoded images: an image encoded under the old weights
    gives transformers' tokens under the new ones (the projection negated)."""
    from jaxpaged.models import load_model

    prompt = {"prompt": TEXT_1, "multi_modal_data": {"image": _image(1)}}
    llm.generate(prompt, GREEDY, use_tqdm=False)  # image 1 is in the cache
    _, params = load_model(tiny_vl.folder, dtype="float32", progress=False)
    params["projector"]["proj"] = -params["projector"]["proj"]
    weight = tiny_vl.hf.model.multi_modal_projector.mm_input_projection_weight
    llm.update_weights(params)
    with torch.no_grad():
        weight.neg_()
    try:
        want = _hf_greedy(tiny_vl, TEXT_1, [_image(1)])[1]
    finally:
        with torch.no_grad():
            weight.neg_()
    assert list(llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == want


def test_encoder_cache_metrics(llm):
    """vLLM's mm_cache_queries / hits count each distinct image a step reads (each image
    here in one step: its chunk holds it whole), misses are encoded; an image evicts the
    least recently used only once the free slots (8: 6 a step may read + 2) are gone."""
    images = llm.engine.runner.images
    assert images.num_slots == 8

    def metrics():
        m = llm.get_metrics()
        return {k: m[k] for k in ("mm_cache_queries", "mm_cache_hits", "mm_cache_evictions")}

    llm.engine.runner.images.clear()  # a known start: every slot free
    # from here on: the count since (the last test's own -params compiled jit(negative))
    compiles = llm.get_metrics()["num_compilations_after_warmup"]
    before, seconds = metrics(), llm.get_metrics()["mm_encoder_seconds"]
    x, y = _image(50), _image(51)
    llm.generate({"prompt": TEXT_2, "multi_modal_data": {"image": [x, y]}}, GREEDY,
                 use_tqdm=False)  # fmt: skip
    first = metrics()
    assert first["mm_cache_queries"] - before["mm_cache_queries"] == 2
    assert first["mm_cache_hits"] == before["mm_cache_hits"]  # both encoded
    assert llm.get_metrics()["mm_encoder_seconds"] > seconds
    # the same images in the other order: no prefix shared past the first image, both hit
    llm.generate({"prompt": TEXT_2, "multi_modal_data": {"image": [y, x]}}, GREEDY,
                 use_tqdm=False)  # fmt: skip
    second = metrics()
    assert second["mm_cache_queries"] - first["mm_cache_queries"] == 2
    assert second["mm_cache_hits"] - first["mm_cache_hits"] == 2
    assert second["mm_cache_evictions"] == before["mm_cache_evictions"]
    # 8 new images, 6 free slots: the 2 least recently used (x, y) are evicted
    prompts = [{"prompt": TEXT_2, "multi_modal_data": {"image": [_image(60 + 2 * i),
                _image(61 + 2 * i)]}} for i in range(4)]  # fmt: skip
    llm.generate(prompts, GREEDY, use_tqdm=False)
    third = metrics()
    assert third["mm_cache_queries"] - second["mm_cache_queries"] == 8
    assert third["mm_cache_hits"] == second["mm_cache_hits"]
    assert third["mm_cache_evictions"] - second["mm_cache_evictions"] == 2
    assert llm.get_metrics()["num_compilations_after_warmup"] == compiles
