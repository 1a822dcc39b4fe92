"""8-bit KV pools (int8, float8_e4m3fn with per-(token, head) scales): the writer's
quantization, and every backend's attention over a quantized pool against the jnp reference
over the same pool dequantized in numpy (fresh random inputs, several shapes)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxpaged.kernels import cpu, ragged_paged_attention
from jaxpaged.kernels.kv_quant import quantize_rows
from jaxpaged.kernels.pallas_gpu import ragged_paged_attention_pallas
from jaxpaged.kernels.pool_format import PoolFormat
from jaxpaged.kernels.testing import make_case, mixed_seqs, rel_err
from jaxpaged.kernels.write_kv import write_kv_quantized

NP_DTYPES = {"int8": np.int8, "fp8": ml_dtypes.float8_e4m3fn}
QMAX = {"int8": 127.0, "fp8": 448.0}


def np_quantize(x: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """Independent numpy quantizer: [..., H, D] float -> (8-bit values, float32 [..., H])."""
    x = x.astype(np.float32)
    scale = np.abs(x).max(axis=-1) / QMAX[kind]
    y = x / np.where(scale > 0, scale, 1.0)[..., None]
    y = np.clip(np.round(y) if kind == "int8" else y, -QMAX[kind], QMAX[kind])
    return y.astype(NP_DTYPES[kind]), scale.astype(np.float32)


def np_dequantize(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return q.astype(np.float32) * scale[..., None]


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_write_quantized_rows_and_scales(rng, kind):
    """Rows land at their slots quantized (error within half a step of the row's scale for
    int8, fp8's relative precision otherwise), scales beside them; padding writes nothing."""
    nb, bs, h, d, t = 5, 8, 3, 16, 11
    dtype = jnp.dtype(NP_DTYPES[kind])
    poison_pages = np.full((nb, bs, h, d), 7, dtype=NP_DTYPES[kind])
    poison_scales = np.full((nb, bs, h), -1.0, np.float32)
    pool = tuple(map(jnp.asarray, (poison_pages, poison_pages, poison_scales, poison_scales)))
    k = rng.standard_normal((t, h, d)).astype(np.float32) * rng.uniform(0.1, 10, (t, h, 1))
    v = rng.standard_normal((t, h, d)).astype(np.float32)
    k[3, 1] = 0.0  # a zero row: scale 0, values 0
    slots = rng.permutation(nb * bs)[:t].astype(np.int32)
    slots[[2, 7]] = -1
    out = jax.jit(write_kv_quantized)(pool, jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots))
    kp, vp, ks, vs = (np.asarray(a) for a in out)
    assert kp.dtype == dtype and ks.dtype == np.float32 and ks.shape == (nb, bs, h)
    written = np.zeros(nb * bs, bool)
    for rows, pages, scales in ((k, kp, ks), (v, vp, vs)):
        flat_p, flat_s = pages.reshape(nb * bs, h, d), scales.reshape(nb * bs, h)
        for i, slot in enumerate(slots):
            if slot < 0:
                continue
            written[slot] = True
            want_q, want_s = np_quantize(rows[i], kind)
            np.testing.assert_allclose(flat_s[slot], want_s, rtol=1e-6)
            got = np_dequantize(flat_p[slot], flat_s[slot])
            amax = np.abs(rows[i]).max(axis=-1, keepdims=True)
            bound = amax / 254 * 1.001 if kind == "int8" else np.abs(rows[i]) / 16 + amax / 448
            assert np.all(np.abs(got - rows[i]) <= bound + 1e-7)
        untouched = ~written
        assert np.all(flat_p[untouched].astype(np.float32) == 7)
        assert np.all(flat_s[untouched] == -1.0)
    assert np.all(np.asarray(out[0]).reshape(nb * bs, h, d)[slots[3], 1].astype(np.float32) == 0)


def quantized_case(rng, seqs, kind, *, hq, hkv, d, bs, max_seqs=None):
    """A random case with its pools quantized in numpy: (case, args over the 8-bit pools
    with scales, args over the same pools dequantized to float32)."""
    case = make_case(
        rng, seqs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
        max_seqs=max_seqs, pad_tokens=3,
    )  # fmt: skip
    kq, ks = np_quantize(case.k_pages, kind)
    vq, vs = np_quantize(case.v_pages, kind)
    meta = (case.kv_lens, case.block_tables, case.cu_q_lens, case.num_seqs)
    quant = tuple(map(jnp.asarray, (case.q, kq, vq, *meta)))
    scales = dict(k_scales=jnp.asarray(ks), v_scales=jnp.asarray(vs))
    floats = tuple(map(jnp.asarray, (case.q, np_dequantize(kq, ks), np_dequantize(vq, vs), *meta)))
    return case, quant, scales, floats


SHAPES = [  # head_dim, block_size, Hq, Hkv, sliding_window, soft_cap
    (64, 16, 9, 3, None, None),  # SmolLM2
    (128, 8, 8, 2, 13, None),
    (64, 32, 4, 4, None, 5.0),
    (32, 16, 16, 2, None, None),  # group of 8
]


def check_backend(rng, backend, kind, shape, *, tol=1e-5, seqs=None, **extra):
    d, bs, hq, hkv, window, cap = shape
    seqs = seqs or mixed_seqs(rng, bs, n=6)
    case, quant, scales, floats = quantized_case(rng, seqs, kind, hq=hq, hkv=hkv, d=d, bs=bs,
                                                 max_seqs=len(seqs) + 1)  # fmt: skip
    opts = dict(sm_scale=case.sm_scale, sliding_window=window, soft_cap=cap)
    ref = ragged_paged_attention(*floats, **opts, backend="reference")
    out = ragged_paged_attention(*quant, **opts, **scales, backend=backend, **extra)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    total = sum(q for q, _ in seqs)
    err = rel_err(np.asarray(out)[:total], np.asarray(ref)[:total])
    assert err < tol, f"{backend}/{kind}: rel err {err} for {seqs}"
    assert np.all(np.asarray(out)[total:] == 0.0), "padding rows not zero"


def shape_id(s):
    return "d{}_bs{}_hq{}_hkv{}".format(*s[:4])


def test_reference_and_xla_read_quantized_pool(rng):
    """One shape (each XLA compile of these costs seconds here); the dequantization is the
    same code for both 8-bit dtypes."""
    seqs = mixed_seqs(rng, 16, n=6)
    check_backend(rng, "reference", "int8", SHAPES[0], seqs=seqs)
    check_backend(rng, "xla", "fp8", SHAPES[0], seqs=seqs)


@pytest.mark.skipif(not cpu.available(), reason="no C++ compiler for the native kernel")
@pytest.mark.parametrize(
    "kind,shape", [("int8", SHAPES[0]), ("fp8", SHAPES[1]), ("int8", SHAPES[3])], ids=str
)
def test_cpu_reads_quantized_pool(rng, kind, shape):
    """The native kernel's vector path (groups <= 8, head_dim % 8 == 0) over 8-bit pools."""
    check_backend(rng, "cpu", kind, shape)


@pytest.mark.skipif(not cpu.available(), reason="no C++ compiler for the native kernel")
def test_cpu_scalar_path_reads_quantized_pool(rng):
    """A GQA group of 16 and head_dim 36: the scalar loops, prefill tiles included."""
    check_backend(rng, "cpu", "fp8", (36, 8, 16, 1, 11, 5.0))


def test_pallas_interpret_reads_quantized_pool(rng):
    """The Pallas decode kernel (interpret mode: NaN-poisoned outputs) dequantizes after each
    K/V tile load. Decode rows only, as interpret mode is slow on CPU; the prefill kernel
    shares the tile loop (_stream_kv) and its lowering is checked below."""
    seqs = [(1, int(rng.integers(1, 70))) for _ in range(3)]
    check_backend(rng, "pallas", "fp8", (64, 16, 4, 2, 29, None), seqs=seqs, interpret=True,
                  max_q_len=1)  # fmt: skip


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_pallas_quantized_lowers_to_triton(kind):
    """Both Pallas kernels over an 8-bit pool pass the Pallas->Triton lowering on a CPU."""
    from tests.kernels.test_pallas import _lower_for_gpu

    t, nb, bs, s, p, hq, hkv, d = 50, 250, 16, 7, 33, 9, 3, 64
    args = [
        jax.ShapeDtypeStruct(shape, dtype)
        for shape, dtype in [
            ((t, hq, d), jnp.bfloat16),
            ((nb, bs, hkv, d), NP_DTYPES[kind]),
            ((nb, bs, hkv, d), NP_DTYPES[kind]),
            ((s,), jnp.int32),
            ((s, p), jnp.int32),
            ((s + 1,), jnp.int32),
            ((1,), jnp.int32),
            ((nb, bs, hkv), jnp.float32),
            ((nb, bs, hkv), jnp.float32),
        ]
    ]

    def fn(*a):
        return ragged_paged_attention_pallas(
            *a[:7], sm_scale=0.1, sliding_window=100, k_scales=a[7], v_scales=a[8]
        )

    text = _lower_for_gpu(fn, *args)
    assert text.count("triton") >= 2, "expected both Triton kernels in the module"


def test_quantized_pool_needs_its_scales(rng):
    case, quant, scales, floats = quantized_case(rng, [(1, 5)], "int8", hq=2, hkv=1, d=8, bs=4)
    with pytest.raises(ValueError, match="needs k_scales"):
        ragged_paged_attention(*quant, sm_scale=1.0)
    with pytest.raises(ValueError, match="go with an int8"):
        ragged_paged_attention(*floats, sm_scale=1.0, **scales)
    with pytest.raises(ValueError, match="k_scales must be float32"):
        bad = dict(scales, k_scales=scales["k_scales"][:, :2])
        ragged_paged_attention(*quant, sm_scale=1.0, **bad)


def test_tpu_backend_refuses_quantized_pool():
    with pytest.raises(ValueError, match="'tpu' attention backend cannot read"):
        PoolFormat(combined=True, quantized=True)


def test_quantize_rows_matches_numpy(rng):
    x = rng.standard_normal((7, 3, 32)).astype(np.float32) * 5
    for kind in ("int8", "fp8"):
        q, s = quantize_rows(jnp.asarray(x), NP_DTYPES[kind])
        want_q, want_s = np_quantize(x, kind)
        np.testing.assert_allclose(np.asarray(s), want_s, rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(q).astype(np.float32), want_q.astype(np.float32))
