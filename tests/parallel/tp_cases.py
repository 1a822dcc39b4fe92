"""Tiny random Llama-family checkpoints and engine settings shared by the parallel tests.

Models are written with transformers' own configs and ``save_pretrained`` (random weights,
fixed seed) plus a word-level tokenizer, so the engine loads them as it loads any checkpoint.
"""

from __future__ import annotations

import os

# Single-token prompts: every step is a decode step, so one compiled program serves a whole
# generation (compiles dominate on small CPUs); the bundled-model test covers prefill.
PROMPTS = [[5], [17], [42]]
MAX_TOKENS = 10
ENGINE_ARGS = dict(
    max_model_len=64,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    num_kv_blocks=32,
    enforce_eager=True,
)

# family -> (transformers config class name, kwargs). Heads/KV heads are chosen so that
# TP 2 and 4 cover plain splits and KV-head replication (KV heads < N), vocabularies so that
# both the vocab-split and the replicated embedding/LM head occur.
FAMILIES: dict[str, tuple[str, dict]] = {
    # GQA 8 q / 2 kv: TP 4 replicates each KV head twice
    "llama": ("LlamaConfig", dict(num_attention_heads=8, num_key_value_heads=2, vocab_size=256)),
    # q/k/v bias, tied embeddings, vocab 250: split at TP 2, replicated at TP 4
    "qwen2": (
        "Qwen2Config",
        dict(
            num_attention_heads=4, num_key_value_heads=4, vocab_size=250, tie_word_embeddings=True
        ),
    ),
    # q/k norm, explicit head_dim
    "qwen3": (
        "Qwen3Config",
        dict(num_attention_heads=8, num_key_value_heads=4, head_dim=16, vocab_size=256),
    ),
    # MQA (1 kv head): TP 2 and 4 both replicate it
    "mistral": (
        "MistralConfig",
        dict(num_attention_heads=4, num_key_value_heads=1, vocab_size=256, sliding_window=None),
    ),
}


def make_tiny_model(family: str, path: str | os.PathLike, *, seed: int = 0) -> str:
    """Write a random 2-layer checkpoint of ``family`` (see FAMILIES) and a tokenizer."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    cls_name, kwargs = FAMILIES[family]
    kwargs = dict(kwargs)
    config = getattr(transformers, cls_name)(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=128,
        initializer_range=0.1,  # spread logits: no near-ties in greedy decoding
        tie_word_embeddings=kwargs.pop("tie_word_embeddings", False),
        **kwargs,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    path = os.fspath(path)
    model.save_pretrained(path)
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1").save_pretrained(path)
    return path
