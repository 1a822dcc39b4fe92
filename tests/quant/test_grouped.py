"""The group-wise quantized weight format (models/quant/grouped.py): its dequantization
against a numpy loop, its views and tensor-parallel splits, and its XLA matmul and a whole
model against their dequantized float twins."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpaged.kernels import cpu
from jaxpaged.kernels.cpu.linear_q4 import CHUNK_LEVELS, X_CHUNK, linear_q4, x_rounding
from jaxpaged.models.layers import rms_norm
from jaxpaged.models.llama import compute_logits, forward, linear_xla
from jaxpaged.models.quant import GroupedWeight, is_quantized, quantize_grouped, weight_bytes
from jaxpaged.models.quant.grouped import grouped_shardings, pack_nibbles, unpack_nibbles
from jaxpaged.models.quant.matmul import quantized_matmul
from jaxpaged.models.testing import random_params, tiny_config


def _loop_dequantize(q, scales, mins, group):  # q [N, K] ints -> float32 [N, K], one by one
    n, k = q.shape
    out = np.empty((n, k), np.float32)
    for i in range(n):
        for j in range(k):
            w = np.float32(q[i, j]) * scales[i, j // group]
            out[i, j] = w if mins is None else w + mins[i, j // group]
    return out


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 8), (8, 32), (8, 16)])
def test_dequantize_matches_a_loop_over_the_layout(bits, group):
    rng = np.random.default_rng(bits * group)
    n, k = 5, 64
    if bits == 4:
        q = rng.integers(0, 16, (n, k)).astype(np.uint8)
        values = np.zeros((n, k // 2), np.uint8)
        for j in range(k):  # the documented layout: even k in the low nibble
            values[:, j // 2] |= q[:, j] << (4 * (j % 2))
        np.testing.assert_array_equal(pack_nibbles(q), values)
        np.testing.assert_array_equal(unpack_nibbles(values), q)
        mins = rng.normal(0, 1, (n, k // group)).astype(np.float32)
    else:
        q = rng.integers(-128, 128, (n, k)).astype(np.int8)
        values, mins = q, None
    scales = rng.uniform(0.01, 1, (n, k // group)).astype(np.float32)
    w = GroupedWeight(values, scales, mins, (n, k), group, bits)
    expect = _loop_dequantize(q, scales, mins, group)
    np.testing.assert_array_equal(w.dequantize(np.float32), expect)  # numpy
    jw = jax.tree.map(jnp.asarray, w)
    # XLA may contract the multiply and add into one FMA (one rounding, not two)
    got = np.asarray(jax.jit(lambda w: w.dequantize())(jw))
    np.testing.assert_allclose(got, expect, rtol=2e-7, atol=1e-7)
    assert w.nbytes == values.nbytes + scales.nbytes + (0 if mins is None else mins.nbytes)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_grouped_error_is_within_half_a_step(bits):
    rng = np.random.default_rng(3)
    w = rng.normal(0, 1, (3, 16, 96)).astype(np.float32) * rng.uniform(0.1, 5, (3, 16, 1))
    g = quantize_grouped(w, 1, 32, bits)
    assert g.shape == w.shape and g.scales.shape == (3, 16, 3)
    err = np.abs(g.dequantize(np.float32) - w).reshape(3, 16, 3, 32)
    assert np.all(err <= g.scales[..., None] / 2 * (1 + 1e-4) + 1e-6)


def test_views_index_and_reshape_like_the_float_leaf():
    rng = np.random.default_rng(4)
    w = rng.normal(0, 1, (2, 6, 2, 4, 8)).astype(np.float32)  # like wo [L, D, Hkv, G, hd]
    g = quantize_grouped(w, 3, 16, 4)
    assert g.values.shape == (2, 6, 32) and g.scales.shape == (2, 6, 4)
    view = g.reshape(2, 6, -1)  # linear_fn's [L, N, K]
    assert view.shape == (2, 6, 64) and view.values.shape == (2, 6, 32)
    np.testing.assert_array_equal(view.dequantize(), g.dequantize().reshape(2, 6, 64))
    back = view.reshape(g.shape)
    assert back.shape == g.shape
    np.testing.assert_array_equal(back[1].dequantize(), g.dequantize()[1])
    stacked = quantize_grouped(rng.normal(0, 1, (3, 2, 8, 32)).astype(np.float32), 1, 8, 8)
    np.testing.assert_array_equal(
        stacked.reshape(6, 8, 32)[3].dequantize(), stacked[1, 1].dequantize()
    )
    with pytest.raises(ValueError, match="trailing K"):
        view.reshape(2, 12, 32)  # would split K
    with pytest.raises(ValueError, match="leading axes"):
        view[0, 1]
    with pytest.raises(ValueError, match="multiple of group"):
        quantize_grouped(w, 3, 24, 4)
    with pytest.raises(ValueError, match="mins"):
        GroupedWeight(g.values, g.scales, None, g.shape, 16, 4)
    with pytest.raises(ValueError, match="scales"):
        GroupedWeight(g.values, g.scales[..., :2], g.mins[..., :2], g.shape, 16, 4)


def test_tensor_parallel_splits_values_scales_and_mins_alike():
    mesh = AbstractMesh((4,), ("tp",))
    w = quantize_grouped(np.zeros((2, 8, 2, 4, 32), np.float32), 3, 32, 4)  # K = 256
    # output axis: values, scales and mins split on it alike
    out, group = grouped_shardings(NamedSharding(mesh, P(None, "tp")), w)
    assert out.spec == P(None, "tp", None) and group.spec == P(None, "tp", None)
    # K split on its outermost axis (Hkv 2 -> the mesh's 4 needs Hkv % 4; here it is the
    # spec's business): contiguous pieces of 64, two groups each
    out, group = grouped_shardings(NamedSharding(mesh, P(None, None, "tp")), w)
    assert out.spec == P(None, None, "tp") and group.spec == P(None, None, "tp")
    with pytest.raises(ValueError, match="not contiguous"):  # an inner contracted axis
        grouped_shardings(NamedSharding(mesh, P(None, None, None, None, "tp")), w)
    small = quantize_grouped(np.zeros((8, 128), np.float32), 1, 64, 8)
    with pytest.raises(ValueError, match="pieces of 32, which cut its groups of 64"):
        grouped_shardings(NamedSharding(mesh, P(None, "tp")), small)


@pytest.mark.parametrize("bits,group", [(4, 32), (8, 32), (4, 16)])
@pytest.mark.parametrize("t,n,k", [(1, 16, 64), (7, 48, 96), (33, 32, 128)])
def test_quantized_matmul_matches_the_dequantized_dot(bits, group, t, n, k):
    rng = np.random.default_rng(t * n + k + bits)
    w = quantize_grouped(rng.normal(0, 1, (3, n, k)).astype(np.float32), 1, group, bits)
    x = jnp.asarray(rng.normal(0, 1, (t, k)), jnp.float32)
    residual = jnp.asarray(rng.normal(0, 1, (t, n)), jnp.float32)
    jw = jax.tree.map(jnp.asarray, w)
    got = jax.jit(lambda x, w, r, i: linear_xla(x, w, i, residual=r))(x, jw, residual, 2)
    expect = residual + np.asarray(x) @ w.dequantize(np.float32)[2].T
    np.testing.assert_allclose(np.asarray(got), expect, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="quantized_matmul needs"):
        quantized_matmul(x[:, :-2], jw[0])


def _grouped_params(params, config, bits):
    layers = dict(params["layers"])
    for name, in_axes in {"wqkv": 1, "wo": 3, "w_gate_up": 1, "w_down": 1}.items():
        layers[name] = quantize_grouped(layers[name], in_axes, 16, bits)
    return {**params, "layers": layers, "lm_head": quantize_grouped(params["embed"], 1, 16, bits)}


@pytest.mark.parametrize("bits", [4, 8])
def test_model_over_grouped_weights_matches_its_dequantized_twin(bits):
    config = tiny_config()
    params = _grouped_params(random_params(config), config, bits)
    assert is_quantized(params)
    assert weight_bytes(params) < weight_bytes(random_params(config))
    twin = jax.tree.map(
        lambda w: w.dequantize(np.float32) if isinstance(w, GroupedWeight) else w,
        params,
        is_leaf=lambda w: isinstance(w, GroupedWeight),
    )
    tokens = jnp.asarray([5, 17, 3, 90, 41, 2], jnp.int32)
    positions = jnp.arange(6, dtype=jnp.int32)

    def logits(p):
        p = jax.tree.map(jnp.asarray, p)
        hidden, _ = forward(p, tokens, positions, config=config)
        return np.asarray(compute_logits(p, hidden, config=config))

    np.testing.assert_allclose(logits(params), logits(twin), rtol=1e-4, atol=1e-4)


def _as_the_kernel_rounds(x: np.ndarray, real: int, group: int, bits: int) -> np.ndarray:
    """x [M, K] rounded to integers as linear_q4 does in a step of `real` real rows on this
    CPU: per 32 inputs (max |x| / CHUNK_LEVELS), per row or per group of inputs (max |x| /
    32767), or not at all."""
    how = x_rounding(real, group, bits)
    if how is None or not len(x):
        return x
    m = x.shape[0]
    width = {"chunk": X_CHUNK, "group": group}.get(how, x.shape[1])
    blocks = x.reshape(m, -1, width)
    scale = np.abs(blocks).max(axis=2, keepdims=True) / (CHUNK_LEVELS if how == "chunk" else 32767)
    return (np.rint(blocks / np.where(scale > 0, scale, 1)) * scale).reshape(x.shape)


@pytest.mark.skipif(not cpu.available(), reason="native CPU kernels did not build")
@pytest.mark.parametrize(
    "bits,group,m,real,k,n",
    [(4, 32, 1, 1, 64, 16), (4, 32, 2, 2, 128, 24), (4, 32, 7, 5, 576, 50),
     (4, 32, 32, 32, 192, 40), (8, 32, 33, 30, 576, 20), (8, 16, 3, 3, 96, 5),
     (4, 128, 100, 97, 256, 64), (4, 32, 8, 8, 576, 49), (4, 16, 6, 6, 96, 30),
     (4, 32, 20, 17, 576, 61), (8, 32, 1, 1, 576, 37), (4, 64, 1, 1, 1536, 21),
     (4, 32, 16, 16, 576, 61), (8, 16, 16, 9, 96, 5), (4, 32, 4, 4, 576, 37),
     (4, 64, 6, 3, 1536, 21)],
)  # fmt: skip
def test_linear_q4_matches_the_dequantized_reference(bits, group, m, real, k, n):
    """Fresh random weights, x, gate, norm and residual; rows past num_rows (padding) get
    the residual's rows without a matmul. The row counts cover every path: AVX2 without
    AVX-512, 4-bit, 1-4 rows: x per 32 inputs in two int8 parts (1-4 row tiles, 1- 2- and
    4-output tiles, groups of 32 and 64); int16 (1 row;
    with AVX512-VNNI, 4-bit with two groups per 64 inputs or one, and 8-bit),
    dot_rows (2-8 rows, 2-5 with AVX512-VNNI: 32- and 16-input steps, an output tail), the
    lane path with AVX512-VNNI (6-32 rows: 8-, 16- and 32-row tiles, 12- and 6-output tiles
    and single-output tails, groups of 16 to 128, 4- and 8-bit) and block_z (more, 16- and
    32-row tiles, two row blocks) with AVX-512; the AVX2 paths elsewhere."""
    rng = np.random.default_rng(m * k + n + bits)
    w = quantize_grouped(rng.normal(0, 1, (3, n, k)).astype(np.float32), 1, group, bits)
    x, gate = (jnp.asarray(rng.normal(0, 1, (m, k)), jnp.float32) for _ in range(2))
    residual = jnp.asarray(rng.normal(0, 1, (m, n)), jnp.float32)
    norm_w = jnp.asarray(rng.normal(0, 1, (k,)), jnp.float32)

    @jax.jit
    def run(x, w, g, r, nw):
        return linear_q4(x, w, 2, num_rows=real, residual=r, norm=(nw, 1e-5), silu_gate=g)

    got = np.asarray(run(x, jax.tree.map(jnp.asarray, w), gate, residual, norm_w))
    xr = np.asarray(rms_norm(jax.nn.silu(gate) * x, norm_w, 1e-5))
    xr = _as_the_kernel_rounds(xr, real, group, bits)
    want = np.asarray(residual) + xr.astype(np.float64) @ w.dequantize(np.float32)[2].T
    np.testing.assert_allclose(got[:real], want[:real], rtol=1e-4, atol=1e-3)
    np.testing.assert_array_equal(got[real:], np.asarray(residual)[real:])


@pytest.mark.skipif(not cpu.available(), reason="native CPU kernels did not build")
def test_cpu_backend_runs_grouped_weights_in_linear_q4():
    from jaxpaged.kernels.cpu.backend import CpuBackend
    from jaxpaged.models.linear import map_matmul_weights
    from jaxpaged.models.llama import LINEARS

    config = tiny_config()
    params = jax.tree.map(jnp.asarray, _grouped_params(random_params(config), config, 4))
    weight_map = lambda p, fn: map_matmul_weights(p, LINEARS, fn)  # noqa: E731
    backend = CpuBackend.select(params, weight_map, attention_backend="cpu", sharded=False)
    assert backend.native_linear and backend.grouped_weights and not backend.int8_weights
    packed = backend.pack_weights(params, weight_map)
    tokens = jnp.asarray([5, 17, 3, 90], jnp.int32)
    positions = jnp.arange(4, dtype=jnp.int32)

    def logits(p, linear_fn):
        hidden, _ = forward(p, tokens, positions, config=config, linear_fn=linear_fn)
        return np.asarray(compute_logits(p, hidden, config=config, linear_fn=linear_fn))

    native = logits(packed, backend.kernels.linear)
    np.testing.assert_allclose(native, logits(params, None), rtol=1e-4, atol=1e-4)
    small = _grouped_params(random_params(config), config, 4)  # group 16: still the kernel's
    mixed = {**small, "lm_head": jnp.asarray(random_params(config)["embed"])}  # a float head
    assert CpuBackend.select(
        mixed, weight_map, attention_backend="cpu", sharded=False
    ).grouped_weights


@pytest.mark.skipif(not cpu.available(), reason="native CPU kernels did not build")
def test_linear_q4_picks_its_path_by_real_rows_without_recompiling():
    """The kernel's path (one row, a few, many) follows the step's real rows inside one
    compiled program of the bucket's shape: one compilation for every row count, each
    output against the dequantized reference."""
    rng = np.random.default_rng(7)
    w = quantize_grouped(rng.normal(0, 1, (1, 48, 128)).astype(np.float32), 1, 32, 4)
    wj = jax.tree.map(jnp.asarray, w)
    x = jnp.asarray(rng.normal(0, 1, (40, 128)), jnp.float32)
    run = jax.jit(lambda x, w, rows: linear_q4(x, w, 0, num_rows=rows))
    dense = w.dequantize(np.float32)[0].T
    for rows in (0, 1, 3, 4, 8, 20, 40):  # 0: a step whose rows are all padding
        got = np.asarray(run(x, wj, jnp.int32(rows)))
        xr = np.asarray(x)[:rows]
        xr = _as_the_kernel_rounds(xr, rows, 32, 4)
        np.testing.assert_allclose(got[:rows], xr @ dense, rtol=1e-4, atol=1e-3)
        np.testing.assert_array_equal(got[rows:], 0.0)
    assert run._cache_size() == 1


@pytest.mark.skipif(not cpu.available(), reason="native CPU kernels did not build")
@pytest.mark.parametrize("bits,group", [(4, 32), (8, 32)])
def test_linear_q4_decode_rows_write_every_output(bits, group):
    """A decode bucket of 32 rows at 6, 16, 24 and 32 real rows (the lane path with
    AVX512-VNNI), each call after one whose output was all NaN (x NaN, so a reused buffer
    starts poisoned): every real row equals the dequantized reference, every padding row is
    zero, in one compiled program."""
    rng = np.random.default_rng(11 + bits)
    k, n = 576, 100
    w = quantize_grouped(rng.normal(0, 1, (2, n, k)).astype(np.float32), 1, group, bits)
    wj = jax.tree.map(jnp.asarray, w)
    run = jax.jit(lambda x, w, rows: linear_q4(x, w, 1, num_rows=rows))
    dense = w.dequantize(np.float32)[1].T.astype(np.float64)
    poison = jnp.full((32, k), np.nan, jnp.float32)
    for rows in (6, 16, 24, 32):
        assert np.isnan(np.asarray(run(poison, wj, jnp.int32(32)))).all()
        x = rng.normal(0, 1, (32, k)).astype(np.float32)
        got = np.asarray(run(jnp.asarray(x), wj, jnp.int32(rows)))
        want = _as_the_kernel_rounds(x[:rows], rows, group, bits) @ dense
        np.testing.assert_allclose(got[:rows], want, rtol=1e-4, atol=1e-3)
        np.testing.assert_array_equal(got[rows:], 0.0)
    assert run._cache_size() == 1
