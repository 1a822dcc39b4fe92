"""AWQ and GPTQ 4-bit checkpoints, written here by packers that follow the formats' published
layouts (checkpoint_writers.py): their weights read into GroupedWeight equal the formats'
own formula (q - zero) * scale, and whole models equal transformers running the same
dequantized weights."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from checkpoint_writers import (
    TINY,
    VOCAB,
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


def test_gptq_act_order_is_refused():
    q, zeros, scales = quantize_4bit(_random(8, 64, 0), 32)
    t = pack_gptq(q, zeros, scales, 32)
    perm = np.random.default_rng(1).permutation(64)
    with pytest.raises(ValueError, match="act-order \\(desc_act\\)"):
        gptq_weight(t["qweight"], t["qzeros"], t["scales"], t["g_idx"][perm], 32, zero_offset=1)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gptq_awq")
    out = {}
    for fmt in ("awq", "gptq"):
        out[fmt] = (root / fmt, write_4bit_checkpoint(root / fmt, fmt))
        write_tokenizer(root / fmt)
    return out


def _transformers(reference: dict) -> transformers.PreTrainedModel:
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in reference.items()})
    return model


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_logits_equal_transformers_on_the_dequantized_weights(checkpoints, fmt):
    folder, reference = checkpoints[fmt]
    config, params = load_model(folder, progress=False)
    for name in ("wqkv", "wo", "w_gate_up", "w_down"):
        leaf = params["layers"][name]
        assert isinstance(leaf, GroupedWeight) and leaf.bits == 4 and leaf.group_size == 32
    ids = np.random.default_rng(5).integers(0, VOCAB, 20).astype(np.int32)
    hidden, _ = forward(params, ids, np.arange(len(ids)), config=config)
    got = np.asarray(compute_logits(params, hidden, config=config))
    with torch.no_grad():
        want = _transformers(reference)(torch.tensor(ids[None].astype(np.int64))).logits[0]
    np.testing.assert_allclose(got, want.numpy(), atol=2e-5, rtol=1e-5)


def test_engine_greedy_equals_transformers(checkpoints):
    """quantization unset: config.json's quantization_config (GPTQ) decides."""
    folder, reference = checkpoints["gptq"]
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
