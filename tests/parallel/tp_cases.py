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
    # biased projections, learned positions, GELU MLP (F = 4 * 64); vocab 250: replicated
    "gpt2": ("GPT2Config", dict(n_head=4, vocab_size=250, bos_token_id=0, eos_token_id=1)),
    # learned positions at offset 2, ReLU MLP
    "opt": (
        "OPTConfig",
        dict(
            num_attention_heads=4,
            ffn_dim=128,
            word_embed_proj_dim=64,
            vocab_size=256,
            init_std=0.1,
            pad_token_id=0,
            bos_token_id=2,
            eos_token_id=1,
        ),  # fmt: skip
    ),
    # soft caps that clip, a window shorter than the generations, 2 KV heads (TP 4 replicates)
    "gemma2": (
        "Gemma2Config",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=256,
            sliding_window=4,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
            query_pre_attn_scalar=24,
            tie_word_embeddings=True,
            pad_token_id=0,
            bos_token_id=2,
            eos_token_id=1,
            norm_std=2.0,
        ),  # fmt: skip
    ),
    # q/k norms, local and global layers with their own rope bases
    "gemma3_text": (
        "Gemma3TextConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=256,
            num_hidden_layers=3,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            sliding_window=4,
            tie_word_embeddings=True,
            pad_token_id=0,
            bos_token_id=2,
            eos_token_id=1,
            norm_std=2.0,
        ),  # fmt: skip
    ),
    # the Llama layout with Granite's four scalars (models/granite.py), far from 1
    "granite": (
        "GraniteConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.4,
            logits_scaling=2.5,
        ),  # fmt: skip
    ),
    # 4 experts, top 2: F of every expert split
    "mixtral": (
        "MixtralConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=None,
        ),  # fmt: skip
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=256,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        ),  # fmt: skip
    ),
}


def make_tiny_model(family: str, path: str | os.PathLike, *, seed: int = 0) -> str:
    """Write a random 2-layer checkpoint of ``family`` (see FAMILIES) and a tokenizer."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    cls_name, kwargs = FAMILIES[family]
    # norm weights drawn N(0, norm_std) instead of constant: with tied, sqrt(D)-scaled
    # embeddings a tiny Gemma otherwise repeats its input token
    kwargs = dict(kwargs)
    norm_std = kwargs.pop("norm_std", None)
    base = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=128,
        initializer_range=0.1,  # spread logits: no near-ties in greedy decoding
        tie_word_embeddings=False,
    )
    config = getattr(transformers, cls_name)(**{**base, **kwargs})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    if norm_std is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0.0, norm_std)
    path = os.fspath(path)
    model.save_pretrained(path)
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1").save_pretrained(path)
    return path
