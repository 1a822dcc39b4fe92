"""BLOOM (ALiBi) against transformers on a tiny random-weight model: float32 logits, and greedy
tokens through the paged engine (batching, chunked prefill, preemption) on the native "cpu"
attention backend and the "xla" one. Six heads: ALiBi's slopes for a head count that is not
a power of two."""

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
from jaxpaged.models.bloom import BloomForCausalLM
from jaxpaged.models.registry import parse_config
from jaxpaged.worker.compile_counter import CompileCounter

VOCAB = 320
SEQ = 24


def _hf_config(**extra) -> transformers.BloomConfig:
    return transformers.BloomConfig(
        vocab_size=VOCAB,
        hidden_size=48,
        n_layer=2,
        n_head=6,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        **extra,
    )


def _tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over VOCAB made-up words (the engine loads one from the folder;
    these tests prompt with token ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3}
    vocab.update({f"w{i}": i for i in range(4, VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="<pad>",
    )  # fmt: skip


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    made = {}
    for i, post in enumerate((False, True)):
        torch.manual_seed(10 + i)
        hf = transformers.BloomForCausalLM(
            _hf_config(apply_residual_connection_post_layernorm=post)
        ).eval()
        with torch.no_grad():  # random norms and biases, so that every parameter matters
            for name, p in hf.named_parameters():
                if "layernorm" in name or "ln_f" in name or name.endswith("bias"):
                    p.add_(0.3 * torch.randn_like(p))
        folder = tmp_path_factory.mktemp(f"bloom_post{int(post)}")
        hf.save_pretrained(folder)
        _tiny_tokenizer().save_pretrained(folder)
        made[post] = hf, str(folder)
    return made


@pytest.mark.parametrize("post", [False, True], ids=["pre_residual", "post_ln_residual"])
def test_logits_match_transformers(built, post):
    hf, folder = built[post]
    config, params = load_model(folder, dtype="float32", progress=False)
    assert config.model_type == "bloom" and config.alibi and config.residual_post_norm == post
    assert "lm_head" not in params  # tied
    graphdef = BloomForCausalLM.graphdef_for(config, params)

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
            pad_token_id=3,
            eos_token_id=None,
        )
    return out[0, len(ids) :].tolist()


BACKENDS = [
    pytest.param("cpu", marks=pytest.mark.skipif(not cpu.available(), reason="no C++ compiler")),
    "xla",
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_through_the_paged_engine(built, backend):
    """Three prompts, two at a time, the longest prefilled in chunks beside another's decodes,
    in a pool too small for two at once (preemption: recomputed from scratch, so ALiBi's
    positions must come out the same); after the warm-up nothing compiles."""
    hf, folder = built[False]
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(4, VOCAB, size=n)] for n in (13, 5, 9)]
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    llm = LLM(
        model=folder,
        max_model_len=32,
        num_kv_blocks=9,  # two running sequences need up to 6 + 4 blocks of 4 tokens
        block_size=4,
        max_num_batched_tokens=8,
        max_num_seqs=2,  # fewer step shapes to compile; the third prompt waits its turn
        attention_backend=backend,
    )
    try:
        with CompileCounter() as compiles:  # the warm-up compiled every step shape
            outs = llm.generate(prompts, greedy, use_tqdm=False)
        preempted = llm.get_metrics()["num_preemptions"]
        linear = llm.engine.runner.kernels.linear
    finally:
        llm.engine.close()
    assert [list(o.outputs[0].token_ids) for o in outs] == [_hf_greedy(hf, p, 10) for p in prompts]
    assert preempted > 0
    assert compiles.count == 0
    assert linear is (cpu.linear if backend == "cpu" else None)  # the native matmul with it


def test_unsupported_option_is_refused_by_name():
    d = _hf_config(slow_but_exact=True, pretraining_tp=2).to_dict()
    with pytest.raises(ValueError, match="slow_but_exact"):
        parse_config(d)


def test_tpu_backend_refuses_alibi_naming_the_model():
    from jaxpaged.engine.platform_choice import engine_platform

    config = parse_config(_hf_config().to_dict())
    with pytest.raises(ValueError, match=r"'bloom'.*ALiBi.*'tpu'"):
        engine_platform(
            config,
            {},  # the "tpu" backend packs no weights: none are read
            graphdef=None,
            params_dtype="float32",
            kv_dtype="float32",
            block_size=_cache_config().block_size,
            attention_backend="tpu",
            mesh=None,
        )


def _cache_config():
    from jaxpaged.args import EngineArgs

    return EngineArgs(model="unused").cache_config()


def test_bloom_model_checkpoint_without_prefix(built, tmp_path):
    """bigscience's BLOOM repositories store BloomModel tensors (``h.0...``, no
    ``transformer.`` prefix) and older configs spell ``n_embed`` / ``num_attention_heads``."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    _, folder = built[False]
    tensors = load_file(f"{folder}/model.safetensors")
    save_file(
        {k.removeprefix("transformer."): v for k, v in tensors.items()},
        str(tmp_path / "model.safetensors"),
    )
    with open(f"{folder}/config.json") as f:
        d = json.load(f)
    d["n_embed"], d["num_attention_heads"] = d.pop("hidden_size"), d.pop("n_head")
    (tmp_path / "config.json").write_text(json.dumps(d))
    shutil.copy(f"{folder}/tokenizer.json", tmp_path)
    want_config, want = load_model(folder, dtype="float32", progress=False)
    config, got = load_model(str(tmp_path), dtype="float32", progress=False)
    assert config == want_config
    jax.tree.map(np.testing.assert_array_equal, got, want)
