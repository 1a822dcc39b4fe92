"""GGUF kept quantized (models/gguf_quant.py, models/gguf_params.py): every supported block
type against the gguf package's own float expansion, and the bundled SmolLM2 (Q4_1 layers,
Q8_0 embedding) loaded quantized against its float import, and run as CPU serving runs it."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

from jaxpaged.models import load_tokenizer
from jaxpaged.models.gguf_quant import KEPT_QUANTIZED_TYPES, grouped_from_blocks
from jaxpaged.models.loader import load_model
from jaxpaged.models.quant import GroupedWeight, weight_bytes
from jaxpaged.models.quant.quality import sequence_logits

TEXT = Path(__file__).parents[2] / "docs" / "architecture.md"


def _blocks(name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """GGUF bytes of a random [rows, cols] tensor of type ``name``: quantized by the gguf
    package where it can, else random blocks with finite float16 scales."""
    qtype = GGMLQuantizationType[name]
    if name in ("Q8_0", "Q5_0", "Q4_0", "Q4_1"):
        return quantize(rng.normal(0, 1, (rows, cols)).astype(np.float32), qtype)
    block, nbytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, nbytes), dtype=np.uint8)
    if name == "Q4_K":  # d, dmin
        raw[..., 0:4] = (
            rng.uniform(1e-3, 0.1, (rows, cols // block, 2)).astype(np.float16).view(np.uint8)
        )
    else:  # Q6_K: d last
        raw[..., 208:210] = (
            rng.uniform(-0.1, 0.1, (rows, cols // block, 1)).astype(np.float16).view(np.uint8)
        )
    return raw.reshape(rows, -1)


def _assert_same_numbers(got: np.ndarray, want: np.ndarray, qtype: str) -> None:
    np.testing.assert_array_equal(got, want, err_msg=qtype)  # value for value (+0.0 == -0.0)
    if qtype != "Q4_0":  # and bit for bit; Q4_0's 8 * d + (-8 * d) is +0.0 where gguf's
        # (8 - 8) * d is -0.0 for a negative d
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=qtype)


@pytest.mark.parametrize("qtype", KEPT_QUANTIZED_TYPES)
def test_every_type_dequantizes_to_the_gguf_expansion(qtype):
    rng = np.random.default_rng(len(qtype))
    rows, cols = 6, 512
    raw = _blocks(qtype, rows, cols, rng)
    w = grouped_from_blocks(raw, qtype, rows, cols)
    assert w.shape == (rows, cols)
    assert (w.bits, w.group_size) == {"Q8_0": (8, 32), "Q5_0": (8, 32), "Q6_K": (8, 16)}.get(
        qtype, (4, 32)
    )
    want = dequantize(raw, GGMLQuantizationType[qtype]).reshape(rows, cols)
    _assert_same_numbers(w.dequantize(np.float32), want, qtype)
    with pytest.raises(ValueError, match="whole blocks"):
        grouped_from_blocks(raw, qtype, rows * 2, cols // 2 - 16)
    with pytest.raises(ValueError, match="not kept quantized"):
        grouped_from_blocks(raw, "Q5_K", rows, cols)


@pytest.fixture(scope="module")
def bundled_both(bundled_model_path):
    config, quantized = load_model(bundled_model_path, quantization="gguf", progress=False)
    _, floats = load_model(bundled_model_path, quantization="none", progress=False)
    return config, quantized, floats


def test_bundled_loads_quantized_with_the_float_imports_numbers(bundled_both):
    config, quantized, floats = bundled_both
    is_grouped = lambda x: isinstance(x, GroupedWeight)  # noqa: E731
    kinds = jax.tree.map(lambda x: (x.bits, x.group_size) if is_grouped(x) else None,
                         quantized, is_leaf=is_grouped)  # fmt: skip
    assert kinds["embed"] == (8, 32)  # Q8_0, tied: also the vocabulary projection
    for name in ("wqkv", "wo", "w_gate_up", "w_down"):
        assert kinds["layers"][name] == (4, 32)  # Q4_1
    # model.safetensors is the gguf package's float expansion: the same bits, in layers
    # 0, 14 and 29 of every stacked leaf and the embedding's first 8192 rows
    for path, w in jax.tree_util.tree_flatten_with_path(quantized, is_leaf=is_grouped)[0]:
        name = jax.tree_util.keystr(path)
        want = np.asarray(_at(floats, path))
        if name.startswith("['layers']"):
            picks = [(i, w[i], want[i]) for i in (0, 14, 29)]
        elif name == "['embed']":
            rows = GroupedWeight(w.values[:8192], w.scales[:8192], None, (8192, 576), 32, 8)
            picks = [(0, rows, want[:8192])]
        else:
            picks = [(0, w, want)]
        for i, got, expect in picks:
            got = np.asarray(got.dequantize(np.float32) if is_grouped(got) else got)
            _assert_same_numbers(got, expect, f"{name}[{i}]")
    mb = weight_bytes(quantized) / 1e6
    print(f"bundled weights: {mb:.1f} MB quantized, {weight_bytes(floats) / 1e6:.1f} MB float32")
    assert 100 < mb < 115  # measured 111.6 (538.1 as float32)


def _at(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


def test_bundled_served_quantized_matches_the_float_import(bundled_model_path, bundled_both):
    """As CPU serving runs them: the quantized model in linear_q4 (the CpuBackend's choice),
    the float one in cpu.linear; same argmax at every position of a fixed text."""
    from jaxpaged.kernels.cpu.backend import CpuBackend
    from jaxpaged.models.linear import map_matmul_weights
    from jaxpaged.models.llama import LINEARS

    config, quantized, floats = bundled_both
    ids = load_tokenizer(bundled_model_path)(TEXT.read_text())["input_ids"][:64]
    logits = {}
    for name, params in (("gguf", quantized), ("float", floats)):
        weight_map = lambda p, fn: map_matmul_weights(p, LINEARS, fn)  # noqa: E731
        backend = CpuBackend.select(params, weight_map, attention_backend="cpu", sharded=False)
        assert backend.grouped_weights == (name == "gguf") and backend.native_linear
        packed = backend.pack_weights(params, weight_map)
        logits[name] = sequence_logits(packed, config, ids, linear_fn=backend.kernels.linear)
    np.testing.assert_allclose(logits["gguf"], logits["float"], rtol=1e-3, atol=1e-3)
    assert np.array_equal(logits["gguf"].argmax(-1), logits["float"].argmax(-1))


def test_gguf_quantization_is_refused_where_there_is_nothing_to_keep(tmp_path):
    from jaxpaged.models.quant import quantize_params
    from jaxpaged.models.testing import random_params, tiny_config

    config = tiny_config()
    with pytest.raises(ValueError, match="float params have none"):
        quantize_params(random_params(config), config, "gguf")
    assert quantize_params({"embed": jnp.zeros(2)}, config, "none")["embed"].shape == (2,)
