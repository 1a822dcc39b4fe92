"""The Flax Llama family against Hugging Face transformers on tiny random-weight models.

Each family is built in transformers with random weights, saved with `save_pretrained`, loaded
with `load_model`, and must reproduce transformers' float32 logits and its greedy tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import jaxpaged
from jaxpaged import SamplingParams
from jaxpaged.models import compute_logits, dense_causal_attention, forward, load_model
from jaxpaged.models.registry import parse_config

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.1,  # larger than default so logits are far from ties
)

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "llama3-rope": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            rope_theta=50000.0,
            # original context 32 so that low, medium and high frequency bands all occur
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
    ),
    "llama-tied": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(tie_word_embeddings=True, num_key_value_heads=1),
    ),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=32)),
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(num_key_value_heads=4, sliding_window=None),
    ),
    # a window much shorter than SEQ, so outputs differ from full attention
    "mistral-window": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(sliding_window=8),
    ),
    # fused qkv_proj and gate_up_proj; a sliding window shorter than SEQ
    "phi3": (
        transformers.Phi3Config,
        transformers.Phi3ForCausalLM,
        dict(sliding_window=16, pad_token_id=0),
    ),
    "mixtral": (
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    ),
    # routing weights not renormalized (transformers' default for Qwen3-MoE, unlike Mixtral)
    "qwen3-moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, head_dim=32),
    ),
    # short factors before position 64, long ones from it (logits run at 0.. and 100..)
    "phi3-longrope": (
        transformers.Phi3Config,
        transformers.Phi3ForCausalLM,
        dict(
            pad_token_id=0,
            original_max_position_embeddings=64,
            rope_scaling=dict(
                rope_type="longrope",
                short_factor=[1.0 + 0.1 * i for i in range(8)],
                long_factor=[2.0 + 0.3 * i for i in range(8)],
            ),
        ),
    ),
    "llama-linear-rope": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(rope_scaling=dict(rope_type="linear", factor=4.0)),
    ),
    "qwen2-yarn": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        # original context 64: the ramp between interpolated and kept frequencies is inside
        # head_dim; attention_factor from factor (cos and sin scaled)
        dict(rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)),
    ),
}


SEQ = 40  # one compiled shape per family: logits, shifted positions and greedy steps share it


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """build(name) -> (HF model, saved folder), made once per family per module."""
    made = {}

    def get(name: str):
        if name not in made:
            config_cls, model_cls, extra = FAMILIES[name]
            torch.manual_seed(sorted(FAMILIES).index(name))
            hf = model_cls(config_cls(**{**TINY, **extra})).eval()
            folder = tmp_path_factory.mktemp(name)
            hf.save_pretrained(folder)
            made[name] = hf, str(folder)
        return made[name]

    return get


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, build):
    """(name, HF model, config, params, logits_fn) with logits_fn(tokens [SEQ], positions [SEQ])."""
    hf, folder = build(request.param)
    config, params = load_model(folder, dtype="float32", progress=False)

    @jax.jit
    def logits_fn(tokens, positions):
        hidden, _ = forward(params, tokens, positions, config=config)
        return compute_logits(params, hidden, config=config)

    return request.param, hf, config, params, logits_fn


def test_logits_match_transformers(family):
    name, hf, config, params, logits_fn = family
    assert config.model_type == hf.config.model_type
    if name == "llama3-rope":
        assert config.rope_scaling is not None and config.rope_scaling.factor == 8.0
    if name == "llama-tied":
        assert config.tie_word_embeddings and "lm_head" not in params
    tokens = np.random.default_rng(1).integers(0, TINY["vocab_size"], size=SEQ)
    # Rope must use the positions given, not the row index: also run at positions 100..139.
    for start in (0, 100):
        positions = np.arange(start, start + SEQ)
        with torch.no_grad():
            want = hf(torch.tensor(tokens[None]), position_ids=torch.tensor(positions[None]))
        want = want.logits[0].numpy()
        got = np.asarray(
            logits_fn(jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32))
        )
        assert got.dtype == np.float32 and got.shape == want.shape
        assert rel_err(got, want) < 1e-4, (name, start)


def test_greedy_tokens_match_transformers(family):
    """Full-forward greedy (causal, so padding after the sequence does not matter) equals HF
    generate token for token."""
    name, hf, config, params, logits_fn = family
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, TINY["vocab_size"], size=7)]
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=16,
            do_sample=False,
            pad_token_id=0,
        )
    want = out[0, len(prompt) :].tolist()
    assert len(want) == 16 or want[-1] in config.eos_token_ids
    seq = list(prompt)
    positions = jnp.arange(SEQ, dtype=jnp.int32)
    while len(seq) - len(prompt) < len(want):
        padded = jnp.asarray(seq + [0] * (SEQ - len(seq)), jnp.int32)
        seq.append(int(jnp.argmax(logits_fn(padded, positions)[len(seq) - 1])))
    assert seq[len(prompt) :] == want, name


def test_attention_fn_receives_layer_and_threads_cache(build):
    """The attention hook sees every layer index once, in order, and its cache is carried."""
    _, folder = build("llama")
    config, params = load_model(folder, dtype="float32", progress=False)

    def recording(q, k, v, layer, cache):
        assert q.shape == (5, config.num_heads, config.head_dim)
        assert k.shape == v.shape == (5, config.num_kv_heads, config.head_dim)
        out, _ = dense_causal_attention(q, k, v, layer, None)
        return out, cache.at[layer].set(cache[layer - 1] * 10 + layer + 1)

    tokens = jnp.arange(5, dtype=jnp.int32)
    cache = jnp.zeros(config.num_layers, jnp.int32)
    hidden, cache = jax.jit(
        lambda p, t, c: forward(p, t, t, config=config, attention_fn=recording, cache=c)
    )(params, tokens, cache)
    # layer 0 reads cache[-1] (still 0) -> 1; layer 1 reads layer 0's write -> 12
    assert cache.tolist() == [1, 12]
    plain, _ = jax.jit(lambda p, t: forward(p, t, t, config=config))(params, tokens)
    np.testing.assert_allclose(np.asarray(hidden), np.asarray(plain), rtol=1e-6, atol=1e-6)


def test_bfloat16_params_compute_in_bfloat16(build):
    hf, folder = build("llama")
    config, params = load_model(folder, dtype="bfloat16", progress=False)
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    tokens = np.arange(10) * 3

    @jax.jit
    def run(params, tokens):
        hidden, _ = forward(params, tokens, jnp.arange(10), config=config)
        return hidden, compute_logits(params, hidden, config=config)

    hidden, logits = run(params, jnp.asarray(tokens, jnp.int32))
    assert hidden.dtype == jnp.bfloat16
    assert logits.dtype == jnp.float32
    with torch.no_grad():
        want = hf(torch.tensor(tokens[None])).logits[0].numpy()
    assert rel_err(np.asarray(logits), want) < 5e-2


@pytest.mark.parametrize("name", ["mistral-window", "mixtral"])
def test_greedy_through_the_paged_engine(build, name):
    """Prompts three windows long, prefilled in chunks shorter than the window and decoded
    past it, beside other sequences: the engine's greedy tokens equal transformers' (which
    masks keys older than the window; routes each token to its top experts)."""
    hf, folder = build(name)
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(0, TINY["vocab_size"], size=n)] for n in (24, 13)]
    want = []
    for prompt in prompts:
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=12,
                do_sample=False,
                pad_token_id=0,
            )
        want.append(out[0, len(prompt) :].tolist())
    config, params = load_model(folder, dtype="float32", progress=False)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = jaxpaged.generate(
        prompts,
        greedy,
        params=params,
        config=config,
        max_model_len=64,
        num_kv_blocks=32,
        block_size=4,
        max_num_batched_tokens=6,
        enforce_eager=True,
    )
    got = [list(o.outputs[0].token_ids) for o in outs]
    # transformers stops at an end token, jaxpaged ignores it here: compare what both made
    assert [g[: len(w)] for g, w in zip(got, want, strict=True)] == want
    assert all(len(w) == 12 or w[-1] in config.eos_token_ids for w in want)


def test_the_sliding_window_matters(build):
    _, folder = build("mistral-window")
    config, params = load_model(folder, dtype="float32", progress=False)
    assert config.sliding_window == 8
    full = dataclasses.replace(config, sliding_window=None)
    tokens = jnp.asarray(np.arange(24) % TINY["vocab_size"], jnp.int32)
    logits = [
        compute_logits(params, forward(params, tokens, jnp.arange(24), config=c)[0], config=c)
        for c in (config, full)
    ]
    assert rel_err(np.asarray(logits[1]), np.asarray(logits[0])) > 1e-2


@pytest.mark.parametrize(
    "extra,named",
    [
        (dict(rope_scaling=dict(rope_type="dynamic")), "'dynamic' needs factor"),
        (dict(rope_scaling=dict(rope_type="longrope", factor=2.0)), "longrope.*needs"),
        (dict(model_type="qwen2", use_sliding_window=True), "use_sliding_window"),
        (dict(model_type="gpt_neox"), "'gpt_neox'"),
        (dict(model_type="qwen3_moe", decoder_sparse_step=2), "decoder_sparse_step=2"),
        (dict(model_type="qwen3_moe", mlp_only_layers=[0]), "mlp_only_layers"),
    ],
)
def test_unsupported_options_are_refused_by_name(extra, named):
    d = dict(
        model_type="llama",
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
    )
    with pytest.raises(ValueError, match=named):
        parse_config({**d, **extra})
