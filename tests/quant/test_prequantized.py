"""Pre-quantized compressed-tensors checkpoints, produced here by the compressed-tensors
library itself from a tiny random Llama: read as stored (int8 / fp8 values, never through
float), against transformers running the same checkpoint (its compressed-tensors quantizer
decompresses it), and the schemes jaxpaged does not read refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from checkpoint_writers import CT_SCHEMES, TINY, VOCAB, write_compressed_tensors, write_tokenizer
from safetensors import safe_open

from jaxpaged import LLM, SamplingParams
from jaxpaged.models.llama import compute_logits, forward
from jaxpaged.models.loader import load_model
from jaxpaged.models.quant import GroupedWeight, QuantizedWeight


def make_checkpoint(folder: Path, scheme: str, ignore=("lm_head",)) -> Path:
    """A tiny random Llama quantized by compressed-tensors (checkpoint_writers)."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
    write_compressed_tensors(model, folder, scheme, ignore=ignore)
    write_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ct")
    return {name: make_checkpoint(root / name, name) for name in CT_SCHEMES}


def _reference(folder: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _logits(config, params, ids: np.ndarray) -> np.ndarray:
    hidden, _ = forward(params, ids, np.arange(len(ids)), config=config)
    return np.asarray(compute_logits(params, hidden, config=config))


EIGHT_BIT = ["fp8-channel", "fp8-tensor", "int8-packed", "int8-plain"]


@pytest.mark.parametrize("scheme", EIGHT_BIT)
def test_logits_equal_transformers_on_the_same_checkpoint(checkpoints, scheme):
    folder = checkpoints[scheme]
    config, params = load_model(folder, progress=False)
    want_dtype = np.int8 if scheme.startswith("int8") else ml_dtypes.float8_e4m3fn
    for name in ("wqkv", "wo", "w_gate_up", "w_down"):
        leaf = params["layers"][name]
        assert isinstance(leaf, QuantizedWeight) and leaf.dtype == want_dtype, name
    assert not isinstance(params["lm_head"], QuantizedWeight)  # "ignore": lm_head
    # the values are the checkpoint's own (not a float round trip): q_proj of layer 1
    with safe_open(folder / "model.safetensors", "pt") as f:
        prefix = "model.layers.1.self_attn.q_proj."
        if scheme == "int8-packed":
            stored = f.get_tensor(prefix + "weight_packed").numpy().view(np.uint8)
            stored = (stored.astype(np.int16) - 128).astype(np.int8)
        else:
            stored = f.get_tensor(prefix + "weight").view(torch.uint8).numpy()
            stored = stored.view(want_dtype)
        scale = f.get_tensor(prefix + "weight_scale").numpy()
    g, d = config.queries_per_kv, config.hidden_size
    q_rows = np.asarray(params["layers"]["wqkv"].values[1, :, :g]).reshape(-1, d)
    np.testing.assert_array_equal(q_rows.view(np.uint8), stored.view(np.uint8))
    q_scales = np.asarray(params["layers"]["wqkv"].scales[1, :, :g]).reshape(-1)
    np.testing.assert_array_equal(q_scales, np.broadcast_to(scale.reshape(-1), q_scales.shape))

    ids = np.random.default_rng(3).integers(0, VOCAB, 24).astype(np.int32)
    with torch.no_grad():
        want = _reference(folder)(torch.tensor(ids[None].astype(np.int64))).logits[0].numpy()
    np.testing.assert_allclose(_logits(config, params, ids), want, atol=2e-5, rtol=1e-5)


def _decompressed(folder: Path, scheme: str) -> transformers.PreTrainedModel:
    """transformers' Llama over the checkpoint's weights as compressed-tensors' own
    decompressor restores them (transformers 5.24's loader mis-shapes the packed zero points
    of asymmetric checkpoints, so it cannot load them itself)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weights, _ = CT_SCHEMES[scheme]
    args = QuantizationArgs(**{"symmetric": True, **weights}, dynamic=False)
    qscheme = QuantizationScheme(targets=["Linear"], weights=args)
    with safe_open(folder / "model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    state = {}
    for name in [k for k in tensors if k.endswith(".weight_packed")]:
        module = name.removesuffix("weight_packed")
        parts = {
            k.removeprefix(module): tensors.pop(k) for k in list(tensors) if k.startswith(module)
        }
        state[module + "weight"] = PackedQuantizationCompressor.decompress(parts, qscheme)["weight"]
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
    model.load_state_dict({**tensors, **state})
    return model


def test_w8a16_groups_read_into_8bit_grouped_weights(checkpoints):
    """int8 in groups of 32 (llm-compressor's W8A16 layout) -> an 8-bit GroupedWeight whose
    values are the stored int8s; logits as transformers runs the same checkpoint."""
    folder = checkpoints["w8a16"]
    config, params = load_model(folder, progress=False)
    w_down = params["layers"]["w_down"]
    assert isinstance(w_down, GroupedWeight) and w_down.bits == 8 and w_down.group_size == 32
    with safe_open(folder / "model.safetensors", "pt") as f:
        stored = f.get_tensor("model.layers.0.mlp.down_proj.weight").numpy()
        scales = f.get_tensor("model.layers.0.mlp.down_proj.weight_scale").numpy()
    np.testing.assert_array_equal(np.asarray(w_down.values[0]), stored)
    np.testing.assert_array_equal(np.asarray(w_down.scales[0]), scales)
    ids = np.random.default_rng(6).integers(0, VOCAB, 24).astype(np.int32)
    with torch.no_grad():
        want = _reference(folder)(torch.tensor(ids[None].astype(np.int64))).logits[0].numpy()
    np.testing.assert_allclose(_logits(config, params, ids), want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("scheme", ["w4a16", "w4a16-asym"])
def test_w4a16_reads_into_grouped_weights(checkpoints, scheme):
    """4-bit groups of 32 (pack-quantized, symmetric or with zero points) -> GroupedWeight,
    its integers the ones compressed-tensors' own unpacker finds in the file."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    folder = checkpoints[scheme]
    config, params = load_model(folder, progress=False)
    wo = params["layers"]["wo"]
    assert isinstance(wo, GroupedWeight) and wo.bits == 4 and wo.group_size == 32
    with safe_open(folder / "model.safetensors", "pt") as f:
        prefix = "model.layers.1.self_attn.o_proj."
        packed, shape = (
            f.get_tensor(prefix + "weight_packed"),
            f.get_tensor(prefix + "weight_shape"),
        )
    signed = unpack_from_int32(packed, 4, torch.Size(shape.tolist())).numpy()  # q in -8..7
    np.testing.assert_array_equal(np.asarray(wo[1].reshape(config.hidden_size, -1).q()), signed + 8)
    ids = np.random.default_rng(4).integers(0, VOCAB, 24).astype(np.int32)
    with torch.no_grad():
        reference = _decompressed(folder, scheme)
        want = reference(torch.tensor(ids[None].astype(np.int64))).logits[0].numpy()
    np.testing.assert_allclose(_logits(config, params, ids), want, atol=2e-5, rtol=1e-5)


def test_engine_greedy_equals_transformers(tmp_path):
    """quantization unset: the checkpoint's quantization_config decides (int8, lm_head
    quantized too, so every matmul is int8: the native int8 kernel where it builds)."""
    folder = make_checkpoint(tmp_path / "all-int8", "int8-packed", ignore=())
    prompts = [[5, 9, 2, 7, 30], list(range(3, 40))]
    ref = _reference(folder)
    want = []
    for p in prompts:
        with torch.no_grad():
            out = ref.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False,
                               eos_token_id=None, pad_token_id=0)  # fmt: skip
        want.append(out[0, len(p) :].tolist())
    llm = LLM(str(folder), max_model_len=64, max_num_seqs=2, num_kv_blocks=16,
              block_size=8, enforce_eager=True, show_progress=False)  # fmt: skip
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == want
    finally:
        llm.engine.close()


def test_a_leaf_quantized_in_part_loads_as_the_checkpoint_float(tmp_path):
    """One layer's down_proj left float by "ignore": the stacked w_down is dequantized (the
    checkpoint's weights exactly), the other leaves stay quantized."""
    ignore = ("lm_head", "re:.*layers\\.0\\.mlp\\.down_proj$")
    folder = make_checkpoint(tmp_path / "part", "int8-plain", ignore=ignore)
    config, params = load_model(folder, progress=False)
    assert isinstance(params["layers"]["wqkv"], QuantizedWeight)
    assert not isinstance(params["layers"]["w_down"], QuantizedWeight)
    ids = np.arange(2, 30, dtype=np.int32)
    with torch.no_grad():
        want = _reference(folder)(torch.tensor(ids[None].astype(np.int64))).logits[0].numpy()
    np.testing.assert_allclose(_logits(config, params, ids), want, atol=2e-5, rtol=1e-5)


def test_the_setting_names_the_formats_read():
    from jaxpaged.args import CHECKPOINT_QUANTIZATIONS, EngineArgs
    from jaxpaged.models.quant.checkpoint import CHECKPOINT_FORMATS

    assert CHECKPOINT_QUANTIZATIONS == CHECKPOINT_FORMATS
    assert EngineArgs(quantization="awq").quantization == "awq"


def test_explicit_quantization_must_agree_with_the_checkpoint(checkpoints, tmp_path):
    folder = checkpoints["int8-plain"]
    with pytest.raises(ValueError, match="quantization='fp8' disagrees.*compressed-tensors int8"):
        load_model(folder, progress=False, quantization="fp8")
    for same in ("int8", "compressed-tensors"):
        _, params = load_model(folder, progress=False, quantization=same)
        assert params["layers"]["wo"].dtype == np.int8
    float_folder = tmp_path / "float"
    shutil.copytree(folder, float_folder)
    config = json.loads((float_folder / "config.json").read_text())
    del config["quantization_config"]
    (float_folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="names a pre-quantized checkpoint format"):
        load_model(float_folder, progress=False, quantization="compressed-tensors")


def _group(qc):
    return qc["config_groups"]["group_0"]


REFUSED = {
    "w8a8": (
        lambda qc: _group(qc).update(
            input_activations=dict(num_bits=8, type="int", strategy="token", dynamic=True)
        ),
        r"activation quantization \(config_groups.group_0.input_activations: 8-bit int",
    ),
    "fp8-block": (
        lambda qc: _group(qc)["weights"].update(type="float", strategy="block"),
        r"8-bit float weights, strategy 'block'",
    ),
    "fp8-group": (
        lambda qc: _group(qc)["weights"].update(type="float", strategy="group", group_size=32),
        r"8-bit float weights, strategy 'group'",
    ),
    "asymmetric": (
        lambda qc: _group(qc)["weights"].update(symmetric=False),
        r"asymmetric 8-bit int weights",
    ),
    "4-bit unpacked": (
        lambda qc: _group(qc)["weights"].update(num_bits=4),
        r"4-bit int weights, strategy 'channel'",
    ),
    "2:4 sparsity": (
        lambda qc: qc.update(sparsity_config={"format": "sparse-24-bitmask"}),
        r"sparsity \(sparsity_config.format='sparse-24-bitmask', e.g. 2:4\)",
    ),
    "kv cache": (
        lambda qc: qc.update(kv_cache_scheme=dict(num_bits=8, type="float")),
        r"kv_cache_scheme=",
    ),
    "nvfp4 format": (
        lambda qc: _group(qc).update(format="nvfp4-pack-quantized"),
        r"the storage format 'nvfp4-pack-quantized'",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_schemes_are_refused_by_name(checkpoints, tmp_path, case):
    edit, match = REFUSED[case]
    folder = tmp_path / "edited"
    folder.mkdir()
    config = json.loads((checkpoints["int8-plain"] / "config.json").read_text())
    edit(config["quantization_config"])
    (folder / "config.json").write_text(json.dumps(config))  # no weights: refused first
    with pytest.raises(ValueError, match=match):
        load_model(folder, progress=False)


def test_loaded_weights_are_quantized_on_the_device(checkpoints):
    _, params = load_model(checkpoints["fp8-tensor"], progress=False)
    leaves = jax.tree.leaves(params["layers"]["w_gate_up"])
    assert all(isinstance(x, jax.Array) for x in leaves)
    assert {str(x.dtype) for x in leaves} == {"float8_e4m3fn", "float32"}


@pytest.mark.parametrize("scheme", ["fp8-channel", "int8-packed"])
def test_gemma3_checkpoint_equals_transformers(tmp_path, scheme):
    """Gemma reads pre-quantized checkpoints through its family's declaration (the Llama
    family's module names): its matmul leaves keep the stored values, and the logits are
    transformers' running the same checkpoint."""
    from jaxpaged.models.gemma import GemmaForCausalLM

    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.1,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    write_compressed_tensors(transformers.Gemma3ForCausalLM(config).eval(), tmp_path, scheme)
    write_tokenizer(tmp_path)
    config, params = load_model(tmp_path, progress=False)
    want_dtype = np.int8 if scheme.startswith("int8") else ml_dtypes.float8_e4m3fn
    for name in ("wqkv", "wo", "w_gate_up", "w_down"):
        leaf = params["layers"][name]
        assert isinstance(leaf, QuantizedWeight) and leaf.dtype == want_dtype, name
    ids = np.random.default_rng(3).integers(0, VOCAB, 24).astype(np.int32)
    module = GemmaForCausalLM.from_params(config, params)
    got = np.asarray(module.compute_logits(module(ids, np.arange(len(ids)))[0]))
    with torch.no_grad():
        want = _reference(tmp_path)(torch.tensor(ids[None].astype(np.int64))).logits[0].numpy()
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
