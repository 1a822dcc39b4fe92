"""GPT-2 and OPT against transformers on tiny random-weight models: float32 logits, greedy
tokens through the paged engine (batching, chunked prefill), and the seeds' own example
``LLM(model=<an OPT folder>)`` with text prompts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

import jaxpaged
from jaxpaged import LLM, SamplingParams
from jaxpaged.kernels import cpu
from jaxpaged.models import load_model
from jaxpaged.models.gpt import GPTForCausalLM
from jaxpaged.models.registry import parse_config

VOCAB = 320
SEQ = 24
FAMILIES = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=VOCAB,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=128,
            initializer_range=0.1,
            bos_token_id=0,
            eos_token_id=0,
        )
    ),  # fmt: skip
    "opt": lambda: transformers.OPTForCausalLM(
        transformers.OPTConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            num_hidden_layers=2,
            ffn_dim=96,
            num_attention_heads=4,
            max_position_embeddings=128,
            word_embed_proj_dim=64,
            init_std=0.1,
            pad_token_id=1,
            bos_token_id=2,
            eos_token_id=2,
        )
    ),  # fmt: skip
}


def _tiny_tokenizer():
    """A byte-level BPE tokenizer of VOCAB tokens, trained here (no hub)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["Hello, my name is", "The president of the United States is", "The future of AI"]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<s>", "<pad>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(text * 20, trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    made = {}
    for i, (name, make) in enumerate(FAMILIES.items()):
        torch.manual_seed(i)
        hf = make().eval()
        folder = tmp_path_factory.mktemp(name)
        hf.save_pretrained(folder)
        _tiny_tokenizer().save_pretrained(folder)
        made[name] = hf, str(folder)
    return made


@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_match_transformers(built, name):
    hf, folder = built[name]
    config, params = load_model(folder, dtype="float32", progress=False)
    assert config.model_type == name and config.tie_word_embeddings and "lm_head" not in params
    graphdef = GPTForCausalLM.graphdef_for(config, params)

    @jax.jit
    def logits(params, tokens):
        module = nnx.merge(graphdef, params)
        return module.compute_logits(module(tokens, jnp.arange(SEQ, dtype=jnp.int32))[0])

    tokens = np.random.default_rng(1).integers(0, VOCAB, size=SEQ)
    got = np.asarray(logits(params, jnp.asarray(tokens, jnp.int32)))
    with torch.no_grad():
        want = hf(torch.tensor(tokens[None])).logits[0].numpy()
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4


def _hf_greedy(hf, ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=1,
            eos_token_id=None,
        )
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_through_the_paged_engine(built, name):
    """Token-id prompts batched, the longest prefilled in chunks beside the others' decodes;
    for OPT the engine is built as the seeds' example writes it, ``LLM(model=<an OPT
    folder>)``, and also takes text prompts and sampling."""
    hf, folder = built[name]
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(3, VOCAB, size=n)] for n in (13, 5, 9)]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    # max_num_batched_tokens=8: the 13-token prompt prefills in chunks beside decodes
    engine = dict(
        max_model_len=64,
        num_kv_blocks=32,
        block_size=4,
        max_num_batched_tokens=8,
        enforce_eager=True,
    )
    if name == "gpt2":
        config, params = load_model(folder, dtype="float32", progress=False)
        outs = jaxpaged.generate(prompts, greedy, params=params, config=config, **engine)
    else:
        llm = LLM(model=folder, **engine)
        try:
            outs = llm.generate(prompts, greedy, use_tqdm=False)
            texts = ["Hello, my name is", "The future of AI"]
            text_outs = llm.generate(texts, greedy, use_tqdm=False)
            sampled = llm.generate(texts, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=6))
            if cpu.available():  # the CPU platform runs every matmul in its native kernel
                assert llm.engine.runner.kernels.linear is cpu.linear
        finally:
            llm.engine.close()
        tok = transformers.AutoTokenizer.from_pretrained(folder)
        for text, out, s in zip(texts, text_outs, sampled, strict=True):
            got = list(out.outputs[0].token_ids)
            assert got == _hf_greedy(hf, tok(text).input_ids, 8)
            assert out.outputs[0].text == tok.decode(got)
            assert 1 <= len(s.outputs[0].token_ids) <= 6
    assert [list(o.outputs[0].token_ids) for o in outs] == [_hf_greedy(hf, p, 8) for p in prompts]


@pytest.mark.parametrize(
    "extra,named",
    [
        (dict(model_type="opt", do_layer_norm_before=False), "do_layer_norm_before"),
        (dict(model_type="opt", word_embed_proj_dim=32), "word_embed_proj_dim"),
        (dict(model_type="opt", activation_function="silu_x"), "'silu_x'"),
        (dict(model_type="gpt2", scale_attn_by_inverse_layer_idx=True), "inverse_layer_idx"),
    ],
)
def test_unsupported_options_are_refused_by_name(extra, named):
    base = dict(
        vocab_size=32, hidden_size=16, n_embd=16, num_hidden_layers=1, n_layer=1,
        num_attention_heads=2, n_head=2, ffn_dim=32,
    )  # fmt: skip
    with pytest.raises(ValueError, match=named):
        parse_config({**base, **extra})


def test_tensor_parallel_split_rules():
    """GPT-2 / OPT split over whole heads (tests/parallel runs them on simulated devices):
    q/k/v over Hq * hd, the MLP over F, the row-parallel biases replicated."""
    from jax.sharding import PartitionSpec as P

    from jaxpaged.distributed.parallel import kv_replication, leaf_spec, split_axes

    config = parse_config(FAMILIES["opt"]().config.to_dict())
    opt, gpt2 = split_axes(config), split_axes(parse_config(FAMILIES["gpt2"]().config.to_dict()))
    assert kv_replication(config, 2) == 1
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        kv_replication(config, 3)
    assert leaf_spec("layers/wqkv", (2, 3, 64, 64), 2, opt) == P(None, None, "tp")
    assert leaf_spec("layers/b_fc", (2, 96), 2, gpt2) == P(None, "tp")
    assert leaf_spec("layers/w_proj", (2, 64, 96), 2, gpt2) == P(None, None, "tp")
    assert leaf_spec("layers/bo", (2, 64), 2, gpt2) == P()
    assert leaf_spec("pos_embed", (130, 64), 2, opt) == P()
