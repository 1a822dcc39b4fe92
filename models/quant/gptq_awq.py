"""AWQ and GPTQ 4-bit linear weights converted to `GroupedWeight` (q * scale + min per group
of G inputs) exactly: (q - z) * s = q * s + (-z * s).

Layouts (as vLLM's awq.py / gptq.py and their dequantization kernels read them; AutoAWQ's
"gemm" and AutoGPTQ's packers write them), for a linear of N outputs and K inputs, 4-bit
values packed eight to an int32 at bit offsets 0, 4, ..., 28:

- AWQ ("version": "gemm"): ``qweight`` int32 [K, N / 8] packed along the outputs, the eight
  nibbles of a word holding outputs 8c + (0, 2, 4, 6, 1, 3, 5, 7) (so output 8c + j sits at
  nibble (0, 4, 1, 5, 2, 6, 3, 7)[j]); ``qzeros`` int32 [K / G, N / 8] packed the same way;
  ``scales`` float16 [K / G, N].
- GPTQ: ``qweight`` int32 [K / 8, N] packed along the inputs in order (input 8r + i at nibble
  i of word r); ``qzeros`` int32 [K / G, N / 8] packed along the outputs in order, stored as
  zero - 1 in the original ("gptq", v1) format and as the zero itself in "gptq_v2";
  ``scales`` float16 [K / G, N]; ``g_idx`` int32 [K], the group of each input: k // G, or,
  in act-order checkpoints (desc_act), each input's group in the order GPTQ quantized them
  (largest Hessian diagonal first). An act-order weight keeps its values in input order and
  its g_idx (GroupedWeight.g_idx), so the dequantization looks each input's scale and zero
  up, as vLLM's exllama kernel does without its shuffle (a permutation of the inputs that makes
  groups contiguous, paid back by gathering the activations before every matmul).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .grouped import GroupedWeight, pack_nibbles, unpack_nibbles

__all__ = ["awq_weight", "gptq_weight", "unpack_int4_words"]

# nibble of an AWQ word that holds output 8c + j
_AWQ_NIBBLE_OF_OUTPUT = np.array([0, 4, 1, 5, 2, 6, 3, 7])


def unpack_int4_words(words: np.ndarray) -> np.ndarray:  # int32 [R, C] -> uint8 [R, 8C]
    """The eight 4-bit fields of each int32 in order of bit offset (0, 4, ..., 28)."""
    as_bytes = np.ascontiguousarray(words).astype("<i4").view(np.uint8)  # [R, 4C]
    return unpack_nibbles(as_bytes)  # the low nibble of each byte first: offsets in order


def _grouped(
    q: np.ndarray,  # uint8 [N, K], 0..15
    zeros: np.ndarray,  # [N, K / G] (integers, any dtype)
    scales: np.ndarray,  # [N, K / G]
    group_size: int,
) -> GroupedWeight:
    s = scales.astype(np.float32)
    mins = -zeros.astype(np.float32) * s
    return GroupedWeight(pack_nibbles(q), s, mins, tuple(q.shape), group_size, 4)


def awq_weight(
    qweight: np.ndarray,  # int32 [K, N / 8]
    qzeros: np.ndarray,  # int32 [K / G, N / 8]
    scales: np.ndarray,  # float16 [K / G, N]
    group_size: int,
) -> GroupedWeight:  # [N, K]
    """An AWQ GEMM-layout linear as a `GroupedWeight` (see the module docstring)."""
    k, n = qweight.shape[0], qweight.shape[1] * 8

    def outputs_in_order(words: np.ndarray) -> np.ndarray:  # [R, N / 8] -> [R, N]
        nibbles = unpack_int4_words(words).reshape(words.shape[0], -1, 8)
        return nibbles[:, :, _AWQ_NIBBLE_OF_OUTPUT].reshape(words.shape[0], -1)

    q = outputs_in_order(qweight).T  # [N, K]
    zeros = outputs_in_order(qzeros).T  # [N, K / G]
    scales_t = np.asarray(scales).T  # [N, K / G]
    _check_groups("AWQ", k, n, group_size, zeros.shape, scales_t.shape)
    return _grouped(np.ascontiguousarray(q), zeros, scales_t, group_size)


def gptq_weight(
    qweight: np.ndarray,  # int32 [K / 8, N]
    qzeros: np.ndarray,  # int32 [K / G, N / 8]
    scales: np.ndarray,  # float16 [K / G, N]
    g_idx: np.ndarray | None,  # int32 [K]
    group_size: int,
    *,
    zero_offset: int,  # 1 for the v1 ("gptq") format, 0 for "gptq_v2"
) -> GroupedWeight:  # [N, K]
    """A GPTQ linear as a `GroupedWeight` (see the module docstring); an act-order g_idx
    (not k // group_size) is kept in it."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    act_order = None
    if g_idx is not None and not np.array_equal(np.asarray(g_idx), np.arange(k) // group_size):
        act_order = np.asarray(g_idx).astype(np.int32).reshape(1, k)
        if act_order.min() < 0 or act_order.max() >= k // group_size:
            raise ValueError(
                f"GPTQ g_idx holds groups {act_order.min()}..{act_order.max()}, outside the "
                f"{k // group_size} groups of {k} inputs"
            )
    q = unpack_int4_words(np.asarray(qweight).T)  # [N, K]: each output's words in input order
    zeros = unpack_int4_words(qzeros).astype(np.int16) + zero_offset  # [K / G, N]
    _check_groups("GPTQ", k, n, group_size, zeros.T.shape, scales.T.shape)
    w = _grouped(q, zeros.T, np.asarray(scales).T, group_size)
    return w if act_order is None else dataclasses.replace(w, g_idx=act_order)


def _check_groups(fmt: str, k: int, n: int, g: int, zeros_shape, scales_shape) -> None:
    want = (n, k // g)
    if k % g or tuple(zeros_shape) != want or tuple(scales_shape) != want:
        raise ValueError(
            f"{fmt} weight of {n} outputs x {k} inputs in groups of {g}: zeros {zeros_shape} "
            f"and scales {scales_shape} (transposed), expected {want}"
        )
