"""Qwen2.5-VL's vision transformer (transformers' ``Qwen2_5_VisionTransformerPretrainedModel``)
over a params tree, pure jnp so it traces inside one jitted encoder program of fixed shape.

The encoder takes images packed into one flat run of P patches (several images, padded at
the end; :func:`pack_images` builds it on the host), as transformers concatenates them and
splits attention by ``cu_seqlens``; here the split is a mask from per-patch segment ids, so
any mix of image sizes that fits P runs through the same compiled program. Attention scores
go a block of queries at a time: in full-attention blocks against all P keys, in windowed
blocks against the keys a window can reach (a window's patches are consecutive rows after
the reordering, at most ``merger_window**2 * 4`` of them), so windowed blocks cost
O(P x window), not O(P x P).

- patch embedding: the Conv3d over (channel, frame, row, column) with stride = kernel is a
  matmul over each patch's flattened ``C * T * p * p`` values (the processor's order);
- 2D rotary embedding on each patch's (row, column) in the patch grid, the first half of
  each head's rotary pairs turning with the row and the second with the column;
- RMSNorm + SwiGLU blocks with biases; attention inside each window of
  ``window_size / patch_size`` patches per side in most blocks, over the whole image in
  ``fullatt_block_indexes``;
- window order: transformers reorders the 2 x 2 merge groups window by window before the
  blocks and back after the merger. :func:`pack_images` applies the forward reordering to
  the patches on the host and returns each output row's place in its image (``order``),
  which is the inverse: the caller writes row k to position ``order[k]``;
- the PatchMerger: RMSNorm, each 2 x 2 group's four patches concatenated, Linear, GELU,
  Linear to the decoder's width.

    {"patch_w": [D, C * T * p * p],
     "layers": {"norm1", "norm2": [L, D], "wqkv": [L, 3 * D, D], "bqkv": [L, 3 * D],
                "wo": [L, D, D], "bo": [L, D], "w_gate", "w_up": [L, F, D],
                "b_gate", "b_up": [L, F], "w_down": [L, D, F], "b_down": [L, D]},
     "merger": {"norm": [D], "w1": [4D, 4D], "b1": [4D], "w2": [Do, 4D], "b2": [Do]}}
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .layers import rms_norm
from .types import TensorReader

_EPS = 1e-6  # transformers' Qwen2_5_VLRMSNorm in the vision tower
_QUERY_BLOCK = 512  # the most queries one attention block scores at once


@dataclasses.dataclass(frozen=True, kw_only=True)
class QwenVitConfig:
    """The vision tower's shape (config.json's ``vision_config``)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    in_channels: int = 3
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size**2

    @property
    def merger_window(self) -> int:
        """A window's side in merge groups."""
        return self.window_size // self.spatial_merge_size // self.patch_size


def parse_vit_config(d: Mapping[str, Any]) -> QwenVitConfig:
    """The QwenVitConfig of a ``vision_config`` dict; ValueError naming an option jaxpaged
    does not run."""
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported qwen2_5_vl vision_config hidden_act {act!r} (silu)")
    rope = d.get("rope_parameters") or {}
    c = QwenVitConfig(
        depth=int(d.get("depth", 32)),
        hidden_size=int(d.get("hidden_size", 3584)),
        intermediate_size=int(d.get("intermediate_size", 3420)),
        num_heads=int(d.get("num_heads", 16)),
        out_hidden_size=int(d.get("out_hidden_size", 3584)),
        patch_size=int(d.get("patch_size", d.get("spatial_patch_size", 14))),
        temporal_patch_size=int(d.get("temporal_patch_size", 2)),
        spatial_merge_size=int(d.get("spatial_merge_size", 2)),
        window_size=int(d.get("window_size", 112)),
        fullatt_block_indexes=tuple(
            int(i) for i in d.get("fullatt_block_indexes", (7, 15, 23, 31))
        ),
        in_channels=int(d.get("in_channels", d.get("in_chans", 3))),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
    )
    if c.hidden_size % c.num_heads or c.head_dim % 4:
        raise ValueError(
            f"vision_config: hidden_size {c.hidden_size} / num_heads {c.num_heads} must be a "
            "multiple of 4 (2D rotary over rows and columns)"
        )
    if c.merger_window < 1:
        raise ValueError(
            f"vision_config: window_size {c.window_size} is less than one merge group "
            f"({c.spatial_merge_size} x {c.patch_size} pixels)"
        )
    return c


def vit_shapes(c: QwenVitConfig) -> dict[str, Any]:
    n, d, f, m = c.depth, c.hidden_size, c.intermediate_size, c.merge_unit * c.hidden_size
    return {
        "patch_w": (d, c.patch_dim),
        "layers": {
            "norm1": (n, d),
            "norm2": (n, d),
            "wqkv": (n, 3 * d, d),
            "bqkv": (n, 3 * d),
            "wo": (n, d, d),
            "bo": (n, d),
            "w_gate": (n, f, d),
            "b_gate": (n, f),
            "w_up": (n, f, d),
            "b_up": (n, f),
            "w_down": (n, d, f),
            "b_down": (n, d),
        },  # fmt: skip
        "merger": {
            "norm": (d,),
            "w1": (m, m),
            "b1": (m,),
            "w2": (c.out_hidden_size, m),
            "b2": (c.out_hidden_size,),
        },  # fmt: skip
    }


def load_vit(read: TensorReader, c: QwenVitConfig, prefix: str, dtype: Any) -> dict[str, Any]:
    """Host params from a checkpoint whose tower sits under ``prefix`` ("visual.")."""
    shapes = vit_shapes(c)
    d = c.hidden_size
    layers = {k: np.empty(s, dtype) for k, s in shapes["layers"].items()}
    names = {"wqkv": "attn.qkv", "wo": "attn.proj", "w_gate": "mlp.gate_proj",
             "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}  # fmt: skip
    for i in range(c.depth):
        p = f"{prefix}blocks.{i}."
        layers["norm1"][i] = read(p + "norm1.weight", (d,))
        layers["norm2"][i] = read(p + "norm2.weight", (d,))
        for ours, theirs in names.items():
            shape = shapes["layers"][ours][1:]
            layers[ours][i] = read(f"{p}{theirs}.weight", shape)
            layers["b" + ours[1:]][i] = read(f"{p}{theirs}.bias", shape[:1])
    conv = (d, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size)
    m = shapes["merger"]
    return {
        "patch_w": read(prefix + "patch_embed.proj.weight", conv).reshape(shapes["patch_w"]),
        "layers": layers,
        "merger": {
            "norm": read(prefix + "merger.ln_q.weight", m["norm"]),
            "w1": read(prefix + "merger.mlp.0.weight", m["w1"]),
            "b1": read(prefix + "merger.mlp.0.bias", m["b1"]),
            "w2": read(prefix + "merger.mlp.2.weight", m["w2"]),
            "b2": read(prefix + "merger.mlp.2.bias", m["b2"]),
        },
    }


# ------------------------------------------------------------------ host packing


class PackedPatches(NamedTuple):
    """Images packed into one encoder input of P patches (numpy), in window order."""

    patches: np.ndarray  # float32 [P, C * T * p * p]; padding rows 0
    positions: np.ndarray  # int32 [P, 2] each patch's (row, column) in its image's grid
    full_ids: np.ndarray  # int32 [P] the patch's image (full attention), -1: padding
    window_ids: np.ndarray  # int32 [P] the patch's window (windowed attention), -1: padding
    image_of: np.ndarray  # int32 [P / merge_unit] each output row's image, -1: padding
    order: np.ndarray  # int32 [P / merge_unit] each output row's token index in its image


def grid_positions(grid_h: int, grid_w: int, merge: int) -> np.ndarray:  # int32 [h * w, 2]
    """(row, column) of each patch in the processor's order: 2 x 2 merge groups row by row,
    the group's patches row by row."""
    rows, cols = np.meshgrid(np.arange(grid_h), np.arange(grid_w), indexing="ij")
    shape = (grid_h // merge, merge, grid_w // merge, merge)
    rows = rows.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
    cols = cols.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
    return np.stack([rows, cols], axis=-1).astype(np.int32)


def window_index(grid_h: int, grid_w: int, c: QwenVitConfig) -> tuple[np.ndarray, np.ndarray]:
    """(the merge groups in window order [N], each one's window number [N]) of one image
    with ``grid_h x grid_w`` patches, as transformers' ``get_vision_window_index``."""
    m, win = c.spatial_merge_size, c.merger_window
    lh, lw = grid_h // m, grid_w // m
    index = np.arange(lh * lw).reshape(lh, lw)
    nh, nw = -(-lh // win), -(-lw // win)
    padded = np.full((nh * win, nw * win), -1, np.int64)
    padded[:lh, :lw] = index
    windows = padded.reshape(nh, win, nw, win).transpose(0, 2, 1, 3).reshape(nh * nw, win * win)
    number = np.broadcast_to(np.arange(nh * nw)[:, None], windows.shape)
    keep = windows >= 0
    return windows[keep].astype(np.int32), number[keep].astype(np.int32)


def pack_images(
    images: Sequence[tuple[np.ndarray, tuple[int, int, int]]],  # (patches [N, K], (t, h, w))
    num_patches: int,
    c: QwenVitConfig,
) -> PackedPatches:
    """The encoder input of images whose patches together fit ``num_patches``: each image's
    merge groups reordered window by window, segment ids for full and windowed attention."""
    k, u = c.patch_dim, c.merge_unit
    total = sum(p.shape[0] for p, _ in images)
    if total > num_patches or num_patches % u:
        raise ValueError(f"{total} patches do not fit an encoder input of {num_patches}")
    out = PackedPatches(
        np.zeros((num_patches, k), np.float32),
        np.zeros((num_patches, 2), np.int32),
        np.full(num_patches, -1, np.int32),
        np.full(num_patches, -1, np.int32),
        np.full(num_patches // u, -1, np.int32),
        np.zeros(num_patches // u, np.int32),
    )
    at, windows = 0, 0
    for i, (patches, (t, h, w)) in enumerate(images):
        if t != 1 or patches.shape != (h * w, k):
            raise ValueError(
                f"image {i}: patches {patches.shape} for grid {(t, h, w)}, the tower takes "
                f"one frame of {k}-value patches"
            )
        groups, number = window_index(h, w, c)
        rows = (groups[:, None] * u + np.arange(u)).reshape(-1)  # patch rows in window order
        n = len(rows)
        out.patches[at : at + n] = patches[rows]
        out.positions[at : at + n] = grid_positions(h, w, c.spatial_merge_size)[rows]
        out.full_ids[at : at + n] = i
        out.window_ids[at : at + n] = np.repeat(number + windows, u)
        out.image_of[at // u : (at + n) // u] = i
        out.order[at // u : (at + n) // u] = groups
        at, windows = at + n, windows + int(number.max()) + 1
    return out


# ------------------------------------------------------------------ the tower


def _rope_2d(
    x: jax.Array,  # [P, H, hd]
    positions: jax.Array,  # int32 [P, 2]
    c: QwenVitConfig,
) -> jax.Array:
    """Rotates pairs (i, i + hd/2): the first hd/4 by row * inv_freq, the rest by column."""
    quarter = c.head_dim // 4
    inv = 1.0 / (c.rope_theta ** (np.arange(0, 2 * quarter, 2, dtype=np.float32) / (2 * quarter)))
    inv = jnp.asarray(inv.astype(np.float32))
    pos = positions.astype(jnp.float32)
    angles = jnp.concatenate([pos[:, :1] * inv, pos[:, 1:] * inv], axis=-1)  # [P, hd/2]
    cos, sin = jnp.cos(angles)[:, None], jnp.sin(angles)[:, None]
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., : 2 * quarter], x32[..., 2 * quarter :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _blocks(p: int, reach: int | None) -> tuple[int, int]:
    """(queries per block, keys each block reads) of P rows whose segments span at most
    ``reach`` consecutive rows (None: any): the widest power-of-two block up to
    _QUERY_BLOCK dividing P whose keys, ``reach`` rows either side, fit in P; else all P
    keys."""
    block = math.gcd(p, _QUERY_BLOCK)
    if reach is None:
        return block, p
    while block > 1 and block + 2 * reach > p:
        block //= 2
    return (block, block + 2 * reach) if block + 2 * reach <= p else (math.gcd(p, _QUERY_BLOCK), p)


def _segment_attention(
    q: jax.Array,  # [P, H, hd]
    k: jax.Array,  # [P, H, hd]
    v: jax.Array,  # [P, H, hd]
    segments: jax.Array,  # int32 [P]: a row attends to the rows of its segment
    reach: int | None,  # a segment's rows lie within this many consecutive rows (None: any)
) -> jax.Array:  # [P, H, hd]
    """Non-causal attention within segments, a block of queries at a time against the keys
    their segments can reach (a window's: ``reach`` rows either side of the block; scores
    [H, block, keys], never [H, P, P])."""
    p, h, hd = q.shape
    block, span = _blocks(p, reach)

    def one(args):
        b, qb, sb = args  # [], [block, H, hd], [block]
        kb, vb, kseg = k, v, segments
        if span < p:  # the keys [b * block - reach, (b + 1) * block + reach), kept inside P
            start = jnp.clip(b * block - reach, 0, p - span)
            kb, vb, kseg = (jax.lax.dynamic_slice_in_dim(a, start, span) for a in (k, v, segments))
        s = jnp.einsum("qhe,khe->hqk", qb, kb, preferred_element_type=jnp.float32) * hd**-0.5
        s = jnp.where((sb[:, None] == kseg[None, :])[None], s, -jnp.inf)
        probs = jax.nn.softmax(s, axis=-1).astype(vb.dtype)
        return jnp.einsum("hqk,khe->qhe", probs, vb)

    n = p // block
    blocks = (jnp.arange(n), q.reshape(n, block, h, hd), segments.reshape(n, block))
    return jax.lax.map(one, blocks).reshape(p, h, hd)


def vit_encode(
    params: Mapping[str, Any],
    patches: jax.Array,  # float32 [P, C * T * p * p] (PackedPatches.patches)
    positions: jax.Array,  # int32 [P, 2]
    full_ids: jax.Array,  # int32 [P]
    window_ids: jax.Array,  # int32 [P]
    c: QwenVitConfig,
) -> jax.Array:  # [P / merge_unit, out_hidden_size], in window order
    """The merger's output of packed images; padding rows attend among themselves only and
    give rows the caller drops."""
    dtype = params["patch_w"].dtype
    x = jnp.einsum("pk,dk->pd", patches.astype(dtype), params["patch_w"])
    p, d = x.shape
    h, hd = c.num_heads, c.head_dim
    reach = c.merger_window**2 * c.merge_unit  # the most patches of one window
    full = np.zeros(c.depth, bool)
    full[[i for i in c.fullatt_block_indexes if 0 <= i < c.depth]] = True

    def block(x, args):
        w, is_full = args
        y = rms_norm(x, w["norm1"], _EPS)
        qkv = (jnp.einsum("pd,ed->pe", y, w["wqkv"]) + w["bqkv"]).reshape(p, 3, h, hd)
        q, k, v = _rope_2d(qkv[:, 0], positions, c), _rope_2d(qkv[:, 1], positions, c), qkv[:, 2]
        attn = jax.lax.cond(
            is_full,
            lambda: _segment_attention(q, k, v, full_ids, None),
            lambda: _segment_attention(q, k, v, window_ids, reach),
        ).reshape(p, d)
        x = x + jnp.einsum("pe,de->pd", attn, w["wo"]) + w["bo"]
        y = rms_norm(x, w["norm2"], _EPS)
        gate = jnp.einsum("pd,fd->pf", y, w["w_gate"]) + w["b_gate"]
        up = jnp.einsum("pd,fd->pf", y, w["w_up"]) + w["b_up"]
        x = x + jnp.einsum("pf,df->pd", jax.nn.silu(gate) * up, w["w_down"]) + w["b_down"]
        return x, None

    x, _ = jax.lax.scan(block, x, (params["layers"], jnp.asarray(full)))
    m = params["merger"]
    y = rms_norm(x, m["norm"], _EPS).reshape(p // c.merge_unit, c.merge_unit * d)
    y = jax.nn.gelu(jnp.einsum("pk,jk->pj", y, m["w1"]) + m["b1"], approximate=False)
    return jnp.einsum("pk,jk->pj", y, m["w2"]) + m["b2"]
