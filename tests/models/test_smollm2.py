"""The bundled SmolLM2-135M-Instruct (float32) against transformers' LlamaForCausalLM on the same
converted folder: full-sequence logits and greedy chat completions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import jaxpaged
from jaxpaged import SamplingParams
from jaxpaged.cli.generate import main
from jaxpaged.models import compute_logits, forward, load_model
from jaxpaged.models.loader import load_eos_token_ids


def encode_prompt(tokenizer, prompt: str, *, chat: bool) -> list[int]:
    assert chat
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
    )["input_ids"]


PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a hash table is.",
    "List three prime numbers greater than 10.",
]


@pytest.fixture(scope="module")
def models(bundled_model_path):
    """(folder, HF model, tokenizer, our config, our params), loaded once per module."""
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM.from_pretrained(bundled_model_path, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(bundled_model_path)
    config, params = load_model(bundled_model_path, dtype="float32", progress=False)
    return bundled_model_path, hf.eval(), tokenizer, config, params


def test_config_is_smollm2(models):
    _, _, _, config, params = models
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (
        30,
        576,
        9,
        3,
    )
    assert config.tie_word_embeddings and "lm_head" not in params
    assert params["layers"]["wqkv"].shape == (30, 3, 5, 64, 576)


def test_full_sequence_logits_match(models):
    _, hf, tokenizer, config, params = models
    text = encode_prompt(tokenizer, PROMPTS[2], chat=True)
    ids = text + tokenizer(" A hash table maps keys to values with hashing.")["input_ids"]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].numpy()

    @jax.jit
    def run(params, tokens):
        hidden, _ = forward(params, tokens, jnp.arange(tokens.shape[0]), config=config)
        return compute_logits(params, hidden, config=config)

    got = np.asarray(run(params, jnp.asarray(ids, jnp.int32)))
    assert got.shape == want.shape == (len(ids), 49152)
    rel = np.abs(got - want).max() / np.abs(want).max()
    assert rel < 1e-4, rel
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


@pytest.fixture(scope="module")
def hf_greedy(models) -> dict[str, list[int]]:
    """HF generate's greedy 32-token chat completion of each prompt (computed once)."""
    _, hf, tokenizer, _, _ = models
    out = {}
    for prompt in PROMPTS:
        ids = encode_prompt(tokenizer, prompt, chat=True)
        with torch.no_grad():
            gen = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=32,
                do_sample=False,
            )
        out[prompt] = gen[0, len(ids) :].tolist()
    return out


@pytest.mark.slow
def test_greedy_chat_completions_match(models, hf_greedy):
    folder, _, tokenizer, config, params = models
    eos = load_eos_token_ids(folder, config)
    assert eos  # SmolLM2 stops at <|im_end|>
    prompts = [encode_prompt(tokenizer, p, chat=True) for p in hf_greedy]
    outs = jaxpaged.generate(
        prompts,
        SamplingParams(temperature=0, max_tokens=32),
        params=params,
        config=config,
        tokenizer=tokenizer,
        eos_token_ids=eos,
        max_model_len=256,
        num_kv_blocks=64,
        enforce_eager=True,
    )
    for (prompt, want), out in zip(hf_greedy.items(), outs, strict=True):
        got = list(out.outputs[0].token_ids)
        assert got == want, (prompt, tokenizer.decode(got), tokenizer.decode(want))
    assert sum(map(len, hf_greedy.values())) >= 64  # real completions, not immediate EOS


@pytest.mark.slow
def test_cli_defaults_to_the_bundled_model(models, hf_greedy, capsys):
    """No --model: the bundled SmolLM2, through the one-sequence engine of the CLI."""
    _, _, tokenizer, _, _ = models
    want = tokenizer.decode(hf_greedy[PROMPTS[0]], skip_special_tokens=True)
    assert main(["--chat", "--max-tokens", "32", PROMPTS[0]]) == 0
    assert capsys.readouterr().out == want + "\n"
