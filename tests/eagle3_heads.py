"""A random EAGLE-3 head in the published checkpoint layout (safetensors + config.json:
``midlayer``, ``fc``, ``d2t`` / ``t2d``), for tests: no trained head is available offline."""

from __future__ import annotations

import json

import numpy as np
from safetensors.numpy import save_file

__all__ = ["write_eagle3_head"]


def write_eagle3_head(path, *, target, aux=(1, 0, 1), draft_vocab: int = 64, keep=None,
                      num_heads: int = 4, seed: int = 3):  # fmt: skip
    """A random head for ``target`` (a ModelConfig) in the published layout (``aux`` None:
    no layer ids, vLLM's default; ``keep``: the target ids of its draft vocabulary, else
    ``draft_vocab`` chosen at random); returns its tensors by checkpoint name."""
    rng = np.random.default_rng(seed)
    h, hd, f = target.hidden_size, target.head_dim, 48
    nq, nkv = num_heads, target.num_kv_heads  # the head's query heads; its KV: the target's

    def w(*shape, scale=0.3):
        return rng.normal(0, scale, shape).astype(np.float32)

    if keep is None:
        keep = rng.choice(target.vocab_size, draft_vocab, replace=False)
    keep = np.sort(np.asarray(keep, np.int64))
    draft_vocab = len(keep)
    t2d = np.zeros(target.vocab_size, bool)
    t2d[keep] = True
    tensors = {
        "fc.weight": w(h, 3 * h),
        "midlayer.hidden_norm.weight": 1 + w(h, scale=0.1),
        "midlayer.input_layernorm.weight": 1 + w(h, scale=0.1),
        "midlayer.post_attention_layernorm.weight": 1 + w(h, scale=0.1),
        "midlayer.self_attn.q_proj.weight": w(nq * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": w(nkv * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": w(nkv * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": w(h, nq * hd),
        "midlayer.mlp.gate_proj.weight": w(f, h),
        "midlayer.mlp.up_proj.weight": w(f, h),
        "midlayer.mlp.down_proj.weight": w(h, f),
        "norm.weight": 1 + w(h, scale=0.1),
        "lm_head.weight": w(draft_vocab, h, scale=1.0),
        "d2t": (keep - np.arange(draft_vocab)).astype(np.int64),
        "t2d": t2d,
    }
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": f,
        "num_hidden_layers": 1,
        "num_attention_heads": nq,
        "num_key_value_heads": nkv,
        "head_dim": hd,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "vocab_size": target.vocab_size,
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": h,
    }
    if aux is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux)}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    return tensors
