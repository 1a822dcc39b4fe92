"""AWQ and GPTQ 4-bit checkpoints, written here by packers that follow the formats' published
layouts (checkpoint_writers.py): their weights read into GroupedWeight equal the formats'
own formula (q - zero) * scale, and whole models equal transformers running the same
dequantized weights."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from checkpoint_writers import (
    TINY,
    VOCAB,
    act_order_g_idx,
    dequantize_4bit,
    pack_awq,
    pack_gptq,
    quantize_4bit,
    write_4bit_checkpoint,
    write_tokenizer,
)

from jaxpaged import LLM, SamplingParams
from jaxpaged.models.llama import compute_logits, forward
from jaxpaged.models.loader import load_model
from jaxpaged.models.quant import GroupedWeight
from jaxpaged.models.quant.gptq_awq import awq_weight, gptq_weight

SHAPES = [(8, 64, 32), (24, 96, 32), (16, 128, 128), (40, 64, 64)]  # (N, K, group)


def _random(n: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.normal(0, 1, (n, k)) * rng.uniform(0.01, 3, (n, 1))).astype(np.float32)


@pytest.mark.parametrize("n,k,group", SHAPES)
@pytest.mark.parametrize("fmt", ["awq", "gptq", "gptq_v2"])
def test_weights_dequantize_to_the_formats_formula(fmt, n, k, group):
    q, zeros, scales = quantize_4bit(_random(n, k, n * k + group), group)
    want = dequantize_4bit(q, zeros, scales, group)
    if fmt == "awq":
        w = awq_weight(**pack_awq(q, zeros, scales), group_size=group)
    else:
        t = pack_gptq(q, zeros, scales, group, v1=fmt == "gptq")
        w = gptq_weight(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], group,
                        zero_offset=1 if fmt == "gptq" else 0)  # fmt: skip
    assert isinstance(w, GroupedWeight) and w.shape == (n, k) and w.group_size == group
    np.testing.assert_array_equal(w.q(), q)  # the stored integers, not a float round trip
    np.testing.assert_allclose(w.dequantize(np.float32), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n,k,group", [(8, 64, 32), (24, 128, 32), (16, 256, 64)])
def test_gptq_act_order_dequantizes_by_g_idx(n, k, group):
    """desc_act: the groups are g_idx's sets of inputs, not runs of G. The weight stays 4-bit
    with g_idx, and equals (q[k] - z[g_idx[k]]) * s[g_idx[k]] written out per element; the
    XLA matmul over it equals x @ that weight."""
    from jaxpaged.models.quant.matmul import quantized_matmul

    rng = np.random.default_rng(n + k)
    g_idx = act_order_g_idx(k, group, rng)
    assert not np.array_equal(g_idx, np.arange(k) // group)
    q = rng.integers(0, 16, (n, k)).astype(np.uint8)
    zeros = rng.integers(1, 16, (n, k // group)).astype(np.uint8)
    scales = rng.uniform(0.001, 0.1, (n, k // group)).astype(np.float16)
    t = pack_gptq(q, zeros, scales, group, g_idx=g_idx)
    w = gptq_weight(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], group, zero_offset=1)
    assert w.bits == 4 and w.values.dtype == np.uint8 and w.values.shape == (n, k // 2)
    np.testing.assert_array_equal(w.q(), q)
    want = np.empty((n, k), np.float32)
    for row in range(n):
        for col in range(k):
            grp = g_idx[col]
            want[row, col] = (float(q[row, col]) - float(zeros[row, grp])) * float(scales[row, grp])
    np.testing.assert_allclose(w.dequantize(np.float32), want, rtol=1e-6, atol=1e-7)
    x = rng.normal(0, 1, (5, k)).astype(np.float32)
    on_device = jax.tree.map(jnp.asarray, w)
    got = np.asarray(jax.jit(quantized_matmul)(jnp.asarray(x), on_device))
    np.testing.assert_allclose(got, x @ want.T, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="outside the"):
        bad = t["g_idx"].copy()
        bad[0] = k // group
        gptq_weight(t["qweight"], t["qzeros"], t["scales"], bad, group, zero_offset=1)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gptq_awq")
    out = {}
    for fmt in ("awq", "gptq", "gptq-act"):
        act_order = fmt == "gptq-act"
        written = write_4bit_checkpoint(root / fmt, fmt.removesuffix("-act"), act_order=act_order)
        out[fmt] = (root / fmt, written)
        write_tokenizer(root / fmt)
    return out


def _transformers(reference: dict) -> transformers.PreTrainedModel:
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in reference.items()})
    return model


@pytest.mark.parametrize("fmt", ["awq", "gptq", "gptq-act"])
def test_logits_equal_transformers_on_the_dequantized_weights(checkpoints, fmt):
    folder, reference = checkpoints[fmt]
    config, params = load_model(folder, progress=False)
    for name in ("wqkv", "wo", "w_gate_up", "w_down"):
        leaf = params["layers"][name]
        assert isinstance(leaf, GroupedWeight) and leaf.bits == 4 and leaf.group_size == 32
        assert (leaf.g_idx is not None) == (fmt == "gptq-act"), name  # one row per layer
        assert leaf.g_idx is None or leaf.g_idx.shape[0] == config.num_layers
    ids = np.random.default_rng(5).integers(0, VOCAB, 20).astype(np.int32)
    hidden, _ = forward(params, ids, np.arange(len(ids)), config=config)
    got = np.asarray(compute_logits(params, hidden, config=config))
    with torch.no_grad():
        want = _transformers(reference)(torch.tensor(ids[None].astype(np.int64))).logits[0]
    np.testing.assert_allclose(got, want.numpy(), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt", ["gptq", "gptq-act"])
def test_engine_greedy_equals_transformers(checkpoints, fmt):
    """quantization unset: config.json's quantization_config (GPTQ) decides; act-order runs
    XLA's dequantize-then-dot (the native 4-bit kernel reads consecutive groups only)."""
    folder, reference = checkpoints[fmt]
    prompt = [5, 9, 2, 7, 30, 11]
    with torch.no_grad():
        out = _transformers(reference).generate(torch.tensor([prompt]), max_new_tokens=6,
                                                do_sample=False, eos_token_id=None,
                                                pad_token_id=0)  # fmt: skip
    llm = LLM(str(folder), max_model_len=32, max_num_seqs=1, num_kv_blocks=8, block_size=8,
              enforce_eager=True, show_progress=False)  # fmt: skip
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        got = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
        assert list(got) == out[0, len(prompt) :].tolist()
    finally:
        llm.engine.close()


@pytest.mark.parametrize(
    "edit,match",
    [
        ({"bits": 8}, r"\(GPTQ\): bits=8 is not supported"),
        ({"checkpoint_format": "marlin"}, r"checkpoint_format='marlin' is not supported"),
        ({"quant_method": "awq", "version": "gemv"}, r"\(AWQ\): version='gemv'"),
    ],
)
def test_unsupported_variants_are_refused(checkpoints, tmp_path, edit, match):
    config = json.loads((checkpoints["gptq"][0] / "config.json").read_text())
    config["quantization_config"].update(edit)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        load_model(tmp_path, progress=False)


def test_explicit_quantization_must_agree(checkpoints):
    folder, _ = checkpoints["awq"]
    with pytest.raises(ValueError, match="quantization='gptq' disagrees.*AWQ int4"):
        load_model(folder, progress=False, quantization="gptq")
    with pytest.raises(ValueError, match="quantization='int8' disagrees"):
        load_model(folder, progress=False, quantization="int8")
    _, params = load_model(folder, progress=False, quantization="awq")
    assert isinstance(params["layers"]["wo"], GroupedWeight)
