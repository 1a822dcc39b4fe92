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
    folder: str | os.PathLike[str],
    *,
    max_position_embeddings: int = 512,
    seed: int = 0,
    words: int | None = None,
) -> str:
    """Writes a 2-layer Llama (hidden 64, 4 query / 2 KV heads, float32, weights N(0, 0.02)
    as transformers initializes them, norms 1) into ``folder`` and returns its path. Its
    tokenizer is the bundled model's, or with ``words`` a word-level one of that many tokens
    (``<unk>``, ``<s>``, ``</s>``, then ``w3``, ``w4``, ...: prompts are such words split by
    spaces), which an engine loads in milliseconds rather than seconds."""
    from tokenizers import Tokenizer

    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    if words is None:
        from jaxpaged.models import default_model_path

        bundled = default_model_path()
        for name in _TOKENIZER_FILES:
            shutil.copy(os.path.join(bundled, name), os.path.join(folder, name))
        with open(os.path.join(bundled, "config.json")) as f:
            bundled_config = json.load(f)
        special = {k: bundled_config[k] for k in ("bos_token_id", "eos_token_id")}
    else:
        _write_word_tokenizer(folder, words)
        special = {"bos_token_id": 1, "eos_token_id": 2}
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


def _write_word_tokenizer(folder: str, size: int) -> None:
    """A word-level tokenizer of ``size`` tokens (see write_tiny_llama), in the files
    transformers' AutoTokenizer reads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins the words with spaces
    tok.save(os.path.join(folder, "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", **special}, f)
    with open(os.path.join(folder, "special_tokens_map.json"), "w") as f:
        json.dump(special, f)
