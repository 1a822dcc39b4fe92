"""A tiny random Llama with the bundled model's tokenizer, written with numpy and safetensors
(no torch: importing it costs seconds per process), for tests that need a real checkpoint
and a real tokenizer but not sensible text: data parallelism, Ray Serve."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np

__all__ = ["write_tiny_llama"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def write_tiny_llama(
    folder: str | os.PathLike[str], *, max_position_embeddings: int = 512, seed: int = 0
) -> str:
    """Writes a 2-layer Llama (hidden 64, 4 query / 2 KV heads, float32, weights N(0, 0.02)
    as transformers initializes them, norms 1) and the bundled tokenizer into ``folder``;
    returns its path."""
    from tokenizers import Tokenizer

    from jaxpaged.models import default_model_path

    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    bundled = default_model_path()
    for name in _TOKENIZER_FILES:
        shutil.copy(os.path.join(bundled, name), os.path.join(folder, name))
    with open(os.path.join(bundled, "config.json")) as f:
        bundled_config = json.load(f)
    special = {k: bundled_config[k] for k in ("bos_token_id", "eos_token_id")}
    vocab = Tokenizer.from_file(os.path.join(folder, "tokenizer.json")).get_vocab_size()
    hidden, inter, layers, heads, kv_heads = 64, 96, 2, 4, 2
    head_dim = hidden // heads
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32",
        "attention_bias": False, "mlp_bias": False, **special,
    }  # fmt: skip
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> np.ndarray:
        return rng.normal(0.0, 0.02, shape).astype(np.float32)

    tensors = {
        "model.embed_tokens.weight": normal(vocab, hidden),
        "model.norm.weight": np.ones(hidden, np.float32),
        "lm_head.weight": normal(vocab, hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": normal(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": normal(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": normal(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": normal(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": normal(inter, hidden),
            p + "mlp.up_proj.weight": normal(inter, hidden),
            p + "mlp.down_proj.weight": normal(hidden, inter),
            p + "input_layernorm.weight": np.ones(hidden, np.float32),
            p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
        }
    from safetensors.numpy import save_file

    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return folder
