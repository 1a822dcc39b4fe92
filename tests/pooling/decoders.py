"""Tiny random-weight decoders saved by transformers (a whitespace word-level tokenizer
over made-up words, "yes" and "no" among them), and their hidden states as references."""

from __future__ import annotations

import numpy as np
import torch
import transformers

VOCAB = 96
TINY = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
    initializer_range=0.2, tie_word_embeddings=False,
)  # fmt: skip
# a small paged engine: prompts over 16 tokens take more than one step
ENGINE = dict(
    max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, block_size=4,
    num_kv_blocks=96, show_progress=False,
)  # fmt: skip


def word_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Whitespace words over <pad> <s> </s> <unk> yes no w6 .. w95."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "yes": 4, "no": 5}
    vocab.update({f"w{i}": i for i in range(6, VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                                pad_token="<pad>", eos_token="</s>")  # fmt: skip


def save_causal(folder, kind: str = "qwen3", seed: int = 0) -> torch.nn.Module:
    """A tiny random Qwen3ForCausalLM or LlamaForCausalLM and the tokenizer, saved."""
    torch.manual_seed(seed)
    if kind == "qwen3":
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TINY))
    else:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    hf.eval().save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    return hf


def hidden_states(hf: torch.nn.Module, ids: list[int]) -> np.ndarray:  # float32 [S, D]
    """transformers' final (normed) hidden states of one sequence."""
    with torch.no_grad():
        return hf.model(torch.tensor([ids])).last_hidden_state[0].numpy()
