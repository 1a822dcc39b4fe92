"""Weight-only quantization: the formats against numpy, the native int8 matmul against the
jnp reference over the dequantized weight, and whole models (XLA and native) against their
dequantized float twins."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxpaged.kernels import cpu
from jaxpaged.kernels.cpu.linear_q8 import linear_q8, pack_panels_q8, unpack_panels_q8
from jaxpaged.models.layers import rms_norm
from jaxpaged.models.linear import map_matmul_weights
from jaxpaged.models.llama import LINEARS, compute_logits, forward, linear_xla
from jaxpaged.models.quant import QuantizedWeight, is_quantized, quantize_array, quantize_params
from jaxpaged.models.testing import random_params, tiny_config

pytestmark = pytest.mark.skipif(not cpu.available(), reason="native CPU kernels did not build")


def _dequantized(params):
    return jax.tree.map(
        lambda w: w.dequantize(np.float32) if isinstance(w, QuantizedWeight) else w,
        params,
        is_leaf=lambda w: isinstance(w, QuantizedWeight),
    )


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantize_array_per_output_channel(method):
    rng = np.random.default_rng(1)
    w = rng.normal(0, 1, (3, 5, 4, 7)).astype(np.float32) * rng.uniform(0.01, 10, (3, 5, 1, 1))
    q = quantize_array(w, 2, method)  # the last two axes are contracted
    assert q.values.shape == w.shape and q.scales.shape == (3, 5, 1, 1)
    assert q.values.dtype == (np.int8 if method == "int8" else ml_dtypes.float8_e4m3fn)
    absmax = np.abs(w).max(axis=(2, 3), keepdims=True)
    top = 127.0 if method == "int8" else 448.0
    np.testing.assert_allclose(q.scales, absmax / top, rtol=1e-6)
    # each channel's largest weight maps to the format's largest value
    np.testing.assert_array_equal(np.abs(q.values.astype(np.float32)).max(axis=(2, 3)), top)
    err = np.abs(q.dequantize(np.float32) - w)
    if method == "int8":  # rounding to the nearest step
        assert np.all(err <= q.scales / 2 * (1 + 1e-5))
    else:  # e4m3: 3 mantissa bits, relative error <= 2^-4 above the subnormals
        assert np.all(err <= np.maximum(np.abs(w) / 16, q.scales * 2.0**-9) * (1 + 1e-5))


def test_quantized_weight_views_index_like_the_float_leaf():
    rng = np.random.default_rng(2)
    w = rng.normal(0, 1, (2, 6, 3, 2, 4)).astype(np.float32)  # like wo [L, D, Hkv, G, hd]
    q = quantize_array(w, 3, "int8")
    view = q.reshape(2, 6, -1)  # linear_fn's [L, N, K]
    assert view.shape == (2, 6, 24) and view.scales.shape == (2, 6, 1)
    np.testing.assert_array_equal(view.dequantize(), q.dequantize().reshape(2, 6, 24))
    back = view.reshape(q.shape)
    assert back.scales.shape == q.scales.shape
    np.testing.assert_array_equal(back[1].dequantize(), q.dequantize()[1])
    with pytest.raises(ValueError, match="not one of"):
        quantize_array(w, 1, "int4")


@pytest.mark.parametrize(
    "m,real,k,n",
    [(1, 1, 64, 32), (2, 2, 64, 16), (32, 29, 576, 48), (7, 7, 130, 16), (33, 33, 192, 32),
     (100, 97, 258, 64)],
)  # fmt: skip
def test_linear_q8_matches_the_dequantized_reference(m, real, k, n):
    """Fresh random weights, x, gate, norm and residual; padding rows get the residual."""
    rng = np.random.default_rng(m * k + n)
    layers = 3
    w = rng.normal(0, 1, (layers, n, k)).astype(np.float32)
    q = jax.tree.map(jnp.asarray, quantize_array(w, 1, "int8"))
    packed = pack_panels_q8(q)
    np.testing.assert_array_equal(np.asarray(unpack_panels_q8(packed).values), q.values)
    x, gate = (jnp.asarray(rng.normal(0, 1, (m, k)), jnp.float32) for _ in range(2))
    residual = jnp.asarray(rng.normal(0, 1, (m, n)), jnp.float32)
    norm_w = jnp.asarray(rng.normal(0, 1, (k,)), jnp.float32)
    fn = jax.jit(
        lambda x, w, g, r, nw, layer: linear_q8(
            x, w, layer, num_rows=real, residual=r, norm=(nw, 1e-5), silu_gate=g
        )
    )
    deq = q.dequantize()
    for layer in range(layers):
        got = np.asarray(fn(x, packed, gate, residual, norm_w, layer))
        want = residual + rms_norm(jax.nn.silu(gate) * x, norm_w, 1e-5) @ deq[layer].T
        # up to two rows, x is rounded to int16 per row: 2^-15 of the row's largest value
        scale = np.abs(want[:real]).max()
        np.testing.assert_allclose(got[:real], want[:real], atol=5e-4 * scale, rtol=0)
        np.testing.assert_array_equal(got[real:], np.asarray(residual)[real:])
    plain = jax.jit(lambda x, w: linear_q8(x, w, 1))(x, packed)
    np.testing.assert_allclose(plain, x @ deq[1].T, atol=5e-4 * np.abs(plain).max(), rtol=0)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantized_model_matches_its_dequantized_twin(tied, method):
    """The decoder and the logits over quantized params (XLA dequant matmuls) against the
    same model over the dequantized float weights; for int8 also the native kernel."""
    cfg = tiny_config(tie_word_embeddings=tied)
    floats = random_params(cfg, seed=3, scale=0.2)
    params = quantize_params(floats, cfg, method)
    assert is_quantized(params) and isinstance(params["layers"]["w_down"], QuantizedWeight)
    if method == "int8":  # the vocabulary projection too; a tied table stays for the lookup
        assert isinstance(params["lm_head"], QuantizedWeight)
    else:  # fp8 leaves the vocabulary projection float, as vLLM does: lm_head or the table
        assert ("lm_head" in params) == (not tied)
        head = "embed" if tied else "lm_head"
        np.testing.assert_array_equal(np.asarray(params[head]), np.asarray(floats[head]))
    tokens = jax.random.randint(jax.random.key(4), (9,), 0, cfg.vocab_size)
    positions = jnp.arange(9, dtype=jnp.int32)

    def run(p, linear_fn, logits_fn):
        hidden, _ = forward(p, tokens, positions, config=cfg, linear_fn=linear_fn)
        return compute_logits(p, hidden, config=cfg, linear_fn=logits_fn)

    on_device = jax.tree.map(jnp.asarray, params)
    want = jax.jit(lambda p: run(p, None, None))(jax.tree.map(jnp.asarray, _dequantized(params)))
    got = jax.jit(lambda p: run(p, linear_xla, None))(on_device)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    if method == "int8":  # as CPU serving picks the kernels: every matmul in linear_q8
        from jaxpaged.kernels.cpu.backend import CpuBackend

        weight_map = lambda p, fn: map_matmul_weights(p, LINEARS, fn)  # noqa: E731
        backend = CpuBackend.select(on_device, weight_map, attention_backend="cpu", sharded=False)
        assert backend.native_linear and backend.int8_weights
        packed = backend.pack_weights(on_device, weight_map)
        linear = backend.kernels.linear
        native = jax.jit(lambda p: run(p, linear, linear))(packed)
        np.testing.assert_allclose(native, want, rtol=0, atol=2e-3 * np.abs(want).max())


def test_engine_quantizes_and_picks_the_int8_kernel():
    """LLMEngine(quantization="int8") runs the native int8 matmul over q8 panels and decodes
    greedily as the dequantized float model does."""
    from jaxpaged import SamplingParams
    from jaxpaged.engine import LLMEngine

    cfg = tiny_config(max_position_embeddings=64)
    params = random_params(cfg, seed=5, scale=0.5)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def greedy(p, **kw):
        engine = LLMEngine.from_params(
            cfg, p, max_num_seqs=2, num_kv_blocks=16, block_size=8, enforce_eager=True,
            show_progress=False, **kw,
        )  # fmt: skip
        try:
            engine.add_request("r", [3, 1, 4, 1, 5], sp)
            out = None
            while engine.has_unfinished_requests():
                for o in engine.step():
                    out = o.outputs[0].token_ids if o.finished else out
            return engine.runner.kernels, list(out)
        finally:
            engine.close()

    kernels, int8 = greedy(params, quantization="int8")
    assert kernels.linear is linear_q8
    _, ref = greedy(_dequantized(quantize_params(params, cfg, "int8")))
    assert int8 == ref
    with pytest.raises(ValueError, match="quantization"):
        LLMEngine.from_params(cfg, params, quantization="int4")


@pytest.mark.parametrize("method,name", [("bitsandbytes", "bitsandbytes"), ("marlin", "Marlin")])
def test_prequantized_checkpoints_are_refused_by_format(tmp_path, method, name):
    """A checkpoint whose config.json carries a quantization_config is refused before any
    tensor is read (its packed tensors read as floats would be garbage)."""
    import json

    from jaxpaged.models.loader import load_model

    config = {"model_type": "llama", "quantization_config": {"quant_method": method, "bits": 4}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"pre-quantized \\({name}"):
        load_model(str(tmp_path), progress=False)


def test_quantization_setting_is_checked():
    from jaxpaged.args import QUANTIZATIONS, EngineArgs
    from jaxpaged.models.quant import QUANTIZATIONS as METHODS_APPLIED

    assert QUANTIZATIONS == METHODS_APPLIED
    assert EngineArgs(quantization="fp8").quantization == "fp8"
    with pytest.raises(ValueError, match="quantization: 'int4' is not one of int8, fp8"):
        EngineArgs(quantization="int4")
    # every family declares its matmul weights (tests/quant/test_family_quant.py); a model
    # of your own declares none
    with pytest.raises(ValueError, match="a model of your own declares none"):
        quantize_params(random_params(tiny_config()), tiny_config(model_type="custom"), "int8")
