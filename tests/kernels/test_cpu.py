"""The native "cpu" backend (C++ through XLA FFI) against the jnp reference."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.kernels import cpu, default_backend, ragged_paged_attention, write_kv
from jaxpaged.kernels.testing import SWEEP, make_case, mixed_seqs, rel_err, run_and_compare

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C++ compiler for the kernel")

CPU_SWEEP = [c for c in SWEEP if c[4] != "float16"]  # float16 pools are the xla backend's


@pytest.mark.parametrize("d,bs,hq,hkv,dtype,window,cap", CPU_SWEEP)
def test_cpu_mixed_batch(rng, d, bs, hq, hkv, dtype, window, cap):
    """The "cpu" backend (the C++ kernel on every row): decode rows, prefill from scratch
    and chunked prefill on a cached prefix in one batch."""
    seqs = mixed_seqs(rng, bs, n=8)
    run_and_compare(
        rng, seqs, hq=hq, hkv=hkv, d=d, bs=bs, dtype=dtype, backend="cpu", max_seqs=10,
        sliding_window=window, soft_cap=cap,
    )  # fmt: skip


@pytest.mark.parametrize("window", [None, 11], ids=["full", "window11"])
@pytest.mark.parametrize("d,hq,hkv", [(64, 16, 1), (36, 4, 2)], ids=["group16", "d36"])
def test_cpu_scalar_path_shapes(rng, d, hq, hkv, window):
    """Shapes the vector kernels leave to the scalar loops (a GQA group over 8 queries,
    head_dim % 8 != 0), mixed decode and prefill rows, with and without a sliding window."""
    seqs = mixed_seqs(rng, 8, n=6)
    run_and_compare(
        rng, seqs, hq=hq, hkv=hkv, d=d, bs=8, dtype="float32", backend="cpu",
        sliding_window=window,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_decode_batch(rng, dtype):
    """A full decode step of SmolLM2's shape: 32 sequences, contexts up to 300 tokens (a
    bfloat16 pool is read in place, its rows widened in registers)."""
    seqs = [(1, int(rng.integers(1, 300))) for _ in range(32)]
    run_and_compare(rng, seqs, hq=9, hkv=3, d=64, bs=16, dtype=dtype, backend="cpu", max_q_len=1)


@pytest.mark.parametrize("d,hq,hkv", [(40, 6, 2), (48, 3, 3), (64, 16, 2)], ids=str)
def test_cpu_bfloat16_pool_row_kernels(rng, d, hq, hkv):
    """bfloat16 pools: head_dim % 16 != 0 widens rows into a buffer (d 40); otherwise rows
    are read in place (d 48: an odd number of 16-value pairs; a group of 8 queries); decode
    and prefill rows, a sliding window."""
    seqs = mixed_seqs(rng, 8, n=6)
    run_and_compare(
        rng, seqs, hq=hq, hkv=hkv, d=d, bs=8, dtype="bfloat16", backend="cpu", sliding_window=13
    )


@pytest.mark.parametrize(
    "dtype,window,cap", [("float32", None, None), ("bfloat16", 21, 4.0)], ids=["f32", "bf16"]
)
def test_cpu_decode_chains_with_prefill_rows(rng, dtype, window, cap):
    """Enough decode rows that the kernel runs them in chains (each item prefetching the next
    one's first blocks), some a single block long, with prefill rows between them."""
    seqs = [(1, int(rng.integers(1, 120))) for _ in range(30)]
    seqs[3:3] = [(17, 40)]
    seqs[11:11] = [(1, 3), (1, 16), (5, 5)]
    run_and_compare(
        rng, seqs, hq=6, hkv=2, d=64, bs=16, dtype=dtype, backend="cpu",
        sliding_window=window, soft_cap=cap,
    )  # fmt: skip


def test_cpu_long_prefill_tiles(rng):
    """Prompts longer than a row tile, on top of cached prefixes, with and without a window."""
    seqs = [(70, 70), (45, 260), (1, 5), (33, 33)]
    for window in (None, 37):
        run_and_compare(
            rng, seqs, hq=4, hkv=1, d=64, bs=8, dtype="float32", backend="cpu",
            sliding_window=window,
        )  # fmt: skip


def test_cpu_long_context(rng):
    seqs = [(1, 32768), (8, 20000)]
    run_and_compare(rng, seqs, hq=2, hkv=1, d=64, bs=64, dtype="float32", backend="cpu", pad=0)


def test_cpu_inside_scan_with_donated_pool(rng):
    """As the engine runs it: write_kv then attention, per layer of a lax.scan over a
    donated pool holding every layer; every layer's output equals the reference's."""
    layers, nb, bs, hq, hkv, d = 3, 24, 8, 4, 2, 64
    seqs = [(1, 40), (9, 9), (1, 17)]  # (q_len, kv_len)
    tables = np.stack([rng.permutation(nb)[:6] for _ in seqs]).astype(np.int32)  # [S, 6]
    slots = []
    for s, (q_len, kv_len) in enumerate(seqs):
        for p in range(kv_len - q_len, kv_len):
            slots.append(tables[s, p // bs] * bs + p % bs)
    slots = jnp.asarray(np.array(slots + [-1, -1], np.int32))  # two padding rows
    t = slots.shape[0]
    cu = jnp.asarray(np.cumsum([0] + [q for q, _ in seqs]).astype(np.int32))
    lens = jnp.asarray(np.array([kv for _, kv in seqs], np.int32))
    n = jnp.asarray([len(seqs)], jnp.int32)
    q = jnp.asarray(rng.standard_normal((layers, t, hq, d), dtype=np.float32))
    kv_new = jnp.asarray(rng.standard_normal((layers, t, hkv, d), dtype=np.float32))
    pool = rng.standard_normal((layers * nb, bs, hkv, d), dtype=np.float32)
    tables = jnp.asarray(tables)

    def run(backend, pk, pv):
        def body(carry, xs):
            pk, pv = carry
            layer, qi, kv = xs
            s = jnp.where(slots >= 0, slots + layer * nb * bs, -1)
            pk, pv = write_kv(pk, pv, kv, -kv, s)
            out = ragged_paged_attention(
                qi, pk, pv, lens, tables + layer * nb, cu, n, sm_scale=0.125, backend=backend
            )
            return (pk, pv), out

        (pk, pv), outs = jax.lax.scan(body, (pk, pv), (jnp.arange(layers), q, kv_new))
        return outs, pk, pv

    ref, _, _ = jax.jit(run, static_argnums=0)("reference", jnp.asarray(pool), jnp.asarray(pool))
    fast = jax.jit(run, static_argnums=0, donate_argnums=(1, 2))
    out, pk, _ = fast("cpu", jnp.asarray(pool), jnp.asarray(pool))
    assert rel_err(out, ref) < 1e-5
    assert np.all(np.asarray(out)[:, -2:] == 0.0)  # padding rows
    assert pk.shape == pool.shape


def test_cpu_is_the_default_on_cpu_and_float16_falls_back(rng):
    assert default_backend("cpu") == "cpu"
    case = make_case(
        rng, [(1, 30), (5, 12)], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=8,
        dtype=np.float16, max_seqs=3, pad_tokens=1,
    )  # fmt: skip
    args = tuple(map(jnp.asarray, case.args()))
    ref = ragged_paged_attention(*args, sm_scale=case.sm_scale, backend="reference")
    out = ragged_paged_attention(*args, sm_scale=case.sm_scale)  # float16: xla picked
    assert rel_err(out, ref) < 1e-2
    with pytest.raises(ValueError, match="float32/bfloat16"):
        ragged_paged_attention(*args, sm_scale=case.sm_scale, backend="cpu")


@pytest.mark.parametrize(
    "env,reason",
    [({"JAXPAGED_NATIVE": "0"}, "disabled"), ({"CXX": "/bin/false"}, "failed")],
)
def test_cpu_unavailable_falls_back_to_xla(tmp_path, env, reason):
    """No kernel (disabled, or the compiler fails): a warning, and "xla" is the default."""
    code = (
        "import warnings; warnings.simplefilter('always')\n"
        "from jaxpaged.kernels import cpu, default_backend\n"
        "print(cpu.available(), default_backend('cpu'), cpu._register())\n"
    )
    full_env = {**os.environ, "JAXPAGED_CACHE": str(tmp_path), **env}
    res = subprocess.run(
        [sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("False xla"), res.stdout
    assert reason in res.stdout


# 6- or 8-row tiles (AVX2 or AVX-512) and their remainders, 96-row blocks
@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 8, 9, 10, 17, 32, 64, 97, 200])
# K past one 256 slice, odd K; 101 panels: items that split unevenly into the threads' runs
@pytest.mark.parametrize("k,n", [(576, 960), (300, 48), (13, 16), (40, 1616)])
def test_linear_matches_numpy(rng, m, k, n):
    """x @ w[index].T for every layer index of a stacked weight in panel layout, against
    float64 numpy on the unpacked weight."""
    layers = 3
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((layers, n, k), dtype=np.float32)
    packed = cpu.pack_panels(jnp.asarray(w))
    fn = jax.jit(cpu.linear)
    for index in range(layers):
        out = np.asarray(fn(jnp.asarray(x), packed, jnp.int32(index)))
        ref = x.astype(np.float64) @ w[index].astype(np.float64).T
        assert out.shape == (m, n)
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4 * np.sqrt(k))


@pytest.mark.parametrize("m", [1, 7, 32, 200])
@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16])
def test_linear_bfloat16_weights_match_numpy(rng, m, x_dtype):
    """bfloat16 weights are read exactly (each value widened, not rounded again) and
    accumulated in float32: against float64 numpy on the same bfloat16 values. The result
    comes back in x's dtype unless out_dtype says otherwise."""
    k, n, layers = 300, 96, 2
    x = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32), x_dtype)
    w = jnp.asarray(rng.standard_normal((layers, n, k), dtype=np.float32), jnp.bfloat16)
    packed = cpu.pack_panels(w)
    assert packed.dtype == jnp.bfloat16
    ref = np.asarray(x, np.float64) @ np.asarray(w[1], np.float64).T
    out = jax.jit(lambda x, w: cpu.linear(x, w, 1, out_dtype=jnp.float32))(x, packed)
    assert out.dtype == jnp.float32 and out.shape == (m, n)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-4 * np.sqrt(k))
    same = jax.jit(lambda x, w: cpu.linear(x, w, 1))(x, packed)
    assert same.dtype == x_dtype
    np.testing.assert_array_equal(np.asarray(same), np.asarray(out.astype(x_dtype)))


# one row tile and several per slice (AVX-512: each slice widened once, shared), remainder
# tiles of 1-4 rows; K in one slice, two, and four (AVX2: outputs in pair order in between)
@pytest.mark.parametrize("m", [1, 2, 7, 8, 9, 32, 33, 97])
@pytest.mark.parametrize("k,n", [(576, 960), (13, 16), (1536, 48)])
def test_linear_bfloat16_weights_every_tile_path(rng, m, k, n):
    """bfloat16 weights with a residual, for row counts that run one register tile or
    several per slice: against float64 numpy on the same bfloat16 values, every layer."""
    layers = 2
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = jnp.asarray(rng.standard_normal((layers, n, k), dtype=np.float32), jnp.bfloat16)
    res = rng.standard_normal((m, n), dtype=np.float32)
    packed = cpu.pack_panels(w)
    fn = jax.jit(lambda x, w, i, r: cpu.linear(x, w, i, residual=r))
    for index in range(layers):
        out = np.asarray(fn(jnp.asarray(x), packed, jnp.int32(index), jnp.asarray(res)))
        ref = res + x.astype(np.float64) @ np.asarray(w[index], np.float64).T
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4 * np.sqrt(k))


@pytest.mark.parametrize("m,real", [(32, 24), (64, 1), (200, 131), (8, 0), (6, 6)])
def test_linear_computes_only_the_real_rows(rng, m, real):
    """A padded step passes its real row count: those rows match numpy, the padding rows
    come out zero, whatever garbage x holds there."""
    k, n = 96, 48
    x = rng.standard_normal((m, k), dtype=np.float32)
    x[real:] = np.nan  # padding rows: must not be read into the real ones
    w = rng.standard_normal((2, n, k), dtype=np.float32)
    fn = jax.jit(cpu.linear)
    out = np.asarray(fn(jnp.asarray(x), cpu.pack_panels(jnp.asarray(w)), 1, num_rows=real))
    ref = x[:real].astype(np.float64) @ w[1].astype(np.float64).T
    np.testing.assert_allclose(out[:real], ref, rtol=1e-5, atol=1e-3)
    np.testing.assert_array_equal(out[real:], 0.0)


def test_pack_panels_round_trip_and_layout(rng):
    w = rng.standard_normal((2, 32, 5), dtype=np.float32)
    packed = np.asarray(cpu.pack_panels(jnp.asarray(w)))
    assert packed.shape == w.shape
    # panel p, depth k holds outputs 16p .. 16p + 15 at input k, contiguously
    flat = packed.reshape(2, 2, 5, 16)
    np.testing.assert_array_equal(flat[1, 1, 3], w[1, 16:32, 3])
    np.testing.assert_array_equal(np.asarray(cpu.unpack_panels(jnp.asarray(packed))), w)
    with pytest.raises(ValueError, match="N % 16 == 0"):
        cpu.pack_panels(jnp.zeros((1, 24, 8)))


def test_linear_in_scan_reads_each_layer(rng):
    """Inside lax.scan over layer ids (as the decoder runs it) every layer uses its own weight."""
    layers, d = 4, 64
    w = rng.standard_normal((layers, d, d), dtype=np.float32) / 8
    x = rng.standard_normal((3, d), dtype=np.float32)

    def run(linear, weight):
        def body(h, layer):
            return jnp.tanh(linear(h, weight, layer)), None

        return jax.jit(lambda x: jax.lax.scan(body, x, jnp.arange(layers))[0])(jnp.asarray(x))

    from jaxpaged.models.llama import linear_xla

    np.testing.assert_allclose(
        run(cpu.linear, cpu.pack_panels(jnp.asarray(w))),
        run(linear_xla, jnp.asarray(w)),
        rtol=1e-5,
        atol=1e-5,
    )


def test_linear_rejects_bad_input():
    x = jnp.zeros((2, 8), jnp.float32)
    with pytest.raises(ValueError, match="x \\[M, K\\] and w \\[L, N, K\\]"):
        cpu.linear(x, jnp.zeros((1, 16, 9), jnp.float32), 0)
    with pytest.raises(ValueError, match="N % 16 == 0"):
        cpu.linear(x, jnp.zeros((1, 24, 8), jnp.float32), 0)
    with pytest.raises(ValueError, match="float32/bfloat16"):
        cpu.linear(x, jnp.zeros((1, 16, 8), jnp.float16), 0)
    with pytest.raises(ValueError, match="float32/bfloat16"):
        cpu.linear(x.astype(jnp.float16), jnp.zeros((1, 16, 8), jnp.float32), 0)


@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 7), (32, 49152), (5, 1000), (17, 33), (2, 40)])
def test_argmax_matches_jnp(rng, rows, vocab):
    """Row-wise argmax against jnp.argmax on random logits, with planted ties (the first
    index wins) in vector bodies and scalar tails alike."""
    x = rng.standard_normal((rows, vocab), dtype=np.float32)
    for r in range(rows):  # tie the maximum at two random places, the later one planted too
        a, b = np.sort(rng.integers(0, vocab, 2))
        x[r, a] = x[r, b] = x[r].max() + 1.0
    got = np.asarray(jax.jit(cpu.argmax)(jnp.asarray(x)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))


def test_argmax_nan_and_infinite_rows_match_jnp(rng):
    """NaN counts as the maximum (the first NaN wins), all -inf rows give 0, +inf beats
    any finite value: jnp.argmax's answers."""
    x = rng.standard_normal((6, 100), dtype=np.float32)
    x[0, 77] = np.nan
    x[1, [3, 90]] = np.nan
    x[2] = -np.inf
    x[3, [10, 60]] = np.inf
    x[4, 99] = np.nan  # in the scalar tail (100 = 3 * 32 + 4)
    x[5, 0] = np.nan
    got = np.asarray(jax.jit(cpu.argmax)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
    np.testing.assert_array_equal(got, [77, 3, 0, 10, 99, 0])


def test_argmax_rejects_bad_input():
    with pytest.raises(ValueError, match="x \\[R, V\\]"):
        cpu.argmax(jnp.zeros((4,), jnp.float32))
    with pytest.raises(ValueError, match="float32"):
        cpu.argmax(jnp.zeros((2, 8), jnp.bfloat16))


def check_fused(rng, m, real, k, n, **fused):
    """cpu.linear with a residual and the ``fused`` pre-op (``norm=`` or ``silu_gate=``, each
    a function of the rng giving the argument and its float64 action on x) against float64
    numpy: the real rows match, the padding rows carry the residual's rows through (a skipped
    layer's identity), whatever x holds there."""
    x = rng.standard_normal((m, k), dtype=np.float32) * 3.0
    x[real:] = np.nan  # padding rows: must not be read into the real ones
    w = rng.standard_normal((2, n, k), dtype=np.float32)
    res = rng.standard_normal((m, n), dtype=np.float32)
    kwargs, act = {}, x[:real].astype(np.float64)
    for name, make in fused.items():
        kwargs[name], action = make(rng)
        act = action(act)
    fn = jax.jit(lambda x, w, r: cpu.linear(x, w, 1, num_rows=real, residual=r, **kwargs))
    out = np.asarray(fn(jnp.asarray(x), cpu.pack_panels(jnp.asarray(w)), jnp.asarray(res)))
    ref = res[:real] + act @ w[1].astype(np.float64).T
    np.testing.assert_allclose(out[:real], ref, rtol=1e-5, atol=1e-4 * np.sqrt(k))
    np.testing.assert_array_equal(out[real:], res[real:])


@pytest.mark.parametrize("m,real", [(1, 1), (7, 7), (32, 24), (200, 131), (8, 0)])
@pytest.mark.parametrize("k,n", [(576, 960), (13, 16)])  # several slices; one short slice
def test_linear_adds_the_residual(rng, m, real, k, n):
    check_fused(rng, m, real, k, n)


def test_linear_rejects_a_residual_of_the_wrong_shape():
    x = jnp.zeros((2, 8), jnp.float32)
    w = jnp.zeros((1, 16, 8), jnp.float32)
    with pytest.raises(ValueError, match="residual must be \\(2, 16\\)"):
        cpu.linear(x, w, 0, residual=jnp.zeros((2, 8), jnp.float32))


@pytest.mark.parametrize("m,real", [(1, 1), (7, 7), (32, 24), (200, 131)])
@pytest.mark.parametrize("k,n", [(576, 960), (13, 16)])
def test_linear_normalizes_x_first(rng, m, real, k, n):
    """norm=(weight, eps): weight * x / rms(x) per row, then the product."""

    def norm(rng):
        g, eps = rng.standard_normal(k, dtype=np.float32), 1e-5
        return (
            jnp.asarray(g),
            eps,
        ), lambda x: g * x / np.sqrt(np.mean(x**2, -1, keepdims=True) + eps)

    check_fused(rng, m, real, k, n, norm=norm)


def test_linear_rejects_a_norm_weight_of_the_wrong_shape():
    x = jnp.zeros((2, 8), jnp.float32)
    with pytest.raises(ValueError, match="norm weight must be \\[8\\]"):
        cpu.linear(x, jnp.zeros((1, 16, 8), jnp.float32), 0, norm=(jnp.ones(16), 1e-6))


@pytest.mark.parametrize("m,real", [(1, 1), (7, 7), (32, 24)])
@pytest.mark.parametrize("k,n", [(1536, 576), (13, 16)])  # vector body; scalar tail only
def test_linear_applies_the_silu_gate_first(rng, m, real, k, n):
    """silu_gate=g: (silu(g) * x) @ w.T, a SwiGLU MLP's down projection; gates span the exp's
    clamp (+-88) and beyond."""

    def gate(rng):
        g = rng.standard_normal((m, k), dtype=np.float32) * 4.0
        g[0, :4] = [-100.0, 100.0, -88.5, 88.5]
        g64 = g[:real].astype(np.float64)
        return jnp.asarray(g), lambda x: g64 / (1.0 + np.exp(-g64)) * x

    check_fused(rng, m, real, k, n, silu_gate=gate)


def test_linear_rejects_a_silu_gate_of_the_wrong_shape():
    x = jnp.zeros((2, 8), jnp.float32)
    with pytest.raises(ValueError, match="silu_gate must be \\(2, 8\\)"):
        cpu.linear(x, jnp.zeros((1, 16, 8), jnp.float32), 0, silu_gate=jnp.zeros((2, 16)))


def test_silu_gate_is_accurate_elementwise(rng):
    """Through an identity weight the output is silu(g) itself: within a few float32 ulps
    of float64 over [-90, 90] (the vector exp is a polynomial, not libm's). Below -88.4 the
    exp saturates, so silu's ~1e-37 values there are only absolutely close."""
    k = 16
    g = np.concatenate([np.linspace(-90, 90, 4000), rng.standard_normal(4000) * 3])
    g = g.astype(np.float32).reshape(-1, k)
    eye = cpu.pack_panels(jnp.eye(k, dtype=jnp.float32)[None])
    out = np.asarray(jax.jit(lambda g: cpu.linear(jnp.ones_like(g), eye, 0, silu_gate=g))(g))
    g64 = g.astype(np.float64)
    np.testing.assert_allclose(out, g64 / (1.0 + np.exp(-g64)), rtol=4e-7, atol=1e-35)
