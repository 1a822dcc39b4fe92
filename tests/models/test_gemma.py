"""Gemma 2 and Gemma 3 (text) against transformers on tiny random-weight models: float32
logits, and greedy tokens through the paged engine (batching, chunked prefill, preemption).

The configs make every Gemma feature bite: a sliding window shorter than the sequences,
soft caps small enough to clip, a query_pre_attn_scalar other than head_dim, Gemma 3's
local rope base and linearly scaled global rope, and a layer pattern that leaves a
remainder after the scanned periods."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from jaxpaged import LLM, SamplingParams
from jaxpaged.kernels import cpu
from jaxpaged.models import load_model
from jaxpaged.models.gemma import GemmaForCausalLM
from jaxpaged.models.registry import parse_config

VOCAB = 256
SEQ = 24
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    initializer_range=0.1,
    sliding_window=8,
    query_pre_attn_scalar=24,
    pad_token_id=0,
    bos_token_id=2,
    eos_token_id=1,
)
S, F = "sliding_attention", "full_attention"
FAMILIES = {
    "gemma2": lambda: transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(
            **TINY, num_hidden_layers=4, attn_logit_softcapping=2.0, final_logit_softcapping=3.0
        )
    ),
    # period (S, S, F) scanned once, then two layers unrolled
    "gemma3": lambda: transformers.Gemma3ForCausalLM(
        transformers.Gemma3TextConfig(
            **TINY,
            num_hidden_layers=5,
            layer_types=[S, S, F, S, S],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            },
        )
    ),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    made = {}
    for i, (name, make) in enumerate(FAMILIES.items()):
        torch.manual_seed(i)
        hf = make().eval()
        folder = tmp_path_factory.mktemp(name)
        hf.save_pretrained(folder)
        made[name] = hf, str(folder)
    return made


@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_match_transformers(built, name):
    hf, folder = built[name]
    config, params = load_model(folder, dtype="float32", progress=False)
    assert config.model_type == ("gemma2" if name == "gemma2" else "gemma3_text")
    graphdef = GemmaForCausalLM.graphdef_for(config, params)

    @jax.jit
    def logits(params, tokens):
        module = nnx.merge(graphdef, params)
        return module.compute_logits(module(tokens, jnp.arange(SEQ, dtype=jnp.int32))[0])

    tokens = np.random.default_rng(1).integers(3, VOCAB, size=SEQ)
    got = np.asarray(logits(params, jnp.asarray(tokens, jnp.int32)))
    with torch.no_grad():
        want = hf(torch.tensor(tokens[None])).logits[0].numpy()
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4
    if name == "gemma2":  # the final soft cap clips: |logits| < 3
        assert np.abs(want).max() < 3.0 and np.abs(want).max() > 1.0


def _hf_greedy(hf, ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_through_the_paged_engine(built, name):
    """Three prompts batched, the longest prefilled in chunks beside the others' decodes,
    in a pool too small for all three at once (preemption), each running past the window."""
    hf, folder = built[name]
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(3, VOCAB, size=n)] for n in (13, 5, 9)]
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    llm = LLM(
        model=folder,
        max_model_len=32,
        num_kv_blocks=12,  # three sequences need up to 6 blocks of 4 each
        block_size=4,
        max_num_batched_tokens=8,
        enforce_eager=True,
    )
    try:
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        preempted = llm.get_metrics()["num_preemptions"]
        linear = llm.engine.runner.kernels.linear
    finally:
        llm.engine.close()
    assert [list(o.outputs[0].token_ids) for o in outs] == [_hf_greedy(hf, p, 10) for p in prompts]
    assert preempted > 0
    assert linear is (cpu.linear if cpu.available() else None)  # the native matmul on a CPU


@pytest.mark.parametrize(
    "extra,named",
    [
        (dict(model_type="gemma2", attention_bias=True), "attention_bias"),
        (dict(model_type="gemma3_text", use_bidirectional_attention=True), "bidirectional"),
        (dict(model_type="gemma2", hidden_activation="silu"), "'silu'"),
        (dict(model_type="gemma3_text", layer_types=["chunked_attention"]), "chunked_attention"),
        (dict(model_type="gemma3"), "gemma3_text"),
        (
            dict(
                model_type="gemma3_text",
                rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0}},
            ),
            "sliding_attention",
        ),
    ],
)
def test_unsupported_options_are_refused_by_name(extra, named):
    base = dict(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2,
    )  # fmt: skip
    with pytest.raises(ValueError, match=named):
        parse_config({**base, **extra})


def test_layer_pattern_from_older_configs():
    """transformers 4's Gemma 3 config.json: sliding_window_pattern and rope_local_base_freq
    in place of layer_types and per-type rope_parameters."""
    config = parse_config(
        dict(
            model_type="gemma3_text", vocab_size=32, hidden_size=16, intermediate_size=32,
            num_hidden_layers=7, num_attention_heads=2, head_dim=8, sliding_window=4,
            sliding_window_pattern=3, rope_theta=1e6, rope_local_base_freq=1e4,
        )
    )  # fmt: skip
    assert config.layer_types == (S, S, F, S, S, F, S)
    assert (config.rope_theta, config.rope_local_theta) == (1e6, 1e4)
    assert config.query_pre_attn_scalar == 8.0


def test_tensor_parallel_split_rules():
    """Gemma splits as the Llama layout (tests/parallel runs it on simulated devices): KV
    heads replicated past their count, a clear error where heads do not divide."""
    from jaxpaged.distributed.parallel import kv_replication

    config = parse_config(FAMILIES["gemma2"]().config.to_dict())
    assert (kv_replication(config, 2), kv_replication(config, 4)) == (1, 2)
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        kv_replication(config, 3)


def test_dynamic_rope_is_refused():
    d = FAMILIES["gemma2"]().config.to_dict()
    d["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="gemma2 rope type 'dynamic'"):
        parse_config(d)
