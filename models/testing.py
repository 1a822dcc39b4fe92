"""A tiny config and random params, for tests that compare two ways of running a model."""

from __future__ import annotations

import numpy as np

from .config import ModelConfig
from .llama import Params, param_shapes


def tiny_config(**overrides) -> ModelConfig:
    """A 2-layer Qwen2-style config (q/k/v bias, GQA 4:1, every output size a multiple of 16)."""
    base = dict(
        model_type="qwen2",
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=8,
        num_kv_heads=2,
        head_dim=8,
        qkv_bias=True,
    )
    return ModelConfig(**{**base, **overrides})


def random_params(config: ModelConfig, seed: int = 0, scale: float = 0.3) -> Params:
    """Host (numpy) float32 params, every leaf drawn from N(0, scale)."""
    rng = np.random.default_rng(seed)

    def make(shape):
        if isinstance(shape, dict):
            return {k: make(v) for k, v in shape.items()}
        return rng.normal(0, scale, shape).astype(np.float32)

    return make(param_shapes(config))


# A Llama/Qwen2 decoder layer's transformers parameter names against llama.cpp's GGUF tensor
# names (convert_hf_to_gguf.py), for tests that write GGUF files from a transformers model.
HF_TO_GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_HF_TO_GGUF_TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_tensor_name(hf_name: str) -> str:
    """The GGUF tensor name of a Llama/Qwen2 transformers parameter ("model.layers.3.mlp.
    up_proj.weight" -> "blk.3.ffn_up.weight")."""
    top = _HF_TO_GGUF_TOP_NAMES.get(hf_name)
    if top is not None:
        return top
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{HF_TO_GGUF_LAYER_NAMES[rest]}"
