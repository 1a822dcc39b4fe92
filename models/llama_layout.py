"""The Llama family's checkpoint layout: its model types and config.json parsing, its
declared linears (params leaf, tensor-parallel split, Hugging Face modules, LoRA sites), the
safetensors and GGUF tensor names of a layer, and reading a checkpoint into the stacked params
tree (models/llama.py's docstring draws it). Granite reads its checkpoints through these too."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import numpy as np

from .config import ModelConfig, RopeScaling
from .family import GgufMetadata, Linear, linear_splits
from .types import TensorReader


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaVariant:
    """What one model_type of the Llama layout changes, declared once (VARIANTS); the
    parser reads these fields, never the model_type itself."""

    sliding_window: bool = False  # reads config.json's sliding_window
    qwen_window_option: bool = False  # refuses use_sliding_window=True (Qwen's layer window)
    qkv_bias: bool = False  # always (else as attention_bias says)
    qk_norm: bool = False
    experts: bool = False  # MoE (Qwen3-MoE's count is num_experts; transformers 5 writes it
    # as num_local_experts)
    qwen3_moe: bool = False  # moe_intermediate_size, and its options checked
    always_norm_topk: bool = False  # renormalizes the top-k weights (else as the config says)
    block_sparse_moe: bool = False  # Mixtral's expert names
    fused_projections: bool = False  # Phi-3's qkv_proj / gate_up_proj


VARIANTS: Mapping[str, LlamaVariant] = MappingProxyType(
    {
        "llama": LlamaVariant(),
        "mistral": LlamaVariant(sliding_window=True),
        "qwen2": LlamaVariant(qwen_window_option=True, qkv_bias=True),
        "qwen3": LlamaVariant(qwen_window_option=True, qk_norm=True),
        "phi3": LlamaVariant(sliding_window=True, fused_projections=True),
        "mixtral": LlamaVariant(
            sliding_window=True, experts=True, always_norm_topk=True, block_sparse_moe=True
        ),
        "qwen3_moe": LlamaVariant(
            qwen_window_option=True, qk_norm=True, experts=True, qwen3_moe=True
        ),
    }
)
MODEL_TYPES = tuple(VARIANTS)


def _check_qwen3_moe(d: Mapping) -> None:
    """ValueError naming a Qwen3-MoE option jaxpaged does not run: dense MLP layers among
    the sparse ones."""
    if d.get("decoder_sparse_step", 1) != 1:
        raise ValueError(
            f"unsupported qwen3_moe option decoder_sparse_step={d['decoder_sparse_step']} "
            "(dense MLP layers between the sparse ones); jaxpaged runs 1"
        )
    if d.get("mlp_only_layers"):
        raise ValueError(
            f"unsupported qwen3_moe option mlp_only_layers={list(d['mlp_only_layers'])} "
            "(dense MLP layers); jaxpaged runs []"
        )


def config_fields(d: Mapping) -> dict[str, Any]:
    """ModelConfig fields of a Llama-family config.json, transformers 4 (`rope_theta`,
    `rope_scaling`) or 5 (`rope_parameters`); ValueError naming an option jaxpaged does not
    run. Families built on this layout (models/granite.py) start from these fields."""
    model_type = d.get("model_type")
    variant = VARIANTS.get(model_type, LlamaVariant())  # a family built on it: plain Llama
    num_heads = d["num_attention_heads"]
    hidden = d["hidden_size"]
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if "original_max_position_embeddings" in d:  # Phi-3 keeps it beside rope_scaling
        rope = {
            "original_max_position_embeddings": d["original_max_position_embeddings"],
            **rope,
        }
    rope_theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
    max_pos = d.get("max_position_embeddings", 2048)
    window = d.get("sliding_window") if variant.sliding_window else None
    if d.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"unsupported {model_type} option partial_rotary_factor != 1")
    if variant.qwen_window_option and d.get("use_sliding_window"):
        raise ValueError(
            f"unsupported {model_type} option use_sliding_window=True (sliding window "
            "attention on the layers from max_window_layers on)"
        )
    if variant.qwen3_moe:
        _check_qwen3_moe(d)
    scaling = RopeScaling.from_hf_dict(rope, max_pos)
    eos = d.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return dict(
        model_type=model_type,
        vocab_size=d["vocab_size"],
        hidden_size=hidden,
        intermediate_size=d["moe_intermediate_size" if variant.qwen3_moe else "intermediate_size"],
        num_layers=d["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=d.get("num_key_value_heads") or num_heads,
        head_dim=d.get("head_dim") or hidden // num_heads,
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        qkv_bias=variant.qkv_bias or bool(d.get("attention_bias", False)),
        qk_norm=variant.qk_norm,
        sliding_window=int(window) if window else None,
        num_experts=int(d.get("num_local_experts") or d.get("num_experts") or 0)
        if variant.experts
        else 0,
        num_experts_per_tok=int(d.get("num_experts_per_tok") or 0),
        # Mixtral always renormalizes; Qwen3-MoE as its config says (transformers: False)
        norm_topk_prob=variant.always_norm_topk or bool(d.get("norm_topk_prob", False)),
        block_sparse_moe=variant.block_sparse_moe,
        fused_projections=variant.fused_projections,
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=eos_ids,
        torch_dtype=d.get("torch_dtype") or d.get("dtype"),
    )


def parse_config(d: Mapping) -> ModelConfig:
    return ModelConfig(**config_fields(d))


# ------------------------------------------------------------------- loading


def hf_layer_tensors(config: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """HF name -> expected shape of layer i's tensors."""
    c = config
    p = f"model.layers.{i}."
    d, hd, f = c.hidden_size, c.head_dim, c.intermediate_size
    names = {
        p + "input_layernorm.weight": (d,),
        p + "self_attn.q_proj.weight": (c.num_heads * hd, d),
        p + "self_attn.k_proj.weight": (c.num_kv_heads * hd, d),
        p + "self_attn.v_proj.weight": (c.num_kv_heads * hd, d),
        p + "self_attn.o_proj.weight": (d, c.num_heads * hd),
        p + "post_attention_layernorm.weight": (d,),
        p + "mlp.gate_proj.weight": (f, d),
        p + "mlp.up_proj.weight": (f, d),
        p + "mlp.down_proj.weight": (d, f),
    }
    if c.num_experts:  # Mixtral: a router and E experts (w1 gate, w3 up, w2 down)
        del names[p + "mlp.gate_proj.weight"], names[p + "mlp.up_proj.weight"]
        del names[p + "mlp.down_proj.weight"]
        moe, (gate, up, down) = _moe_names(c)
        names[p + moe + "gate.weight"] = (c.num_experts, d)
        for e in range(c.num_experts):
            names[p + moe + f"experts.{e}.{gate}.weight"] = (f, d)
            names[p + moe + f"experts.{e}.{up}.weight"] = (f, d)
            names[p + moe + f"experts.{e}.{down}.weight"] = (d, f)
    if c.fused_projections:  # q, k, v fused in one projection; gate and up in another
        for name in ("q_proj", "k_proj", "v_proj"):
            del names[p + f"self_attn.{name}.weight"]
        del names[p + "mlp.gate_proj.weight"], names[p + "mlp.up_proj.weight"]
        names[p + "self_attn.qkv_proj.weight"] = ((c.num_heads + 2 * c.num_kv_heads) * hd, d)
        names[p + "mlp.gate_up_proj.weight"] = (2 * f, d)
    if c.qkv_bias:
        names[p + "self_attn.q_proj.bias"] = (c.num_heads * hd,)
        names[p + "self_attn.k_proj.bias"] = (c.num_kv_heads * hd,)
        names[p + "self_attn.v_proj.bias"] = (c.num_kv_heads * hd,)
    if c.qk_norm:
        names[p + "self_attn.q_norm.weight"] = (hd,)
        names[p + "self_attn.k_norm.weight"] = (hd,)
    return names


def _moe_names(config: ModelConfig) -> tuple[str, tuple[str, str, str]]:
    """The sparse MLP's module prefix in a layer and its experts' gate, up and down names."""
    if config.block_sparse_moe:
        return "block_sparse_moe.", ("w1", "w3", "w2")
    return "mlp.", ("gate_proj", "up_proj", "down_proj")


def _fill_layer(out: dict[str, Any], i: int, read: TensorReader, config: ModelConfig) -> None:
    """Write layer i of the stacked, fused host arrays from its HF tensors."""
    c = config
    p = f"model.layers.{i}."
    shapes = hf_layer_tensors(c, i)
    g, hkv, hd, d = c.queries_per_kv, c.num_kv_heads, c.head_dim, c.hidden_size
    r = lambda n: read(p + n, shapes[p + n])

    out["attn_norm"][i] = r("input_layernorm.weight")
    out["mlp_norm"][i] = r("post_attention_layernorm.weight")
    if c.fused_projections:
        qkv = r("self_attn.qkv_proj.weight")  # rows: q heads, then k heads, then v heads
        q_rows, kv_rows = c.num_heads * hd, hkv * hd
        wq, wk, wv = np.split(qkv, [q_rows, q_rows + kv_rows])
        wg, wu = np.split(r("mlp.gate_up_proj.weight"), 2)  # gate rows, then up rows
    else:
        wq, wk, wv = (r(f"self_attn.{n}_proj.weight") for n in "qkv")
    wqkv = out["wqkv"][i]  # [Hkv, G + 2, hd, D]
    wqkv[:, :g] = wq.reshape(hkv, g, hd, d)
    wqkv[:, g] = wk.reshape(hkv, hd, d)
    wqkv[:, g + 1] = wv.reshape(hkv, hd, d)
    if c.qkv_bias:
        bqkv = out["bqkv"][i]  # [Hkv, G + 2, hd]
        bqkv[:, :g] = r("self_attn.q_proj.bias").reshape(hkv, g, hd)
        bqkv[:, g] = r("self_attn.k_proj.bias").reshape(hkv, hd)
        bqkv[:, g + 1] = r("self_attn.v_proj.bias").reshape(hkv, hd)
    if c.qk_norm:
        out["q_norm"][i] = r("self_attn.q_norm.weight")
        out["k_norm"][i] = r("self_attn.k_norm.weight")
    out["wo"][i] = r("self_attn.o_proj.weight").reshape(d, hkv, g, hd)
    if c.num_experts:
        moe, (gate, up, down) = _moe_names(c)
        out["router"][i] = r(moe + "gate.weight")
        for e in range(c.num_experts):
            expert = f"{moe}experts.{e}."
            out["w_experts_gate_up"][i, e, 0] = r(expert + gate + ".weight")
            out["w_experts_gate_up"][i, e, 1] = r(expert + up + ".weight")
            out["w_experts_down"][i, e] = r(expert + down + ".weight")
        return
    if not c.fused_projections:
        wg, wu = r("mlp.gate_proj.weight"), r("mlp.up_proj.weight")
    out["w_gate_up"][i, 0] = wg
    out["w_gate_up"][i, 1] = wu
    out["w_down"][i] = r("mlp.down_proj.weight")


def load_host_params(
    read: TensorReader, config: ModelConfig, layers: dict[str, Any]
) -> dict[str, Any]:
    """The params tree from HF tensors: ``layers`` (the stacked buffers of
    ``param_shapes(config)["layers"]``, float or a pre-quantized checkpoint's) filled in
    place, the embedding, final norm and vocabulary projection read."""
    for i in range(config.num_layers):
        _fill_layer(layers, i, read, config)
    d, v = config.hidden_size, config.vocab_size
    host: dict[str, Any] = {
        "embed": read("model.embed_tokens.weight", (v, d)),
        "layers": layers,
        "final_norm": read("model.norm.weight", (d,)),
    }
    if not config.tie_word_embeddings:
        host["lm_head"] = read("lm_head.weight", (v, d))
    return host


# ------------------------------------------------------------------- family

# The decoder layer's linears (models/linear.py), each with its Megatron split over the
# params layout above: q/k/v (column-parallel) and the output projection (row-parallel) by
# KV heads, the MLP by F; its pre-quantized checkpoint modules and its LoRA sites
# (`lora_layout`). The MoE router and experts run in XLA einsums of their own (_moe_mlp),
# so they are no linears: they stay float under int8 / fp8
LINEARS: tuple[Linear, ...] = (
    Linear(
        leaf="wqkv",  # [L, Hkv, G + 2, hd, D] -> [L, Hkv * (G + 2) * hd, D]
        split=1,
        hf_modules=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        lora=("qkv",),
    ),
    Linear(
        leaf="wo",  # [L, D, Hkv, G, hd] -> [L, D, Hq * hd]
        in_axes=3,
        split=2,
        hf_modules=("self_attn.o_proj",),
        lora=("o",),
    ),
    Linear(
        leaf="w_gate_up",  # [L, 2, F, D] -> [2L, F, D]: gate of layer l at 2l, up at 2l + 1
        stack_axes=2,
        split=2,
        hf_modules=("mlp.gate_proj", "mlp.up_proj"),
        lora=("gate", "up"),
    ),
    Linear(leaf="w_down", split=2, hf_modules=("mlp.down_proj",), lora=("down",)),  # [L, D, F]
)
# every "layers" leaf tensor parallelism splits: the linears', q/k/v's bias as wqkv, and
# every expert's F (the router and the norms are replicated)
LAYER_SPLITS: Mapping[str, int] = MappingProxyType(
    {**linear_splits(LINEARS), "bqkv": 1, "w_experts_gate_up": 3, "w_experts_down": 3}
)

# llama.cpp's per-layer tensor names -> transformers' (convert_hf_to_gguf.py)
GGUF_LAYER_TENSORS: Mapping[str, str] = MappingProxyType(
    {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
)
GGUF_NORMS = MappingProxyType(
    {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
)


def gguf_config(g: GgufMetadata, config: dict[str, Any]) -> dict[str, Any]:
    """A Llama GGUF file's biases and Llama 3.1 rope scaling."""
    return {
        **config,
        "attention_bias": g.has_tensor("blk.0.attn_q.bias"),
        "mlp_bias": g.has_tensor("blk.0.ffn_up.bias"),
        "rope_scaling": _gguf_rope_scaling(g, config["head_dim"], config["rope_theta"]),
    }


def _gguf_rope_scaling(g: GgufMetadata, head_dim: int, theta: float) -> dict | None:
    """Recover Llama 3.1 rope scaling, which llama.cpp stores only as the `rope_freqs` tensor
    (per-frequency divisors), by matching it against the parameters Meta published."""
    if not g.has_tensor("rope_freqs.weight"):
        return None
    factors = g.float_tensor("rope_freqs.weight").reshape(-1)
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    for factor in (8.0, 16.0, 32.0, 4.0, 2.0):
        for low, high, original in ((1.0, 4.0, 8192),):
            low_wl, high_wl = original / low, original / high
            smooth = (original / wavelen - low) / (high - low)
            expect = np.where(
                wavelen < high_wl,
                1.0,
                np.where(wavelen > low_wl, factor, 1.0 / ((1 - smooth) / factor + smooth)),
            )
            if expect.shape == factors.shape and np.allclose(expect, factors, rtol=1e-4):
                return {
                    "rope_type": "llama3",
                    "factor": factor,
                    "low_freq_factor": low,
                    "high_freq_factor": high,
                    "original_max_position_embeddings": original,
                }
    raise ValueError(
        f"GGUF tensor 'rope_freqs.weight' of {g.path} matches no known llama3 rope scaling"
    )
