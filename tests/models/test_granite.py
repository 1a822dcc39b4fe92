"""Granite against transformers on a tiny random-weight GraniteForCausalLM: float32 logits,
greedy tokens through the paged engine (batching, chunked prefill, warmed up so that
serving compiles nothing), a PEFT LoRA adapter, and int8 weights. Its four scalars are far
from 1 so that each one bites; the features come from the Llama layer it is declared on."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers

from jaxpaged import LLM, LoRARequest, SamplingParams
from jaxpaged.engine import LLMEngine
from jaxpaged.models import compute_logits, forward, load_model
from jaxpaged.models.quant import QuantizedWeight
from jaxpaged.models.registry import family_of, parse_config

VOCAB = 128
SEQ = 24
MULTIPLIERS = dict(
    embedding_multiplier=3.0,
    residual_multiplier=0.5,
    attention_multiplier=0.4,  # head_dim ** -0.5 would be 0.25
    logits_scaling=2.5,
)
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.1,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    **MULTIPLIERS,
)


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.GraniteForCausalLM(transformers.GraniteConfig(**TINY)).eval()
    folder = tmp_path_factory.mktemp("granite")
    hf.save_pretrained(folder)
    _tiny_tokenizer().save_pretrained(folder)  # the engine loads one; prompts are token ids
    return hf, str(folder)


def _tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over VOCAB made-up words."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i for i in range(4, VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="<pad>",
    )  # fmt: skip


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


def test_config_is_read_by_its_architecture(granite):
    _, folder = granite
    config, _ = load_model(folder, dtype="float32", progress=False)
    assert config.model_type == "granite" and family_of(config).name == "granite"
    assert {k: getattr(config, k) for k in MULTIPLIERS} == MULTIPLIERS
    with pytest.raises(ValueError, match="mlp_bias"):
        parse_config({**transformers.GraniteConfig(**TINY, mlp_bias=True).to_dict()})


def test_logits_and_greedy_match_transformers(granite):
    hf, folder = granite
    config, params = load_model(folder, dtype="float32", progress=False)

    def logits_of(config):
        @jax.jit
        def run(tokens):
            hidden, _ = forward(params, tokens, jnp.arange(SEQ, dtype=jnp.int32), config=config)
            return compute_logits(params, hidden, config=config)

        return run

    tokens = np.random.default_rng(1).integers(3, VOCAB, size=SEQ)
    with torch.no_grad():
        want = hf(torch.tensor(tokens[None])).logits[0].numpy()
    logits = logits_of(config)
    got = np.asarray(logits(jnp.asarray(tokens, jnp.int32)))
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4
    # each scalar matters: the same weights read as plain Llama give other logits
    for name in MULTIPLIERS:
        plain = dataclasses.replace(
            config, **{name: None if name == "attention_multiplier" else 1.0}
        )
        other = np.asarray(logits_of(plain)(jnp.asarray(tokens, jnp.int32)))
        assert np.abs(other - want).max() / np.abs(want).max() > 1e-2, name

    prompt = [int(t) for t in tokens[:7]]
    seq = list(prompt)
    while len(seq) < len(prompt) + 10:
        padded = jnp.asarray(seq + [0] * (SEQ - len(seq)), jnp.int32)
        seq.append(int(jnp.argmax(logits(padded)[len(seq) - 1])))
    assert seq[len(prompt) :] == _hf_greedy(hf, prompt, 10)


def test_greedy_through_the_paged_engine_compiles_nothing_after_warmup(granite):
    """Three prompts batched, the longest prefilled in chunks beside the others' decodes."""
    hf, folder = granite
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(3, VOCAB, size=n)] for n in (13, 5, 9)]
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    llm = LLM(
        model=folder,
        max_model_len=32,
        max_num_seqs=4,
        num_kv_blocks=32,
        block_size=4,
        max_num_batched_tokens=8,
        show_progress=False,
    )
    try:
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        metrics = llm.get_metrics()
    finally:
        llm.engine.close()
    assert [list(o.outputs[0].token_ids) for o in outs] == [_hf_greedy(hf, p, 10) for p in prompts]
    assert metrics["num_compilations_after_warmup"] == 0
    assert metrics["num_free_blocks"] == metrics["num_kv_blocks"]


def test_lora_adapter_equals_peft(granite, tmp_path):
    """A PEFT adapter on every linear, beside a request without one in the same batch: each
    greedy output equals PEFT's (the adapter's terms are scaled by residual_multiplier with
    the product they add to). Eager: the test above checks the warm-up, and
    tests/engine/test_lora.py that LoRA serving compiles nothing after it."""
    hf, folder = granite
    torch.manual_seed(5)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = peft.get_peft_model(
        transformers.GraniteForCausalLM.from_pretrained(folder),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets),
    )
    for name, p in peft_model.named_parameters():
        if "lora_" in name:
            torch.nn.init.normal_(p, std=0.3)
    peft_model.save_pretrained(tmp_path / "adapter")
    peft_model.eval()
    prompts = [[5, 17, 40, 99, 6], [9, 9, 30, 7]]
    with peft_model.disable_adapter():
        want_base = _hf_greedy(peft_model, prompts[1], 8)
    want_lora = _hf_greedy(peft_model, prompts[0], 8)
    assert want_lora != _hf_greedy(hf, prompts[0], 8)  # the adapter changes the output

    config, params = load_model(folder, progress=False)
    engine = LLMEngine.from_params(
        config, params, max_model_len=32, max_num_seqs=2, num_kv_blocks=16,
        show_progress=False, enable_lora=True, max_lora_rank=4, enforce_eager=True,
    )  # fmt: skip
    try:
        greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        adapter = LoRARequest("granite", 1, str(tmp_path / "adapter"))
        outs = LLM.from_engine(engine).generate(
            prompts, greedy, lora_request=[adapter, None], use_tqdm=False
        )
    finally:
        engine.close()
    assert [list(o.outputs[0].token_ids) for o in outs] == [want_lora, want_base]


def test_int8_weights(granite):
    """int8 weights at load: the matmul weights are quantized and the logits stay within the
    per-channel rounding's reach of the float model's."""
    _, folder = granite
    config, params = load_model(folder, dtype="float32", progress=False)
    _, q8 = load_model(folder, dtype="float32", quantization="int8", progress=False)
    assert isinstance(q8["layers"]["wqkv"], QuantizedWeight)
    tokens = jnp.asarray(np.random.default_rng(3).integers(3, VOCAB, size=SEQ), jnp.int32)
    positions = jnp.arange(SEQ, dtype=jnp.int32)

    def logits(p):
        return np.asarray(
            compute_logits(p, forward(p, tokens, positions, config=config)[0], config=config)
        )

    want, got = logits(params), logits(q8)
    assert 0 < np.abs(got - want).max() / np.abs(want).max() < 5e-2
