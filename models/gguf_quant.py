"""GGUF's quantized blocks read into `GroupedWeight` (models/quant/grouped.py) without
expanding them to floats.

Every supported type maps onto ``q * scale + min`` per group of inputs exactly: the scale and
min below are float32 products of float16 block scales and small integers, so each is exact,
and ``q * scale + min`` then rounds like the gguf package's own dequantization (which is
what the float import uses); tests/quant/test_gguf_quant.py checks that bit for bit.

    type   bits  group  q                        scale       min
    Q8_0   8     32     int8 as stored           d           -
    Q5_0   8     32     5-bit value - 16         d           -
    Q4_0   4     32     nibble 0..15             d           -8 * d
    Q4_1   4     32     nibble 0..15             d           m
    Q4_K   4     32     nibble 0..15             d * sc[j]   -(dmin * m[j])
    Q6_K   8     16     6-bit value - 32         d * sc[j]   -

GGUF stores each row's blocks in order along K; within a 4-bit block the low nibbles hold the
first half of the block and the high nibbles the second half (Q4_K: per 64 inputs), which is
repacked here into the grouped layout (even k low, odd k high).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .quant.grouped import GroupedWeight, pack_nibbles

__all__ = ["KEPT_QUANTIZED_TYPES", "grouped_from_blocks"]

_QK_K = 256  # a K-quant super-block's inputs


def _f16(raw: np.ndarray) -> np.ndarray:  # uint8 [..., 2] -> float32 [...]
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _split_halves(qs: np.ndarray) -> np.ndarray:  # uint8 [..., B] -> 0..15 [..., 2B]
    """llama.cpp's nibble order: the low nibbles of B bytes, then their high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q8_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, None, int]:
    d = _f16(blocks[..., 0:2])
    q = np.ascontiguousarray(blocks[..., 2:34]).view(np.int8)
    return q.reshape(*q.shape[:-2], -1), d, None, 32


def _q5_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, None, int]:
    """d, then the fifth bits of the block's 32 values (bit j of a little-endian uint32 for
    value j), then their low nibbles (value j in byte j % 16, low nibble first)."""
    d = _f16(blocks[..., 0:2])
    qh = np.ascontiguousarray(blocks[..., 2:6]).view("<u4")[..., 0]
    high = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    q = (_split_halves(blocks[..., 6:22]) | (high << 4)).astype(np.int8) - np.int8(16)
    return q.reshape(*q.shape[:-2], -1), d, None, 32


def _q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    d = _f16(blocks[..., 0:2])
    q = _split_halves(blocks[..., 2:18])
    return q.reshape(*q.shape[:-2], -1), d, np.float32(-8) * d, 32


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    d, m = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    q = _split_halves(blocks[..., 4:20])
    return q.reshape(*q.shape[:-2], -1), d, m, 32


def _q4_k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # [..., 12] -> 2x [..., 8]
    """The 6-bit sub-block scales and mins packed in 12 bytes (llama.cpp get_scale_min_k4)."""
    d, m, m_d = raw[..., 0:4], raw[..., 4:8], raw[..., 8:12]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    sc, mn = _q4_k_scales(blocks[..., 4:16])
    scales = d[..., None] * sc.astype(np.float32)  # [..., 8]
    mins = -(dmin[..., None] * mn.astype(np.float32))
    qs = blocks[..., 16:144].reshape(*blocks.shape[:-1], 4, 32)  # 4 chunks of 64 inputs
    q = _split_halves(qs)  # [..., 4, 64]
    lead = blocks.shape[:-2]
    return q.reshape(*lead, -1), scales.reshape(*lead, -1), mins.reshape(*lead, -1), 32


def _q6_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, None, int]:
    lead = blocks.shape[:-1]
    ql = blocks[..., 0:128].reshape(*lead, 2, 64)  # per 128 inputs: 64 bytes of low 4 bits
    qh = blocks[..., 128:192].reshape(*lead, 2, 32)  # per 128 inputs: 32 bytes of high 2 bits
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)
    d = _f16(blocks[..., 208:210])
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=-1)  # [..., 2, 128]
    high = np.concatenate([(qh >> s) & 0x03 for s in (0, 2, 4, 6)], axis=-1)  # [..., 2, 128]
    q = (low | (high << 4)).astype(np.int8) - np.int8(32)
    scales = d[..., None] * sc  # [..., 16]
    return q.reshape(*blocks.shape[:-2], -1), scales.reshape(*blocks.shape[:-2], -1), None, 16


# GGML type name -> (bytes per block, inputs per block, reader)
_READERS = {
    "Q8_0": (34, 32, _q8_0),
    "Q5_0": (22, 32, _q5_0),  # 8-bit here: 1.125 bytes a weight against the file's 0.69
    "Q4_0": (18, 32, _q4_0),
    "Q4_1": (20, 32, _q4_1),
    "Q4_K": (144, _QK_K, _q4_k),
    "Q6_K": (210, _QK_K, _q6_k),
}
KEPT_QUANTIZED_TYPES = tuple(_READERS)


def grouped_from_blocks(raw: Any, type_name: str, rows: int, cols: int) -> GroupedWeight:
    """The [rows, cols] (HF [out, in]) weight whose GGUF data is ``raw`` (the tensor's bytes,
    rows after rows, each row's blocks along cols), as a `GroupedWeight`."""
    if type_name not in _READERS:
        raise ValueError(
            f"GGUF type {type_name} is not kept quantized; kept: {', '.join(_READERS)}"
        )
    block_bytes, block_size, read = _READERS[type_name]
    if cols % block_size:
        raise ValueError(f"GGUF {type_name} row of {cols} is not whole blocks of {block_size}")
    data = np.asarray(raw).view(np.uint8).reshape(rows, cols // block_size, block_bytes)
    q, scales, mins, group = read(data)
    q = q.reshape(rows, cols)
    scales = np.ascontiguousarray(scales.reshape(rows, cols // group), np.float32)
    if mins is None:
        return GroupedWeight(np.ascontiguousarray(q, np.int8), scales, None, (rows, cols), group, 8)
    mins = np.ascontiguousarray(np.broadcast_to(mins, scales.shape), np.float32)
    return GroupedWeight(pack_nibbles(q), scales, mins, (rows, cols), group, 4)
