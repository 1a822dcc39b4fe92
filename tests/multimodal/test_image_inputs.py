"""The serving side's image handling without a model: pixels as transformers' Gemma 3
image processor makes them, data URLs and their bounds, the prompt's placeholders, and the
images-per-prompt setting."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import transformers
from PIL import Image

from jaxpaged.args import EngineArgs
from jaxpaged.engine.images import ImagePrompts, chat_images, decode_data_url, preprocess
from jaxpaged.models.image_spec import ImageSpec

SPEC = ImageSpec(size=32, mean=(0.5, 0.4, 0.3), std=(0.2, 0.3, 0.4), tokens_per_image=4,
                 image_token_id=127)  # fmt: skip


@pytest.mark.parametrize("mode,size", [("RGB", (50, 37)), ("RGBA", (20, 20)), ("L", (64, 96))])
def test_pixels_match_transformers_processor(mode, size):
    rng = np.random.default_rng(0)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    data = rng.integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)
    image = Image.fromarray(data.squeeze(-1) if channels == 1 else data, mode)
    processor = transformers.Gemma3ImageProcessorPil(
        size={"height": 32, "width": 32}, image_mean=list(SPEC.mean), image_std=list(SPEC.std)
    )
    want = processor(images=[image], return_tensors="np")["pixel_values"][0]
    got = preprocess(image, SPEC)
    assert got.shape == want.shape == (3, 32, 32) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_data_url_bounds():
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    assert decode_data_url(url).size == (8, 8)
    with pytest.raises(ValueError, match="larger than 16 bytes"):
        decode_data_url(url, max_bytes=16)
    with pytest.raises(ValueError, match="url must be a string"):
        decode_data_url(None)
    # http(s) URLs are fetched only through a fetcher the server configures
    with pytest.raises(ValueError, match="fetching http\\(s\\) images is disabled"):
        chat_images([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}])  # fmt: skip


def test_placeholders_located_and_checked():
    prompts = ImagePrompts(SPEC, limit=2)
    assert prompts.expand("a <start_of_image> b") == (
        "a \n\n<start_of_image>" + "<image_soft_token>" * 4 + "<end_of_image>\n\n b"
    )
    image = Image.new("RGB", (4, 4))
    items = prompts.images([1, 127, 127, 127, 127, 2, 127, 127, 127, 127], [image, image])
    assert [(i.offset, i.length) for i in items] == [(1, 4), (6, 4)]
    assert items[0].content_hash == items[1].content_hash  # the same pixels
    with pytest.raises(ValueError, match="not contiguous"):
        prompts.images([127, 127, 1, 127, 127], [image])
    with pytest.raises(ValueError, match="more than the limit of 2"):
        prompts.images([], [image] * 3)


def test_limit_mm_per_prompt_forms():
    assert EngineArgs(limit_mm_per_prompt='{"image": 3}').limit_mm_per_prompt == 3
    assert EngineArgs(limit_mm_per_prompt="5").limit_mm_per_prompt == 5
    for bad, why in (({"video": 1}, "only 'image'"), (0, ">= 1"), ("x", "neither N nor JSON")):
        with pytest.raises(ValueError, match=why):
            EngineArgs(limit_mm_per_prompt=bad)


def test_processor_config_read_or_refused(tmp_path):
    import json

    from jaxpaged.engine.images import image_spec_from_folder

    config = {"size": {"height": 32, "width": 32}, "image_mean": [0.1, 0.2, 0.3],
              "image_std": [0.4, 0.5, 0.6], "rescale_factor": 0.5, "resample": 2}  # fmt: skip
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    spec = image_spec_from_folder(SPEC, tmp_path)
    assert (spec.mean, spec.std, spec.rescale) == ((0.1, 0.2, 0.3), (0.4, 0.5, 0.6), 0.5)
    for bad, why in (({"resample": 3}, "bilinear"), ({"size": {"height": 64, "width": 64}},
                     "differs from the vision tower"), ({"do_pan_and_scan": True}, "pan_and_scan")):  # fmt: skip
        (tmp_path / "preprocessor_config.json").write_text(json.dumps({**config, **bad}))
        with pytest.raises(ValueError, match=why):
            image_spec_from_folder(SPEC, tmp_path)
