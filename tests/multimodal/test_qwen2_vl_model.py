"""Qwen2.5-VL against transformers on a tiny random checkpoint: the numpy image processor
(patches and grids of images of several sizes and modes), the windowed vision tower's
features of images packed together, and the decoder's logits with M-RoPE positions and the
features in place of the image placeholders."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
import torch
from PIL import Image

from jaxpaged.engine.patch_images import image_spec_for_folder, preprocess_patches, smart_resize
from jaxpaged.models import load_model
from jaxpaged.models.qwen2_vl import Qwen2VLConfig, Qwen2VLForConditionalGeneration
from jaxpaged.models.qwen_vit import pack_images
from jaxpaged.models.registry import family_of


def _image(seed: int, size: tuple[int, int], mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    data = rng.integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)
    return Image.fromarray(data[..., 0] if channels == 1 else data, mode)


@pytest.fixture(scope="module")
def loaded(tiny_qwen_vl):
    config, params = load_model(tiny_qwen_vl.folder, dtype="float32", progress=False)
    # the processor's pixel bounds, mean and std, as the engine reads them
    config = dataclasses.replace(config, image=image_spec_for_folder(config.image, tiny_qwen_vl.folder))  # fmt: skip  # noqa: E501
    return config, Qwen2VLForConditionalGeneration.from_params(config, params)


def test_processor_matches_transformers(tiny_qwen_vl, loaded):
    config, _ = loaded
    spec = config.image
    # an image elongated to the aspect limit may pass max_pixels by up to sqrt(2304 * 200) / 8
    assert (spec.min_pixels, spec.max_pixels, spec.tokens_per_image) == (64, 2304, 85)
    # sizes that round, grow to min_pixels, shrink to max_pixels (the last one past it: its
    # short side stays one factor); alpha and grey modes
    images = [_image(1, (45, 30)), _image(2, (5, 7), "RGBA"), _image(3, (200, 90), "L"),
              _image(4, (17, 60)), _image(5, (1000, 6))]  # fmt: skip
    ref = tiny_qwen_vl.images(images=images, return_tensors="np")
    at = 0
    for image, grid in zip(images, ref["image_grid_thw"].tolist(), strict=True):
        patches, got_grid = preprocess_patches(image, spec)
        assert list(got_grid) == grid
        want = ref["pixel_values"][at : at + len(patches)]
        at += len(patches)
        np.testing.assert_allclose(patches, want, atol=1e-5)
    assert at == len(ref["pixel_values"])
    assert smart_resize(30, 45, 8, 64, 2304) == (32, 48)
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(1, 300, 8, 64, 2304)


def test_features_and_logits_match_transformers(tiny_qwen_vl, loaded):
    config, module = loaded
    assert isinstance(config, Qwen2VLConfig) and family_of(config).name == "qwen2_vl"
    a, b = _image(5, (45, 30)), _image(6, (20, 44))
    text = "<|im_start|>user w1 <|vision_start|><|image_pad|><|vision_end|> w2 w3 " \
           "<|vision_start|><|image_pad|><|vision_end|> w4 w5"  # fmt: skip
    inputs = tiny_qwen_vl.inputs(text, [a, b])
    grids = [tuple(g) for g in inputs["image_grid_thw"].tolist()]
    # the tower, both images packed into one input with padding
    pre = [preprocess_patches(im, config.image) for im in (a, b)]
    packed = pack_images(pre, 256, config.vision)
    got = np.asarray(jax.jit(module.encode_patches)(*packed[:4]))
    with torch.no_grad():
        hf = tiny_qwen_vl.hf.model.get_image_features(
            inputs["pixel_values"], inputs["image_grid_thw"]
        ).pooler_output
    feats = []
    for i, want in enumerate(hf):
        rows = np.flatnonzero(packed.image_of == i)
        mine = np.zeros(want.shape, np.float32)
        mine[packed.order[rows]] = got[rows]  # the window order undone
        assert np.abs(mine - want.numpy()).max() / np.abs(want.numpy()).max() < 1e-5
        feats.append(mine)

    # the decoder with M-RoPE positions and the features at the placeholders
    from jaxpaged.models.qwen2_vl import mrope_positions

    ids = inputs["input_ids"][0].numpy()
    mask = ids == config.image.image_token_id
    rows = np.zeros((len(ids), 64), np.float32)
    rows[mask] = np.concatenate(feats)
    starts = [int(np.flatnonzero(mask)[0]), int(np.flatnonzero(mask)[-1]) + 1 - len(feats[1])]
    images = [
        (s, len(f), g[1] // 2, g[2] // 2) for s, f, g in zip(starts, feats, grids, strict=True)
    ]
    pos3 = mrope_positions(np.arange(len(ids)), images)
    with torch.no_grad():
        want_pos, _ = tiny_qwen_vl.hf.model.get_rope_index(
            inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"]
        )
    np.testing.assert_array_equal(pos3, want_pos[:, 0].numpy())
    hidden, _ = module(
        ids.astype(np.int32), np.arange(len(ids), dtype=np.int32), mrope_positions=pos3,
        image_embeds=(rows, mask),
    )  # fmt: skip
    logits = np.asarray(module.compute_logits(hidden))
    with torch.no_grad():
        ref = tiny_qwen_vl.hf(**inputs).logits[0].numpy()
    assert np.abs(logits - ref).max() / np.abs(ref).max() < 1e-4


# Qwen2.5-VL-3B-Instruct's config.json as Qwen published it (flat text fields, "mrope")
PUBLISHED = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
    "bos_token_id": 151643, "eos_token_id": 151645, "image_token_id": 151655,
    "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 11008,
    "max_position_embeddings": 128000, "num_attention_heads": 16, "num_hidden_layers": 36,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "use_sliding_window": False, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "vocab_size": 151936,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {
        "depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
        "num_heads": 16, "in_chans": 3, "out_hidden_size": 2048, "patch_size": 14,
        "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
        "temporal_patch_size": 2,
    },
}  # fmt: skip


def test_published_config_and_processor_settings(tmp_path):
    import json

    from jaxpaged.models.qwen2_vl import parse_config

    c = parse_config(PUBLISHED)
    assert (c.head_dim, c.num_kv_heads, c.qkv_bias, c.sliding_window) == (128, 2, True, None)
    assert c.mrope_section == (16, 24, 24) and c.rope_theta == 1e6 and c.tie_word_embeddings
    assert c.vision.merger_window == 4 and c.vision.fullatt_block_indexes == (7, 15, 23, 31)
    assert (c.image.image_token_id, c.image.tokens_per_image) == (151655, 1280)
    with pytest.raises(ValueError, match="mrope_section \\[16, 24\\] must be three sizes"):
        parse_config({**PUBLISHED, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24]}})
    with pytest.raises(ValueError, match="rope type 'yarn'"):
        parse_config({**PUBLISHED, "rope_scaling": {"type": "yarn", "factor": 2.0}})

    # Qwen's preprocessor_config.json: min/max pixels; a setting not reproduced is refused
    settings = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "merge_size": 2,
                "temporal_patch_size": 2, "resample": 3}  # fmt: skip
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(settings))
    spec = image_spec_for_folder(c.image, tmp_path)
    assert (spec.min_pixels, spec.tokens_per_image, spec.min_tokens_per_image) == (3136, 16384, 4)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**settings, "resample": 2}))
    with pytest.raises(ValueError, match="only bicubic"):
        image_spec_for_folder(c.image, tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**settings, "patch_size": 16}))
    with pytest.raises(ValueError, match="patch_size 16 differs"):
        image_spec_for_folder(c.image, tmp_path)
