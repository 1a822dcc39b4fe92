"""Import a Llama, Qwen2 or Gemma 3 GGUF file (llama.cpp's format) into a Hugging Face-format folder.

The bundled model ships only as a GGUF, and the rest of jaxpaged reads Hugging Face folders
(config.json + model.safetensors + tokenizer.json), so this is the one bridge between them.
The weights are dequantized to float32 with the `gguf` package (model.safetensors, which
transformers reads too); matmul weights of the types gguf_quant.py reads are also written
quantized (QUANTIZED_FILE), which is what jaxpaged serves by default (models/gguf_params.py).
The tokenizer is rebuilt with `tokenizers` from the vocabulary, merges and token types in the
GGUF metadata (gguf_tokenizer.py).

CLI: ``python -m jaxpaged.models.gguf IN.gguf OUT_DIR``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .family import GgufLayout
from .gguf_quant import KEPT_QUANTIZED_TYPES, grouped_from_blocks
from .gguf_tokenizer import build_tokenizer, eos_ids
from .registry import families

# Tensor types we dequantize. All are implemented in numpy by the `gguf` package (maintained
# alongside llama.cpp); the K-quants are there because most published GGUFs are Q4_K_M.
SUPPORTED_TENSOR_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Gguf:
    """What the converter needs from one GGUF file: metadata values and tensors by name."""

    path: Path
    metadata: Mapping[str, Any]
    tensors: Mapping[str, Any]  # name -> gguf.ReaderTensor

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    # what a family's GgufLayout.config_fields reads (models/family.py GgufMetadata)
    def scalar(self, key: str, *, required: bool = True, default: Any = None) -> Any:
        return _scalar(self, key, required=required, default=default)

    def has_tensor(self, name: str) -> bool:
        return name in self.tensors

    def float_tensor(self, name: str) -> np.ndarray:
        return _dequantize(self.tensors[name])


def _read(gguf_path: Path) -> _Gguf:
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)
    metadata = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        metadata[key] = field.contents()
    tensors = {t.name: t for t in reader.tensors}
    return _Gguf(path=gguf_path, metadata=metadata, tensors=tensors)


def _dequantize(tensor: Any) -> np.ndarray:
    """float32 array in PyTorch/HF layout [out_features, in_features] (GGUF lists dims reversed)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType(tensor.tensor_type)
    if qtype.name not in SUPPORTED_TENSOR_TYPES:
        raise ValueError(
            f"GGUF tensor {tensor.name!r} has type {qtype.name}, which jaxpaged cannot import; "
            f"supported types: {', '.join(SUPPORTED_TENSOR_TYPES)}"
        )
    shape = tuple(int(d) for d in reversed(tensor.shape))
    values = dequantize(np.asarray(tensor.data), qtype)
    return np.ascontiguousarray(values.reshape(shape), dtype=np.float32)


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of a q/k projection (weight [rows, cols] or bias
    [rows]): its converter interleaves the two rotary halves of each head."""
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _scalar(g: _Gguf, key: str, *, required: bool = True, default: Any = None) -> Any:
    if key in g.metadata:
        return g.metadata[key]
    if required:
        raise ValueError(f"GGUF file {g.path} lacks metadata key {key!r}")
    return default


def _layouts() -> dict[str, GgufLayout]:
    """GGUF architecture -> the layout a family declares for it."""
    return {layout.architecture: layout for f in families() for layout in f.gguf}


def _architecture(g: _Gguf) -> GgufLayout:
    arch = _scalar(g, "general.architecture")
    layouts = _layouts()
    if arch not in layouts:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(sorted(layouts))}"
        )
    return layouts[arch]


def _config(g: _Gguf, layout: GgufLayout) -> dict[str, Any]:
    arch = layout.architecture
    embed = g.tensors.get("token_embd.weight")
    if embed is None:
        raise ValueError(f"GGUF file {g.path} has no tensor 'token_embd.weight'")
    hidden = int(_scalar(g, f"{arch}.embedding_length"))
    n_heads = int(_scalar(g, f"{arch}.attention.head_count"))
    n_kv = int(_scalar(g, f"{arch}.attention.head_count_kv", required=False, default=n_heads))
    q = g.tensors.get("blk.0.attn_q.weight")
    if q is None:
        raise ValueError(f"GGUF file {g.path} has no tensor 'blk.0.attn_q.weight'")
    head_dim = int(q.shape[1]) // n_heads  # q rows = n_heads * head_dim (GGUF dims reversed)
    theta = float(_scalar(g, f"{arch}.rope.freq_base", required=False, default=10000.0))
    tied = "output.weight" not in g.tensors
    config: dict[str, Any] = {
        "architectures": [layout.hf_architecture],
        "model_type": layout.model_type,
        "vocab_size": int(embed.shape[1]),
        "hidden_size": hidden,
        "intermediate_size": int(_scalar(g, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_scalar(g, f"{arch}.block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(
            _scalar(g, f"{arch}.context_length", required=False, default=2048)
        ),
        "rms_norm_eps": float(_scalar(g, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "rope_scaling": None,
        "tie_word_embeddings": tied,
        "torch_dtype": "float32",
        "bos_token_id": _scalar(g, "tokenizer.ggml.bos_token_id", required=False),
        "eos_token_id": _scalar(g, "tokenizer.ggml.eos_token_id", required=False),
    }
    if layout.config_fields is not None:  # what the family's config.json holds beyond these
        config = layout.config_fields(g, config)
    scaling_type = _scalar(g, f"{arch}.rope.scaling.type", required=False)
    if scaling_type in ("linear", "yarn") and config["rope_scaling"] is None:
        config["rope_scaling"] = {
            "rope_type": scaling_type,
            "factor": float(_scalar(g, f"{arch}.rope.scaling.factor")),
        }
        if scaling_type == "yarn":
            config["rope_scaling"]["original_max_position_embeddings"] = int(
                _scalar(g, f"{arch}.rope.scaling.original_context_length")
            )
    elif scaling_type not in (None, "none", "linear", "yarn"):
        raise ValueError(f"GGUF rope scaling type {scaling_type!r} is not supported")
    return config


def _hf_tensor_name(name: str, layout: GgufLayout) -> str | None:
    """HF name of a GGUF tensor; None for tensors that are folded into config.json."""
    if name == "rope_freqs.weight":
        return None
    base, _, suffix = name.rpartition(".")
    if base in _GLOBAL_TENSORS and suffix in ("weight", "bias"):
        return f"{_GLOBAL_TENSORS[base]}.{suffix}"
    m = _LAYER_RE.match(name)
    if m and m.group(2) in layout.layer_tensors:
        return f"model.layers.{m.group(1)}.{layout.layer_tensors[m.group(2)]}.{m.group(3)}"
    raise ValueError(f"GGUF tensor {name!r} has no Hugging Face counterpart in this importer")


def _weights(g: _Gguf, layout: GgufLayout, config: Mapping[str, Any]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name, tensor in g.tensors.items():
        hf_name = _hf_tensor_name(name, layout)
        if hf_name is None:
            continue
        w = _dequantize(tensor)
        if layout.plus_one_norms and name.endswith("norm.weight"):
            w = w - 1  # float32, as transformers' GGUF loader undoes it
        if layout.permuted_qk and ".attn_q." in name:
            w = _unpermute_rows(w, config["num_attention_heads"])
        elif layout.permuted_qk and ".attn_k." in name:
            w = _unpermute_rows(w, config["num_key_value_heads"])
        out[hf_name] = np.ascontiguousarray(w)
    n_layers = config["num_hidden_layers"]
    required = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(n_layers):
        for module in layout.layer_tensors.values():
            required.append(f"model.layers.{i}.{module}.weight")
    missing = [n for n in required if n not in out]
    if missing:
        raise ValueError(
            f"GGUF file {g.path} lacks tensors for {missing[:5]} ({len(missing)} in all)"
        )
    return out


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# The quantized matmul weights also written as GroupedWeight arrays, beside the float
# model.safetensors (which transformers reads): "<hf name>.values", ".scales" and, 4-bit,
# ".mins"; models/gguf_params.py loads them. The Gemma family's forward reads float weights.
# In a subfolder: vLLM's loader reads every top-level *.safetensors of a folder and fails on
# names it does not know ("Attempted to load nested weight '...weight.scales'").
QUANTIZED_FILE = "jaxpaged/gguf_quantized.safetensors"
_MATMUL_TENSORS = (
    "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
)  # fmt: skip


def _quantized_weights(
    g: _Gguf, layout: GgufLayout, config: Mapping[str, Any]
) -> dict[str, np.ndarray]:
    """The matmul weights (and token embedding and output) whose GGUF type is kept quantized
    (gguf_quant.py), as the arrays of their `GroupedWeight`, rows in HF order."""
    from gguf import GGMLQuantizationType

    out: dict[str, np.ndarray] = {}
    for name, tensor in g.tensors.items():
        m = _LAYER_RE.match(name)
        kind = m.group(2) if m else name.rpartition(".")[0]
        if not name.endswith(".weight") or kind not in (*_MATMUL_TENSORS, "token_embd", "output"):
            continue
        qtype = GGMLQuantizationType(tensor.tensor_type).name
        if qtype not in KEPT_QUANTIZED_TYPES:
            continue
        cols, rows = (int(d) for d in tensor.shape)  # GGUF lists dims reversed
        w = grouped_from_blocks(tensor.data, qtype, rows, cols)
        arrays = {"values": w.values, "scales": w.scales, "mins": w.mins}
        heads = {"attn_q": "num_attention_heads", "attn_k": "num_key_value_heads"}.get(kind)
        hf_name = _hf_tensor_name(name, layout)
        for part, a in arrays.items():
            if a is None:
                continue
            if layout.permuted_qk and heads is not None:
                a = _unpermute_rows(a, config[heads])
            out[f"{hf_name}.{part}"] = np.ascontiguousarray(a)
    return out


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write a Hugging Face-format folder (float32 weights, tokenizer, chat template) for the
    Llama or Qwen2 model in `gguf_path` into `out_dir` (created if needed); returns `out_dir`.

    Raises ValueError for an unsupported architecture, tensor type or tokenizer.
    """
    from safetensors.numpy import save_file

    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ValueError(f"gguf_path {str(gguf_path)!r} is not a file")
    out = Path(out_dir)
    g = _read(gguf_path)
    layout = _architecture(g)
    config = _config(g, layout)
    tokenizer, special = build_tokenizer(g)
    weights = _weights(g, layout, config)

    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)
    del weights
    quantized = _quantized_weights(g, layout, config)
    if quantized:
        (out / QUANTIZED_FILE).parent.mkdir(exist_ok=True)
        save_file(quantized, str(out / QUANTIZED_FILE), metadata={"format": "jaxpaged-grouped"})
        (out / QUANTIZED_FILE).chmod(0o644)
    _write_json(out / "config.json", config)
    tokenizer.save(str(out / "tokenizer.json"))

    context = config["max_position_embeddings"]
    tok_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": context,
        "clean_up_tokenization_spaces": False,
        **special,
    }
    template = _scalar(g, "tokenizer.chat_template", required=False)
    if template is not None:
        tok_config["chat_template"] = template
    _write_json(out / "tokenizer_config.json", tok_config)
    _write_json(
        out / "special_tokens_map.json",
        {k: v for k, v in special.items() if k.endswith("_token") and v is not None},
    )
    eos = eos_ids(g)
    generation: dict[str, Any] = {"_from_model_config": True}
    if config["bos_token_id"] is not None:
        generation["bos_token_id"] = config["bos_token_id"]
    if eos:
        generation["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    pad = _scalar(g, "tokenizer.ggml.padding_token_id", required=False)
    if pad is not None:
        generation["pad_token_id"] = int(pad)
    _write_json(out / "generation_config.json", generation)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jaxpaged.models.gguf",
        description="Convert a Llama/Qwen2 GGUF file into a Hugging Face-format folder.",
    )
    parser.add_argument("gguf_path", help="input .gguf file")
    parser.add_argument("out_dir", help="output folder (created if missing)")
    args = parser.parse_args(argv)
    try:
        out = convert_gguf(args.gguf_path, args.out_dir)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
