"""Gemma 3 with images against transformers on a tiny random checkpoint: the vision tower
and projector's features, and the decoder's logits with those features in place of the
image placeholders."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jaxpaged.models import load_model
from jaxpaged.models.gemma3_vl import Gemma3ForConditionalGeneration, Gemma3VLConfig
from jaxpaged.models.registry import family_of


def _pixels(n: int, seed: int = 0) -> np.ndarray:  # float32 [N, 3, 32, 32] in [-1, 1]
    return np.random.default_rng(seed).uniform(-1, 1, (n, 3, 32, 32)).astype(np.float32)


def test_features_and_logits_match_transformers(tiny_vl):
    config, params = load_model(tiny_vl.folder, dtype="float32", progress=False)
    assert isinstance(config, Gemma3VLConfig) and family_of(config).name == "gemma3_vl"
    module = Gemma3ForConditionalGeneration.from_params(config, params)
    pixels = _pixels(2)
    got = np.asarray(jax.jit(module.encode_images)(jnp.asarray(pixels)))
    with torch.no_grad():
        want = tiny_vl.hf.model.get_image_features(torch.tensor(pixels)).pooler_output.numpy()
    assert got.shape == want.shape == (2, 4, 64)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-5

    # the decoder with the features at the placeholders: the image's tokens see each other
    # (transformers with token_type_ids), then the same without that (plain causal)
    ids = np.array([2, 4, 7, 6, 125, 127, 127, 127, 127, 126, 6, 11, 12, 5, 4, 8])
    mask = ids == config.image.image_token_id
    feats = np.zeros((len(ids), 64), np.float32)
    feats[mask] = got[0]
    hidden, _ = module(
        jnp.asarray(ids, jnp.int32), jnp.arange(len(ids), dtype=jnp.int32),
        image_embeds=(jnp.asarray(feats), jnp.asarray(mask)),
    )  # fmt: skip
    logits = np.asarray(module.compute_logits(hidden))
    with torch.no_grad():
        ref = (
            tiny_vl.hf(
                input_ids=torch.tensor(ids[None]),
                pixel_values=torch.tensor(pixels[:1]),
                token_type_ids=torch.tensor(mask[None].astype(np.int64)),
            )
            .logits[0]
            .numpy()
        )
    assert np.abs(logits - ref).max() / np.abs(ref).max() < 1e-4
    with torch.no_grad():  # causal over the image: other logits (the spans matter here)
        causal = tiny_vl.hf(input_ids=torch.tensor(ids[None]),
                            pixel_values=torch.tensor(pixels[:1])).logits[0].numpy()  # fmt: skip
    assert np.abs(causal - ref).max() / np.abs(ref).max() > 1e-2
