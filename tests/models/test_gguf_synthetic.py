"""GGUF import of tiny synthetic files written with `gguf.GGUFWriter` from known weights (q/k
permuted the way llama.cpp's converter does): they must round-trip to those weights, to the
logits of the model they came from, and to transformers' tokenizers; bad files give clear
errors; the CLI converts."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import gguf
import jax
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file
from tokenizers import Tokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from jaxpaged.models.gguf import convert_gguf, main
from jaxpaged.models.loader import load_model
from jaxpaged.models.quant import GroupedWeight
from jaxpaged.models.testing import HF_TO_GGUF_LAYER_NAMES, gguf_tensor_name

Q = gguf.GGMLQuantizationType


# --- synthetic GGUFs written with GGUFWriter ------------------------------------------------------

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "1 2"]


def _vocab() -> tuple[list[str], list[int]]:
    byte_chars = list(bytes_to_unicode().values())
    merged = ["he", "ll", "hell", "hello", "Ġw", "or", "Ġwor", "ld", "Ġworld", "12"]
    tokens = SPECIALS + byte_chars + merged
    types = [3] * len(SPECIALS) + [1] * (len(byte_chars) + len(merged))
    return tokens, types


SPM_PIECES = [
    "he",
    "ll",
    "\u2581he",
    "or",
    "ld",
    "\u2581w",
    "\u2581hell",
    "\u2581wor",
    "\u2581hello",
]
SPM_PIECES += ["\u2581world"]


def _spm_vocab() -> tuple[list[str], list[int], list[float]]:
    """A SentencePiece vocabulary as llama.cpp stores it: unk/bos/eos, 256 byte tokens, single
    characters, then merged pieces scored best-first."""
    chars = ["\u2581", "h", "e", "l", "o", "w", "r", "d"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + chars + SPM_PIECES
    types = [2, 3, 3] + [6] * 256 + [1] * (len(chars) + len(SPM_PIECES))
    scores = [0.0] * 259 + [-100.0] * len(chars) + [-1.0 - i for i in range(len(SPM_PIECES))]
    return tokens, types, scores


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (rotary halves -> interleaved rows)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _tiny_hf_model(
    arch: str, *, tied: bool = False, rope_scaling: dict | None = None, seed: int = 0
):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=len(_vocab()[0]),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=tied,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch == "llama":
        config = transformers.LlamaConfig(**common, rope_scaling=rope_scaling)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "norm" in name else 0.0))
    return model.eval()


def _write_gguf(
    path: Path,
    arch: str,
    config,
    tensors: dict[str, np.ndarray],
    qtypes: dict[str, Q] | None = None,
    raw: dict[str, tuple[np.ndarray, Q, tuple[int, ...]]] | None = None,
    pre: str = "default",
    add_bos: bool = False,
) -> Path:
    """Write `tensors` (GGUF names, HF layout) with llama.cpp's metadata keys."""
    qtypes = qtypes or {}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    if pre == "spm":
        tokens, types, scores = _spm_vocab()
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_scores(scores)
        w.add_unk_token_id(0)
    else:
        tokens, types = _vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(add_bos)
    w.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    )
    for name, value in tensors.items():
        qtype = qtypes.get(name, Q.F32)
        if qtype == Q.F32:
            w.add_tensor(name, value.astype(np.float32))
        elif qtype == Q.F16:
            w.add_tensor(name, value.astype(np.float16))
        else:
            w.add_tensor(
                name, gguf.quants.quantize(value.astype(np.float32), qtype), raw_dtype=qtype
            )
    for name, (data, qtype, _) in (raw or {}).items():
        w.add_tensor(name, data, raw_dtype=qtype)  # data has the byte shape
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _gguf_tensors(model, arch: str) -> dict[str, np.ndarray]:
    """The model's weights under GGUF names, q/k permuted as llama.cpp does for Llama only."""
    cfg = model.config
    out = {}
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        value = t.detach().numpy().copy()
        if arch == "llama" and "q_proj" in hf_name:
            value = _llamacpp_permute(value, cfg.num_attention_heads)
        elif arch == "llama" and "k_proj" in hf_name:
            value = _llamacpp_permute(value, cfg.num_key_value_heads)
        out[gguf_tensor_name(hf_name)] = value
    return out


def _llama3_rope_freqs(theta: float, head_dim: int, scaling: dict) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.generate_extra_tensors, written out."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    low_wl, high_wl = old / low, old / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wl:
            out.append(1.0)
        elif wavelen > low_wl:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


LLAMA3 = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)


@pytest.mark.parametrize(
    "arch,tied,rope_scaling",
    [
        ("llama", False, None),
        ("llama", True, LLAMA3),
        ("qwen2", False, None),
        ("qwen2", True, None),
    ],
)
def test_synthetic_f32_roundtrip_and_logits(tmp_path, arch, tied, rope_scaling):
    model = _tiny_hf_model(arch, tied=tied, rope_scaling=rope_scaling)
    tensors = _gguf_tensors(model, arch)
    if rope_scaling:
        tensors["rope_freqs.weight"] = _llama3_rope_freqs(500000.0, 16, rope_scaling)
    src = _write_gguf(tmp_path / "tiny.gguf", arch, model.config, tensors)
    out = convert_gguf(src, tmp_path / "hf")

    mine = load_file(str(out / "model.safetensors"))
    expected = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    if tied:
        assert "lm_head.weight" not in mine
        expected.pop("lm_head.weight")
    assert sorted(mine) == sorted(expected)
    for name, ref in expected.items():
        np.testing.assert_array_equal(mine[name], ref, err_msg=name)

    converted = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert converted.config.model_type == arch
    assert converted.config.tie_word_embeddings == tied
    if rope_scaling:
        scaling = converted.config.rope_parameters
        assert scaling["rope_type"] == "llama3" and scaling["factor"] == 8.0
    ids = torch.tensor([[5, 17, 200, 33, 99, 1, 150, 260, 7, 42]])
    with torch.no_grad():
        np.testing.assert_allclose(
            converted(ids).logits.numpy(), model(ids).logits.numpy(), rtol=1e-5, atol=1e-5
        )


def test_synthetic_quantized_roundtrip(tmp_path):
    """F16, BF16, Q8_0, Q4_0, Q4_1 tensors come back as the original weights, to within each
    type's rounding; the permuted q/k use the precise types so a wrong un-permute cannot hide."""
    model = _tiny_hf_model("llama", seed=1)
    tensors = _gguf_tensors(model, "llama")
    kinds = {
        "token_embd.weight": Q.F16,
        "output.weight": Q.Q8_0,
        "attn_q.weight": Q.Q8_0,
        "attn_k.weight": Q.F16,
        "attn_v.weight": Q.BF16,
        "attn_output.weight": Q.Q4_0,
        "ffn_gate.weight": Q.Q4_1,
        "ffn_up.weight": Q.Q8_0,
        "ffn_down.weight": Q.F16,
    }
    qtypes = {
        n: kinds[n.split(".", 2)[-1] if n.startswith("blk.") else n]
        for n in tensors
        if "norm" not in n
    }
    src = _write_gguf(tmp_path / "q.gguf", "llama", model.config, tensors, qtypes)
    out = convert_gguf(src, tmp_path / "hf")
    mine = load_file(str(out / "model.safetensors"))
    # the kept-quantized copy lies in a subfolder: a loader that reads every top-level
    # *.safetensors (vLLM's) sees the float checkpoint only
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert (out / "jaxpaged" / "gguf_quantized.safetensors").is_file()
    for hf_name, t in model.state_dict().items():
        ref = t.detach().numpy()
        kind = qtypes.get(gguf_tensor_name(hf_name), Q.F32)
        got = mine[hf_name]
        assert got.dtype == np.float32 and got.shape == ref.shape, hf_name
        amax = np.abs(ref).max()
        if kind == Q.F32:
            np.testing.assert_array_equal(got, ref, err_msg=hf_name)
        elif kind == Q.F16:
            np.testing.assert_array_equal(got, ref.astype(np.float16).astype(np.float32))
        elif kind == Q.BF16:
            np.testing.assert_allclose(got, ref, rtol=2**-8, atol=0, err_msg=hf_name)
        elif kind == Q.Q8_0:  # per 32-block scale amax/127, round to nearest
            np.testing.assert_allclose(got, ref, rtol=0, atol=amax / 127 * 0.51 + 1e-3 * amax)
        else:  # 4-bit: 16 levels per block
            np.testing.assert_allclose(got, ref, rtol=0, atol=amax / 7)
    # served quantized by default where a stacked leaf's parts share one kept format; the
    # rest (mixed or F16/BF16 parts) is the float expansion; the same numbers either way
    folder = str(tmp_path / "hf")
    _, kept = load_model(folder, progress=False)
    _, floats = load_model(folder, quantization="none", progress=False)
    grouped = lambda x: isinstance(x, GroupedWeight)  # noqa: E731
    formats = jax.tree.map(lambda x: (x.bits, x.group_size) if grouped(x) else None, kept,
                           is_leaf=grouped)  # fmt: skip
    assert formats["layers"]["wo"] == (4, 32)  # Q4_0
    assert formats["lm_head"] == (8, 32)  # Q8_0
    for name in ("wqkv", "w_gate_up", "w_down"):  # Q8_0 + F16 + BF16, Q4_1 + Q8_0, F16
        assert formats["layers"][name] is None, name
    assert formats["embed"] is None  # F16
    for path, leaf in jax.tree_util.tree_flatten_with_path(kept, is_leaf=grouped)[0]:
        want = floats
        for key in path:
            want = want[key.key]
        got = leaf.dequantize(np.float32) if grouped(leaf) else leaf
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=str(path))


K_LAYOUT = {  # bytes per 256-value block, offsets of its float16 scale fields (ggml-common.h)
    Q.Q2_K: (84, (80, 82)),
    Q.Q3_K: (110, (108,)),
    Q.Q4_K: (144, (0, 2)),
    Q.Q5_K: (176, (0, 2)),
    Q.Q6_K: (210, (208,)),
}


def _random_k_blocks(rng, qtype: Q, rows: int, cols: int) -> np.ndarray:
    block_bytes, halves = K_LAYOUT[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // 256, block_bytes), dtype=np.uint8)
    for off in halves:
        scale = rng.uniform(-0.05, 0.05, size=blocks.shape[0]).astype(np.float16)
        blocks[:, off : off + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def test_k_quants_match_transformers_dequantizer(tmp_path):
    """K-quant bytes dequantize to what transformers' own (torch) dequantizer computes."""
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    config = transformers.LlamaConfig(
        vocab_size=len(_vocab()[0]),
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    rng = np.random.default_rng(0)
    tensors = {
        "token_embd.weight": rng.standard_normal((config.vocab_size, 256)).astype(np.float32),
        "output_norm.weight": np.ones(256, np.float32),
        "blk.0.attn_norm.weight": np.ones(256, np.float32),
        "blk.0.ffn_norm.weight": np.ones(256, np.float32),
        "blk.0.ffn_down.weight": rng.standard_normal((256, 256)).astype(np.float32),
    }
    kinds = {
        "blk.0.attn_q.weight": (Q.Q4_K, 256),
        "blk.0.attn_k.weight": (Q.Q5_K, 128),
        "blk.0.attn_v.weight": (Q.Q6_K, 128),
        "blk.0.attn_output.weight": (Q.Q2_K, 256),
        "blk.0.ffn_gate.weight": (Q.Q3_K, 256),
        "blk.0.ffn_up.weight": (Q.Q4_K, 256),
    }
    raw = {
        n: (_random_k_blocks(rng, q, rows, 256), q, (rows, 256)) for n, (q, rows) in kinds.items()
    }
    src = _write_gguf(tmp_path / "k.gguf", "llama", config, tensors, raw=raw)
    mine = load_file(str(convert_gguf(src, tmp_path / "hf") / "model.safetensors"))
    for name, (data, qtype, shape) in raw.items():
        ref = hf_dequantize(torch.from_numpy(data.reshape(-1)), int(qtype)).numpy().reshape(shape)
        hf_name = f"model.layers.0.{_hf_module(name)}.weight"
        got = mine[hf_name]
        if "attn_q" in name:
            got = _llamacpp_permute(got, 4)
        elif "attn_k" in name:
            got = _llamacpp_permute(got, 2)
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7, err_msg=f"{name} {qtype.name}")


def _hf_module(gguf_name: str) -> str:
    inverse = {
        v.removesuffix(".weight"): k.removesuffix(".weight")
        for k, v in HF_TO_GGUF_LAYER_NAMES.items()
    }
    return inverse[gguf_name.split(".")[2]]


@pytest.mark.parametrize(
    "pre,add_bos", [("default", False), ("smollm", False), ("qwen2", False), ("llama-bpe", True)]
)
def test_synthetic_tokenizer_matches_transformers(tmp_path, pre, add_bos):
    model = _tiny_hf_model("llama")
    tensors = _gguf_tensors(model, "llama")
    src = _write_gguf(tmp_path / "t.gguf", "llama", model.config, tensors, pre=pre, add_bos=add_bos)
    out = convert_gguf(src, tmp_path / "hf")
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="t.gguf")
    auto = transformers.AutoTokenizer.from_pretrained(out)
    tokens = _vocab()[0]
    texts = ["hello world", "<|im_start|>hello<|im_end|>", "héllo wörld 😀", "  x\n\n  y", "a 12 b"]
    for text in texts:
        ids = auto(text)["input_ids"]
        assert ids == [1] * add_bos + auto(text, add_special_tokens=False)["input_ids"], text
        # transformers does not split digits for 'smollm' (llama.cpp and SmolLM's own tokenizer do)
        if not (pre == "smollm" and "12" in text):
            assert ids == ref(text)["input_ids"], text
        assert auto.decode(ids[int(add_bos) :]) == text
    hello = [tokens.index("hello"), tokens.index("Ġworld")]
    assert auto("hello world")["input_ids"] == [1] * add_bos + hello
    twelve = auto("12", add_special_tokens=False)["input_ids"]
    # SmolLM and Qwen2 tokenize each digit on its own; GPT-2 and Llama 3 merge them
    assert twelve == (
        [tokens.index("1"), tokens.index("2")]
        if pre in ("smollm", "qwen2")
        else [tokens.index("12")]
    )
    if pre == "qwen2":  # Qwen2's tokenizer NFC-normalizes first
        assert auto("e\u0301")["input_ids"] == auto("\u00e9")["input_ids"]
    messages = [{"role": "user", "content": "hi"}]
    assert auto.apply_chat_template(messages, tokenize=False) == ref.apply_chat_template(
        messages, tokenize=False
    )


def test_synthetic_sentencepiece_tokenizer(tmp_path):
    model = _tiny_hf_model("llama")
    tensors = _gguf_tensors(model, "llama")
    tokens = _spm_vocab()[0]
    tensors["token_embd.weight"] = tensors["token_embd.weight"][:1].repeat(len(tokens), 0)
    tensors["output.weight"] = tensors["output.weight"][:1].repeat(len(tokens), 0)
    src = _write_gguf(tmp_path / "s.gguf", "llama", model.config, tensors, pre="spm", add_bos=True)
    out = convert_gguf(src, tmp_path / "hf")
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="s.gguf")
    auto = transformers.AutoTokenizer.from_pretrained(out)
    raw = Tokenizer.from_file(str(out / "tokenizer.json"))
    # llama.cpp adds BOS and a leading space; pieces merge best-score first
    assert raw.encode("hello world").ids == [
        1,
        tokens.index("\u2581hello"),
        tokens.index("\u2581world"),
    ]
    # bytes missing from the vocabulary fall back to <0xNN> tokens
    assert raw.encode("h\u00e9").ids[-2:] == [tokens.index("<0xC3>"), tokens.index("<0xA9>")]
    for text in ["hello world", "hello  world\nhe", "h\u00e9llo w\u00f6rld \U0001f600"]:
        ids = auto(text)["input_ids"]
        assert ids == ref(text)["input_ids"] == raw.encode(text).ids, text
        assert auto.decode(ids, skip_special_tokens=True) == text
    # like sentencepiece and llama.cpp, the space prefix is added even before a leading space
    # (transformers' GGUF tokenizer skips it there)
    space = tokens.index("\u2581")
    assert raw.encode("  hello").ids == [1, space, space, tokens.index("\u2581hello")]
    assert auto.unk_token == "<unk>" and auto.bos_token == "<s>" and auto.eos_token == "</s>"


# --- errors and CLI ---------------------------------------------------------------------------


def test_unsupported_tensor_type_names_type_and_tensor(tmp_path):
    model = _tiny_hf_model("llama")
    tensors = _gguf_tensors(model, "llama")
    q = tensors.pop("blk.1.attn_q.weight")
    iq4 = np.zeros((q.shape[0], q.shape[1] // 32 * 18), np.uint8)  # IQ4_NL: 18 bytes / 32 values
    raw = {"blk.1.attn_q.weight": (iq4, Q.IQ4_NL, q.shape)}
    src = _write_gguf(tmp_path / "iq.gguf", "llama", model.config, tensors, raw=raw)
    with pytest.raises(ValueError, match="IQ4_NL") as err:
        convert_gguf(src, tmp_path / "hf")
    assert "IQ4_NL" in str(err.value) and "blk.1.attn_q.weight" in str(err.value)


def test_unsupported_architecture_is_named(tmp_path):
    model = _tiny_hf_model("llama")
    src = _write_gguf(
        tmp_path / "g.gguf", "gpt2", model.config, {"token_embd.weight": np.ones((4, 4))}
    )
    with pytest.raises(ValueError, match=r"architecture 'gpt2'.*supported: gemma3, llama, qwen2"):
        convert_gguf(src, tmp_path / "hf")


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="nope.gguf"):
        convert_gguf(tmp_path / "nope.gguf", tmp_path / "hf")


def test_cli(tmp_path, capsys):
    model = _tiny_hf_model("qwen2", tied=True)
    src = _write_gguf(tmp_path / "c.gguf", "qwen2", model.config, _gguf_tensors(model, "qwen2"))
    assert main([str(src), str(tmp_path / "out")]) == 0
    assert Path(tmp_path / "out" / "config.json").is_file()
    assert main([str(tmp_path / "missing.gguf"), str(tmp_path / "x")]) == 2
    assert "missing.gguf" in capsys.readouterr().err
    done = subprocess.run(
        [sys.executable, "-m", "jaxpaged.models.gguf", str(src), str(tmp_path / "out2")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert Path(tmp_path / "out2" / "model.safetensors").is_file()
