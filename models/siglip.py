"""The SigLIP vision encoder (as transformers' ``SiglipVisionModel`` without its pooling
head) over a params tree, pure jnp so it traces inside one jitted encoder program.

An image of ``image_size`` squared pixels is cut into ``patch_size`` squared patches (the
patch convolution is a matmul over each patch's flattened (channel, row, column) pixels),
learned position embeddings are added, and the encoder layers run pre-norm, non-causal
multi-head attention and a GELU-tanh MLP, with biases everywhere, as transformers does in
float32 softmax. The layers are stacked on a leading L axis and scanned.

    {"patch_w": [D, C * p * p], "patch_b": [D], "pos": [P, D],
     "layers": {"ln1_w", "ln1_b", "ln2_w", "ln2_b": [L, D],
                "wqkv": [L, 3, D, D], "bqkv": [L, 3, D], "wo": [L, D, D], "bo": [L, D],
                "fc1_w": [L, F, D], "fc1_b": [L, F], "fc2_w": [L, D, F], "fc2_b": [L, D]},
     "post_ln_w", "post_ln_b": [D]}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .layers import layer_norm
from .types import TensorReader

_ACTS = ("gelu_pytorch_tanh", "gelu_new", "gelu")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SiglipConfig:
    """A SigLIP vision tower's shape (config.json's ``vision_config``)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side**2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def parse_siglip_config(d: Mapping[str, Any]) -> SiglipConfig:
    """The SiglipConfig of a ``vision_config`` dict; ValueError naming an option jaxpaged
    does not run."""
    if d.get("vision_use_head", False):
        raise ValueError("unsupported vision_config option vision_use_head=True")
    act = d.get("hidden_act", "gelu_pytorch_tanh")
    if act not in _ACTS:
        raise ValueError(f"unsupported vision_config hidden_act {act!r}; supported: {_ACTS}")
    c = SiglipConfig(
        hidden_size=int(d.get("hidden_size", 768)),
        intermediate_size=int(d.get("intermediate_size", 3072)),
        num_layers=int(d.get("num_hidden_layers", 12)),
        num_heads=int(d.get("num_attention_heads", 12)),
        image_size=int(d.get("image_size", 224)),
        patch_size=int(d.get("patch_size", 16)),
        num_channels=int(d.get("num_channels", 3)),
        layer_norm_eps=float(d.get("layer_norm_eps", 1e-6)),
        hidden_act=act,
    )
    if c.image_size % c.patch_size or c.hidden_size % c.num_heads:
        raise ValueError(
            f"vision_config: image_size {c.image_size} must be a multiple of patch_size "
            f"{c.patch_size} and hidden_size {c.hidden_size} of num_attention_heads {c.num_heads}"
        )
    return c


def siglip_shapes(c: SiglipConfig) -> dict[str, Any]:
    n, d, f = c.num_layers, c.hidden_size, c.intermediate_size
    return {
        "patch_w": (d, c.num_channels * c.patch_size**2),
        "patch_b": (d,),
        "pos": (c.num_patches, d),
        "layers": {
            "ln1_w": (n, d),
            "ln1_b": (n, d),
            "ln2_w": (n, d),
            "ln2_b": (n, d),
            "wqkv": (n, 3, d, d),
            "bqkv": (n, 3, d),
            "wo": (n, d, d),
            "bo": (n, d),
            "fc1_w": (n, f, d),
            "fc1_b": (n, f),
            "fc2_w": (n, d, f),
            "fc2_b": (n, d),
        },  # fmt: skip
        "post_ln_w": (d,),
        "post_ln_b": (d,),
    }


def load_siglip(read: TensorReader, c: SiglipConfig, prefix: str, dtype: Any) -> dict[str, Any]:
    """Host params from a checkpoint whose tower sits under ``prefix`` (e.g.
    "vision_tower.vision_model.")."""
    shapes = siglip_shapes(c)
    d, f = c.hidden_size, c.intermediate_size
    layers = {k: np.empty(s, dtype) for k, s in shapes["layers"].items()}
    for i in range(c.num_layers):
        p = f"{prefix}encoder.layers.{i}."
        for ours, theirs in (("ln1", "layer_norm1"), ("ln2", "layer_norm2")):
            layers[f"{ours}_w"][i] = read(p + theirs + ".weight", (d,))
            layers[f"{ours}_b"][i] = read(p + theirs + ".bias", (d,))
        for j, name in enumerate(("q_proj", "k_proj", "v_proj")):
            layers["wqkv"][i, j] = read(p + f"self_attn.{name}.weight", (d, d))
            layers["bqkv"][i, j] = read(p + f"self_attn.{name}.bias", (d,))
        layers["wo"][i] = read(p + "self_attn.out_proj.weight", (d, d))
        layers["bo"][i] = read(p + "self_attn.out_proj.bias", (d,))
        layers["fc1_w"][i] = read(p + "mlp.fc1.weight", (f, d))
        layers["fc1_b"][i] = read(p + "mlp.fc1.bias", (f,))
        layers["fc2_w"][i] = read(p + "mlp.fc2.weight", (d, f))
        layers["fc2_b"][i] = read(p + "mlp.fc2.bias", (d,))
    e = prefix + "embeddings."
    conv = (d, c.num_channels, c.patch_size, c.patch_size)
    return {
        "patch_w": read(e + "patch_embedding.weight", conv).reshape(shapes["patch_w"]),
        "patch_b": read(e + "patch_embedding.bias", (d,)),
        "pos": read(e + "position_embedding.weight", shapes["pos"]),
        "layers": layers,
        "post_ln_w": read(prefix + "post_layernorm.weight", (d,)),
        "post_ln_b": read(prefix + "post_layernorm.bias", (d,)),
    }


def _gelu(c: SiglipConfig, x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x, approximate=c.hidden_act != "gelu")


def patchify(pixels: jax.Array, patch: int) -> jax.Array:
    """[N, C, H, W] -> [N, (H / p) * (W / p), C * p * p]: patches row by row, each flattened
    in the patch convolution's (channel, row, column) order."""
    n, ch, h, w = pixels.shape
    x = pixels.reshape(n, ch, h // patch, patch, w // patch, patch)
    return x.transpose(0, 2, 4, 1, 3, 5).reshape(n, (h // patch) * (w // patch), ch * patch**2)


def siglip_encode(params: Mapping[str, Any], pixels: jax.Array, c: SiglipConfig) -> jax.Array:
    """The tower's last hidden states [N, P, D] of ``pixels`` [N, C, H, W] (normalized)."""
    dtype = params["pos"].dtype
    x = patchify(pixels.astype(dtype), c.patch_size)
    x = jnp.einsum("npk,dk->npd", x, params["patch_w"]) + params["patch_b"] + params["pos"]
    n, p, d = x.shape
    h, hd, eps = c.num_heads, c.head_dim, c.layer_norm_eps

    def layer(x, w):
        y = layer_norm(x, w["ln1_w"], w["ln1_b"], eps)
        qkv = jnp.einsum("npd,jed->jnpe", y, w["wqkv"]) + w["bqkv"][:, None, None]
        q, k, v = (t.reshape(n, p, h, hd) for t in qkv)
        s = jnp.einsum("nqhe,nkhe->nhqk", q, k, preferred_element_type=jnp.float32) * hd**-0.5
        probs = jax.nn.softmax(s, axis=-1).astype(v.dtype)
        attn = jnp.einsum("nhqk,nkhe->nqhe", probs, v).reshape(n, p, d)
        x = x + jnp.einsum("npe,de->npd", attn, w["wo"]) + w["bo"]
        y = layer_norm(x, w["ln2_w"], w["ln2_b"], eps)
        y = _gelu(c, jnp.einsum("npd,fd->npf", y, w["fc1_w"]) + w["fc1_b"])
        return x + jnp.einsum("npf,df->npd", y, w["fc2_w"]) + w["fc2_b"], None

    x, _ = jax.lax.scan(layer, x, params["layers"])
    return layer_norm(x, params["post_ln_w"], params["post_ln_b"], eps)
