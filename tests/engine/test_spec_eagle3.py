"""EAGLE-3 speculative decoding on a tiny random target and a tiny random head saved in the
published checkpoint layout (safetensors + config.json). No trained head is available
offline, so the head's drafts are checked against a straightforward numpy reference written
here (the fc over the target's low/mid/high hidden states, the midlayer over the embedding
and hidden state, its norm, the reduced-vocabulary lm_head and d2t), and the engine's output
against the engine without speculation: a random head's drafts are mostly rejected, and
what matters is that the output is the target's, token for token."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from eagle3_heads import write_eagle3_head

from jaxpaged import LLM, SamplingParams
from jaxpaged.engine import LLMEngine
from jaxpaged.engine.spec_builder import check_eagle
from jaxpaged.models import eagle3
from jaxpaged.models.layers import dense_causal_attention
from jaxpaged.models.llama import LlamaForCausalLM
from jaxpaged.models.testing import random_params, tiny_config

CONFIG = tiny_config()  # test_spec_decode.py's target: its plain engine's programs are cached
AUX = (1, 0, 1)  # low / mid / high as the head's config names them (order and repeats kept)
DRAFT_VOCAB = 64
K = 3


def _write_head(path, **kwargs):
    return write_eagle3_head(path, target=CONFIG, aux=AUX, draft_vocab=DRAFT_VOCAB, **kwargs)


# ------------------------------------------------------------- numpy reference


def _rms(x, w, eps=1e-6):
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def _rope(x, pos, theta=10000.0):  # [T, H, hd], HF's rotate_half layout
    hd = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
    ang = np.asarray(pos, np.float64)[:, None] * inv  # [T, hd/2]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


class RefHead:
    """The head in numpy, one sequence, with its own K/V cache (positions 0, 1, ...)."""

    def __init__(self, t: dict[str, np.ndarray], embed: np.ndarray) -> None:
        self.t, self.embed = {k: v.astype(np.float64) for k, v in t.items()}, embed
        self.keys, self.values = [], []
        self.nq, self.nkv, self.hd = 4, CONFIG.num_kv_heads, CONFIG.head_dim

    def step(self, tokens, hidden, pos):  # tokens [n], hidden [n, H], pos [n] consecutive
        t, n = self.t, len(tokens)
        p = "midlayer."
        e = _rms(self.embed[tokens], t[p + "input_layernorm.weight"])
        residual = hidden
        x = np.concatenate([e, _rms(hidden, t[p + "hidden_norm.weight"])], -1)
        q = (x @ t[p + "self_attn.q_proj.weight"].T).reshape(n, self.nq, self.hd)
        k = (x @ t[p + "self_attn.k_proj.weight"].T).reshape(n, self.nkv, self.hd)
        v = (x @ t[p + "self_attn.v_proj.weight"].T).reshape(n, self.nkv, self.hd)
        q, k = _rope(q, pos), _rope(k, pos)
        self.keys += list(k)
        self.values += list(v)
        keys, values = np.stack(self.keys), np.stack(self.values)  # [P, Hkv, hd]
        g = self.nq // self.nkv
        out = np.zeros((n, self.nq, self.hd))
        for i in range(n):
            visible = pos[i] + 1
            for head in range(self.nq):
                s = keys[:visible, head // g] @ q[i, head] / np.sqrt(self.hd)
                a = np.exp(s - s.max())
                out[i, head] = (a / a.sum()) @ values[:visible, head // g]
        residual = residual + out.reshape(n, -1) @ t[p + "self_attn.o_proj.weight"].T
        h = _rms(residual, t[p + "post_attention_layernorm.weight"])
        gate, up = h @ t[p + "mlp.gate_proj.weight"].T, h @ t[p + "mlp.up_proj.weight"].T
        residual = residual + (gate / (1 + np.exp(-gate)) * up) @ t[p + "mlp.down_proj.weight"].T
        normed = _rms(residual, t["norm.weight"])
        best = np.argmax(normed @ t["lm_head.weight"].T, axis=-1)
        return best + self.t["d2t"][best].astype(np.int64), residual


@functools.partial(jax.jit, static_argnames=("num_layers", "aux_layers"))
def _forward(params, tokens, *, num_layers, aux_layers=()):  # int32 [n]
    """The target's first ``num_layers`` layers (the jnp forward, dense attention), one
    program (op by op it compiled every op of it)."""
    model = LlamaForCausalLM.from_params(dataclasses.replace(CONFIG, num_layers=num_layers), params)
    return model(tokens, jnp.arange(tokens.shape[0], dtype=jnp.int32), aux_layers=aux_layers)


def _target_aux(params, tokens):  # [n] -> [n, 3H]
    tokens = jnp.asarray(tokens, jnp.int32)
    _, _, aux = _forward(params, tokens, num_layers=CONFIG.num_layers, aux_layers=AUX)
    return np.asarray(aux, np.float64)


def _ref_drafts(tensors, params, aux, context, k):
    """The drafts after ``context`` (prompt and output so far): the head over every
    position (fed the token after it and fc of the target's aux states, ``aux`` [>= n, 3H]:
    causal, so one forward over the whole output serves every context), then k - 1 passes
    over its own output."""
    head = RefHead(tensors, params["embed"].astype(np.float64))
    n = len(context) - 1
    hidden = aux[:n] @ head.t["fc.weight"].T
    ids, pre = head.step(np.asarray(context[1:]), hidden, np.arange(n))
    drafts, tok, hid = [int(ids[-1])], ids[-1:], pre[-1:]
    for j in range(1, k):
        tok, hid = head.step(tok, hid, np.array([n - 1 + j]))
        drafts.append(int(tok[0]))
    return drafts


# ------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("eagle3")
    return path, _write_head(path)


@pytest.fixture(scope="module")
def target_params():
    return random_params(CONFIG, seed=1)


BASE = dict(max_model_len=80, max_num_seqs=4, max_num_batched_tokens=16, block_size=4,
            max_prefill_tokens_with_decodes=16, num_kv_blocks=28, show_progress=False)  # fmt: skip


def _llm(params, **kwargs) -> LLM:
    engine = LLMEngine.from_params(CONFIG, params, **{**BASE, **kwargs})
    return LLM.from_engine(engine)


@pytest.fixture(scope="module")
def engines(head_dir, target_params):
    plain = _llm(target_params)
    spec = {"method": "eagle3", "model": str(head_dir[0]), "num_speculative_tokens": K,
            "disable_by_batch_size": 64}  # fmt: skip
    eagle = _llm(target_params, speculative_config=spec)
    yield plain, eagle
    plain.close()
    eagle.close()


def _ids(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


# ----------------------------------------------------------------------- tests


def test_greedy_identical_with_and_without_eagle3(engines):
    """First in the module: the compilation count is process-wide, and the reference
    computations of the tests after it compile."""
    plain, eagle = engines
    rng = random.Random(0)
    shared = [rng.randrange(96) for _ in range(10)]  # prefix-cache hits, chunked prefill
    prompts = [shared + [rng.randrange(96) for _ in range(rng.randint(2, 30))] for _ in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=10 + 7 * i, ignore_eos=True)
              for i in range(len(prompts))]  # fmt: skip
    want = _ids(plain.generate(prompts, params))
    assert _ids(eagle.generate(prompts, params)) == want
    seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=20)
    assert _ids(eagle.generate(prompts, seeded)) == _ids(plain.generate(prompts, seeded))
    m = eagle.get_metrics()
    assert m["spec_decode_num_draft_tokens"] > 0 and m["num_preemptions"] > 0
    assert m["prefix_cache_hits"] > 0 and m["num_compilations_after_warmup"] == 0
    pool = eagle.engine.scheduler.pool
    assert pool.num_free_blocks == pool.num_blocks and not pool.tracked_request_ids()
    # the head's K/V is one more layer of the target's pool
    assert eagle.engine.runner.layout.num_layers == CONFIG.num_layers + 1


def test_head_layout_and_forward_match_the_reference(head_dir, target_params):
    path, tensors = head_dir
    config, params = eagle3.load_eagle3(str(path))
    assert config.draft_vocab_size == DRAFT_VOCAB and config.aux_layers(2) == AUX
    assert not config.own_embeddings and "t2d" not in params
    # the target's aux states: the residual stream entering each layer, in the asked order;
    # normed, it is the final output of the target cut after that many layers
    tokens = np.array([5, 17, 3, 88, 41, 9, 60], np.int32)
    aux = _target_aux(target_params, tokens).reshape(len(tokens), 3, -1)
    for slot, layer in enumerate(AUX):
        if layer == 0:  # entering layer 0: the embeddings
            np.testing.assert_allclose(aux[:, slot], target_params["embed"][tokens], rtol=1e-6)
            continue
        layers = {k: v[:layer] for k, v in target_params["layers"].items()}
        cut = {**target_params, "layers": layers}
        out, _ = _forward(cut, jnp.asarray(tokens), num_layers=layer)
        np.testing.assert_allclose(
            _rms(aux[:, slot], target_params["final_norm"]), out, rtol=1e-4, atol=1e-4
        )
    # the head's forward (jnp, dense attention) against the numpy reference
    embed = target_params["embed"]

    @jax.jit  # one program, as _forward
    def head(params, aux, embeds):  # [T, 3H], [T, H]
        positions = jnp.arange(embeds.shape[0], dtype=jnp.int32)
        hidden = eagle3.combine_aux(params, aux)
        normed, pre, _ = eagle3.head_forward(
            params, config, embeds, hidden, positions, dense_causal_attention, None,
            layer_index=0,
        )  # fmt: skip
        return pre, eagle3.draft_ids(params, normed)

    pre, got_ids = head(
        params, jnp.asarray(aux.reshape(len(tokens), -1), jnp.float32), jnp.asarray(embed[tokens])
    )
    ref = RefHead(tensors, embed.astype(np.float64))
    fc = tensors["fc.weight"].astype(np.float64)
    want_ids, want_pre = ref.step(
        tokens, aux.reshape(len(tokens), -1) @ fc.T, np.arange(len(tokens))
    )
    np.testing.assert_allclose(pre, want_pre, rtol=1e-4, atol=1e-4)
    got_ids = np.asarray(got_ids)
    np.testing.assert_array_equal(got_ids, want_ids)
    assert np.isin(got_ids, np.flatnonzero(tensors["t2d"])).all()  # d2t: target ids


def test_engine_drafts_are_the_reference_heads(engines, head_dir, target_params):
    """Every draft the engine verified is the reference's for that context: the head's K/V
    kept across steps (and prefill chunks) in the target's pool, the aux states, draft 1
    carried to the next step and drafts 2..K made inside it."""
    _, eagle = engines
    runner = eagle.engine.runner
    seen = []
    run = runner._run

    def spy(batch, bucket):
        out = run(batch, bucket)
        if batch.verify_rows is not None:
            seen.append((np.asarray(batch.positions), np.asarray(batch.num_drafts), out))
        return out

    runner._run = spy
    try:
        # 21 tokens: two prefill chunks (16-token budget); the head's input at the first
        # chunk's last position is the next chunk's first token
        prompt = [7, 31, 2, 64, 19, 5, 77, 40, 12, 3, 90, 55, 8, 23, 71, 66, 14, 29, 4, 81, 36]
        (out,) = eagle.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
        )
    finally:
        runner._run = run
    full = prompt + list(out.outputs[0].token_ids)
    aux = _target_aux(target_params, full)
    checked = 0
    for positions, num_drafts, step in seen:
        d = int(num_drafts[0])
        if not d:
            continue
        start = int(positions[0])  # the last known token's position
        got = np.asarray(step.spec_draft_ids)[0, :d].tolist()
        assert got == _ref_drafts(head_dir[1], target_params, aux, full[: start + 1], d)
        checked += 1
    assert checked >= 3


def test_heads_the_engine_cannot_run_are_refused(head_dir, target_params, tmp_path):
    spec = {"method": "eagle3", "model": str(head_dir[0]), "num_speculative_tokens": 2}
    other = tiny_config(hidden_size=48, num_heads=8, head_dim=8)
    with pytest.raises(ValueError, match="hidden states of size"):
        LLMEngine.from_params(other, random_params(other), speculative_config=spec, **BASE)
    config, _ = eagle3.load_eagle3(str(head_dir[0]))  # 4 query heads: split 2 ways, not 3
    assert check_eagle(config, CONFIG, tensor_parallel_size=2, own_model=False).num_layers == 3
    with pytest.raises(ValueError, match="must divide by tensor_parallel_size"):
        check_eagle(config, CONFIG, tensor_parallel_size=3, own_model=False)
    # a Llama-family target only (Granite runs the same module but is a family of its own)
    granite = dataclasses.replace(CONFIG, model_type="granite")
    for target, own_model in ((granite, False), (CONFIG, True)):
        with pytest.raises(ValueError, match="needs a Llama-family target"):
            check_eagle(config, target, tensor_parallel_size=1, own_model=own_model)
    missing = tmp_path / "head"
    _write_head(missing)
    (missing / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="safetensors"):
        eagle3.load_eagle3(str(missing))
    cfg = json.loads((head_dir[0] / "config.json").read_text())
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        bad = {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}  # the target has layers 0, 1
        eagle3.parse_eagle3_config({**cfg, "eagle_config": bad}).aux_layers(2)


@pytest.mark.skipif(
    os.environ.get("JAXPAGED_TEST_FULL") != "1",
    reason="an engine of its own (~30 s cold); the default suite's engine preempts by "
    "recomputing; JAXPAGED_TEST_FULL=1 runs it",
)
def test_greedy_identical_under_swap_preemption(engines, head_dir, target_params):
    """Swapped-out blocks carry the head's K/V layer with the target's."""
    plain, _ = engines
    spec = {"method": "eagle3", "model": str(head_dir[0]), "num_speculative_tokens": K,
            "disable_by_batch_size": 64}  # fmt: skip
    swap = _llm(target_params, speculative_config=spec, preemption_mode="swap")
    try:
        rng = random.Random(1)
        prompts = [[rng.randrange(96) for _ in range(rng.randint(5, 30))] for _ in range(6)]
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        assert _ids(swap.generate(prompts, params)) == _ids(plain.generate(prompts, params))
        m = swap.get_metrics()
        assert m["num_preemptions"] > 0 and m["spec_decode_num_draft_tokens"] > 0
        pool = swap.engine.scheduler.pool
        assert pool.num_free_blocks == pool.num_blocks
    finally:
        swap.close()
