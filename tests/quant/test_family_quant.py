"""int8 / fp8 weights and the native CPU matmul on the families beyond Llama (Gemma 2, Gemma 3,
GPT-2, OPT, BLOOM), against transformers on tiny random-weight checkpoints.

The reference for a quantized model is transformers running the same checkpoint with every
weight the family declares quantized (`ModelFamily.matmul_weights`) rounded per output
channel here, in torch (``_fake_quantized``: symmetric, scale = the channel's absmax over
the format's largest value; int8 also rounds the vocabulary projection, fp8 leaves it
float): logits and served greedy tokens equal it. Against transformers' float model, the
quantized logits stay within a stated distance and the served tokens agree with its
greedy choice at a stated share of positions (teacher-forced, so one early flip does not
decide the rest, as tests/quant/test_quant_bundled.py measures Llama's)."""

from __future__ import annotations

import copy
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from jaxpaged import LLM, SamplingParams
from jaxpaged.kernels import cpu
from jaxpaged.kernels.cpu.backend import CpuBackend
from jaxpaged.kernels.cpu.linear_q8 import linear_q8
from jaxpaged.models.loader import load_model
from jaxpaged.models.quant import QuantizedWeight
from jaxpaged.models.registry import family_of
from jaxpaged.worker.model_hooks import ModelHooks

pytestmark = pytest.mark.skipif(not cpu.available(), reason="native CPU kernels did not build")

VOCAB = 256
SEQ = 20
S, F = "sliding_attention", "full_attention"
_GEMMA = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
    initializer_range=0.1, sliding_window=8, query_pre_attn_scalar=24, pad_token_id=0,
    bos_token_id=2, eos_token_id=1,
)  # fmt: skip
_GPT2 = dict(
    vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128, initializer_range=0.1,
    bos_token_id=0, eos_token_id=0,
)  # fmt: skip
_OPT = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, ffn_dim=96, num_attention_heads=4,
    max_position_embeddings=128, word_embed_proj_dim=64, init_std=0.1, pad_token_id=1,
    bos_token_id=2, eos_token_id=2,
)  # fmt: skip
_BLOOM = dict(
    vocab_size=VOCAB, hidden_size=48, n_layer=2, n_head=6, initializer_range=0.2,
    bos_token_id=1, eos_token_id=2, pad_token_id=3,
)  # fmt: skip
# every output size a multiple of the native matmul's 16-wide panels, so CPU serving runs it
FAMILIES = {
    "gemma2": lambda: transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(
            **_GEMMA, attn_logit_softcapping=20.0, final_logit_softcapping=10.0
        )
    ),
    "gemma3": lambda: transformers.Gemma3ForCausalLM(
        transformers.Gemma3TextConfig(**_GEMMA, layer_types=[S, F])
    ),
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(**_GPT2)),
    "opt": lambda: transformers.OPTForCausalLM(transformers.OPTConfig(**_OPT)),
    "bloom": lambda: transformers.BloomForCausalLM(transformers.BloomConfig(**_BLOOM)),
}
METHODS = ["int8", "fp8"]
# the quantized logits' largest distance from transformers' float ones, relative to the
# largest float logit (measured: int8 0.011-0.028, fp8 0.034-0.105), and the share of served
# tokens that are float transformers' greedy choice given the same prefix (measured: 0.81
# for BLOOM fp8, 0.94-1.0 for the rest)
LOGITS_BOUND = {"int8": 0.05, "fp8": 0.15}
AGREEMENT_BOUND = 0.75


def _tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over VOCAB made-up words (BLOOM's folder needs one to load; the
    tests prompt with token ids)."""
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
def checkpoints(tmp_path_factory):
    """name -> (transformers model, its folder); norms and biases randomized too, so that
    every parameter the forward reads matters."""
    made = {}
    for i, (name, make) in enumerate(FAMILIES.items()):
        torch.manual_seed(20 + i)
        hf = make().eval()
        with torch.no_grad():
            for p in hf.parameters():
                if p.ndim == 1:
                    p.add_(0.1 * torch.randn_like(p))
        folder = tmp_path_factory.mktemp(name)
        hf.save_pretrained(folder)
        _tiny_tokenizer().save_pretrained(folder)
        made[name] = hf, str(folder)
    return made


def _round_per_channel(w: torch.Tensor, method: str, in_dim: int) -> torch.Tensor:
    """``w`` quantized symmetrically per output channel (absmax over ``in_dim``) and back."""
    w = w.detach().float()
    qmax = 127.0 if method == "int8" else 448.0
    absmax = w.abs().amax(dim=in_dim, keepdim=True)
    scale = torch.where(absmax > 0, absmax / qmax, torch.ones_like(absmax))
    q = torch.clamp(w / scale, -qmax, qmax)
    q = torch.round(q) if method == "int8" else q.to(torch.float8_e4m3fn).float()
    return q * scale


def _fake_quantized(hf: transformers.PreTrainedModel, method: str):
    """A copy of ``hf`` whose decoder linears hold their per-channel rounded weights (GPT-2's
    Conv1D stores [in, out]); int8 also rounds the vocabulary projection, untied from the
    embedding table, which keeps its floats for the lookup."""
    model = copy.deepcopy(hf)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name == "lm_head":
                continue
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(_round_per_channel(module.weight, method, 1))
            elif type(module).__name__ == "Conv1D":
                module.weight.copy_(_round_per_channel(module.weight, method, 0))
        if method == "int8":
            head = _round_per_channel(model.lm_head.weight, method, 1)
            model.lm_head.weight = torch.nn.Parameter(head)
    return model


def _tokens() -> np.ndarray:
    return np.random.default_rng(1).integers(4, VOCAB, size=SEQ)


def _hf_logits(hf, tokens: np.ndarray) -> np.ndarray:  # [T, V]
    with torch.no_grad():
        return hf(torch.tensor(tokens[None].astype(np.int64))).logits[0].float().numpy()


def _run(params, config, tokens: np.ndarray, linear=None) -> np.ndarray:
    """The family's dense forward and float32 logits [T, V] over ``params``; ``linear``: the
    matmul of every projection, logits included (None: the model's default)."""
    graphdef = family_of(config).module.graphdef_for(config, params)
    kw = {} if linear is None else {"linear_fn": linear}

    @jax.jit
    def logits(params, tokens):
        module = nnx.merge(graphdef, params)
        hidden, _ = module(tokens, jnp.arange(tokens.shape[0], dtype=jnp.int32), **kw)
        return module.compute_logits(hidden, **kw)

    return np.asarray(logits(params, jnp.asarray(tokens, jnp.int32)))


def _relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_match_transformers(checkpoints, name, method):
    """Every declared matmul weight is quantized; the logits equal transformers' over the
    rounded weights and stay within the bound of its float model's."""
    hf, folder = checkpoints[name]
    config, params = load_model(folder, dtype="float32", quantization=method, progress=False)
    declared = family_of(config).matmul_weights
    quantized = {k for k, v in params["layers"].items() if isinstance(v, QuantizedWeight)}
    assert quantized == set(declared) and declared
    assert isinstance(params.get("lm_head"), QuantizedWeight) == (method == "int8")
    tokens = _tokens()
    got = _run(params, config, tokens)
    assert _relative(got, _hf_logits(_fake_quantized(hf, method), tokens)) < 1e-4
    distance = _relative(got, _hf_logits(hf, tokens))
    assert 0 < distance < LOGITS_BOUND[method]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_float_weights_run_in_the_native_matmul(checkpoints, name):
    """On a CPU the platform packs the family's float weights into panels (the tied
    vocabulary projection gets its own packed copy) and every matmul, logits included, runs
    in the native kernel, matching transformers."""
    hf, folder = checkpoints[name]
    config, params = load_model(folder, dtype="float32", progress=False)
    hooks = ModelHooks.of(config, params, None)
    backend = CpuBackend.select(params, hooks.weight_map, attention_backend="cpu", sharded=False)
    assert backend.native_linear and not backend.int8_weights
    packed = backend.pack_weights(params, hooks.weight_map)
    assert "lm_head" in packed and "lm_head" not in params
    for leaf in family_of(config).matmul_weights:
        assert packed["layers"][leaf].shape == params["layers"][leaf].shape
        assert not np.array_equal(packed["layers"][leaf], params["layers"][leaf]), leaf
    tokens = _tokens()
    linear = functools.partial(backend.kernels.linear, num_rows=SEQ)
    got = _run(packed, config, tokens, linear)
    assert _relative(got, _hf_logits(hf, tokens)) < 1e-4


def _hf_greedy(hf, ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=hf.config.pad_token_id or 0,
            eos_token_id=None,
        )
    return out[0, len(ids) :].tolist()


# an engine per (family, method) is the slow part: the default suite serves each family in
# one method, alternating (every method served by several families; the logits test above
# covers every pair); JAXPAGED_TEST_FULL=1 serves every pair
SERVED = [
    (name, method)
    for i, name in enumerate(FAMILIES)
    for j, method in enumerate(METHODS)
    if os.environ.get("JAXPAGED_TEST_FULL") == "1" or j == i % len(METHODS)
]


@pytest.mark.parametrize(("name", "method"), SERVED)
def test_served_greedy_tokens(checkpoints, name, method):
    """LLM(quantization=...) on the CPU platform (int8: the native int8 matmul; fp8: XLA's
    dots over fp8 values): the greedy tokens are transformers' over the rounded weights, and
    float transformers' own greedy choice at AGREEMENT_BOUND of the positions."""
    hf, folder = checkpoints[name]
    prompts = [[int(t) for t in _tokens()[:n]] for n in (11, 6)]
    new = 8
    llm = LLM(model=folder, quantization=method, max_model_len=32, max_num_seqs=2,
              num_kv_blocks=16, block_size=8, enforce_eager=True)  # fmt: skip
    try:
        assert llm.engine.runner.kernels.linear is (linear_q8 if method == "int8" else None)
        sp = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        outs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]
    finally:
        llm.engine.close()
    rounded = _fake_quantized(hf, method)
    assert outs == [_hf_greedy(rounded, p, new) for p in prompts]
    agree = []
    for prompt, out in zip(prompts, outs, strict=True):
        chosen = _hf_logits(hf, np.asarray(prompt + out[:-1])).argmax(-1)[len(prompt) - 1 :]
        agree.extend(chosen == np.asarray(out))
    assert np.mean(agree) >= AGREEMENT_BOUND
