"""Sampler tests: distributions against their analytic definitions, penalties against a
hand-written numpy version, seeds across batch compositions, logprobs, one compilation."""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.kernels import cpu
from jaxpaged.sampling_params import banned_ids_for_min_tokens
from jaxpaged.worker.sampler import (
    SamplingTensors,
    SeqState,
    apply_penalties,
    apply_top_k_top_p,
    build_sampling_tensors,
    create_seq_state,
    greedy_argmax,
    init_state_row,
    record_sampled,
    sample,
    sample_from_logits,
    seed_to_key_data,
)

ENGINE_KEY = seed_to_key_data(1234)
B, V = 16, 64  # shared small shape: fewer compilations
H = 64  # state-row fills: prompt / output padded to this many ids
M = 16  # ids min_tokens may hold back per row
L = 8  # logit_bias pairs per row


class Built(NamedTuple):
    """A batch's sampling tensors and the penalty state its rows point at."""

    t: SamplingTensors
    state: SeqState


def _sample(logits, built, *, num_logprobs, argmax=greedy_argmax):
    return sample(logits, built.t, built.state, num_logprobs=num_logprobs, argmax=argmax)


sample_jit = jax.jit(_sample, static_argnames="num_logprobs")
# The argmax the step passes on CPU (the native kernel) must pick what jnp.argmax picks.
ARGMAXES = [
    pytest.param(greedy_argmax, id="jnp"),
    pytest.param(
        cpu.argmax, id="native", marks=pytest.mark.skipif(not cpu.available(), reason="no C++")
    ),
]


def sample_with(argmax):
    return jax.jit(functools.partial(_sample, argmax=argmax), static_argnames="num_logprobs")


def params(**kw) -> SimpleNamespace:
    """Duck-typed SamplingParams with vLLM defaults."""
    d = dict(
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
        min_p=0.0,
        repetition_penalty=1.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        seed=None,
        n=1,
        logprobs=None,
        min_tokens=0,
        ignore_eos=False,
        stop_token_ids=(),
        logit_bias=(),
    )
    d.update(kw)
    return SimpleNamespace(**d)


def row(sp, prompt=(1, 2, 3), output=(), sample_index=0, rng_stream=0) -> SimpleNamespace:
    return SimpleNamespace(
        params=sp,
        prompt=list(prompt),
        output=list(output),
        sample_index=sample_index,
        rng_stream=rng_stream,
    )


def has_penalty(sp) -> bool:
    return sp.repetition_penalty != 1.0 or sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0


def padded(ids) -> np.ndarray:
    out = np.full(H, -1, np.int32)
    out[: len(ids)] = list(ids)
    return out


def build(rows, batch_size, vocab_size, eos_token_ids=()) -> Built:
    """Sampling tensors of ``rows`` as the scheduler would snapshot them (the stream of a
    seeded row is its sample index, else its engine stream), and a sampler state whose row i
    holds row i's prompt, output, min_tokens and held-back ids when it has penalties or
    min_tokens."""
    state = create_seq_state(batch_size, vocab_size, M, L)
    seqs = []
    for i, r in enumerate(rows):
        sp = r.params
        state_row = i if has_penalty(sp) or sp.min_tokens or sp.logit_bias else -1
        if state_row >= 0:
            ids = banned_ids_for_min_tokens(sp, eos_token_ids)
            bias_ids = np.full(L, -1, np.int32)
            bias_values = np.zeros(L, np.float32)
            for j, (token, bias) in enumerate(sp.logit_bias):
                bias_ids[j], bias_values[j] = token, bias
            state = init_state_row(
                state, np.int32(i), padded(r.prompt), padded(r.output),
                np.int32(sp.min_tokens), padded(ids)[:M], bias_ids, bias_values,
            )  # fmt: skip
        seqs.append(
            SimpleNamespace(
                params=sp,
                key_stream=r.sample_index if sp.seed is not None else r.rng_stream,
                key_counter=len(r.output),
                state_row=state_row,
            )
        )
    t, failed = build_sampling_tensors(
        seqs, batch_size, vocab_size=vocab_size, engine_key_data=ENGINE_KEY
    )
    assert not failed, failed
    return Built(t, state)


# --- analytic reference -------------------------------------------------------------


def ref_probs(logits, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, top_p_inclusive=False):
    """The sampling distribution by definition: softmax(logits / T), keep the top_k most
    likely, then the smallest most-likely set with mass >= top_p, then tokens with
    p >= min_p * p_max; renormalise after each step."""
    z = np.asarray(logits, np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.ones_like(p, bool)
    if top_k > 0:
        keep[order[top_k:]] = False
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    if top_p < 1.0:
        cum = np.cumsum(q[order])
        before = cum - q[order]
        kept = cum < top_p if top_p_inclusive else before < top_p  # inclusive = wrong on purpose
        kept[0] = True
        keep[order[~kept]] = False
        q = np.where(keep, q, 0.0)
        q /= q.sum()
    if min_p > 0.0:
        q = np.where(q >= min_p * q.max(), q, 0.0)
        q /= q.sum()
    return q


def chi2(counts, probs):
    """Pearson chi-square of counts against probs; a count on a zero-probability token is
    an infinite statistic."""
    n = counts.sum()
    if np.any(counts[probs == 0] > 0):
        return np.inf
    e = n * probs[probs > 0]
    return float(np.sum((counts[probs > 0] - e) ** 2 / e))


def chi2_bound(probs):
    """Acceptance bound: df + 8 sqrt(2 df) (p-value below ~1e-6 for the df used here)."""
    df = int(np.count_nonzero(probs)) - 1
    return df + 8.0 * np.sqrt(2.0 * df) + 1.0


LOGITS = np.array([2.0, 1.6, 1.2, 1.0, 0.7, 0.3, 0.0, -0.4, -0.9, -1.5, -2.2, -3.0], np.float32)

CASES = {
    # name: (params, wrong alternatives that the same check must reject)
    "temperature": (dict(temperature=0.6), [dict(temperature=1.0), dict(temperature=0.5)]),
    "top_k": (dict(top_k=4), [dict(), dict(top_k=3), dict(top_k=5)]),
    "top_p": (dict(top_p=0.7), [dict(), dict(top_p=0.7, top_p_inclusive=True)]),
    "min_p": (dict(min_p=0.2), [dict(), dict(min_p=0.1), dict(min_p=0.3)]),
    "all": (
        dict(temperature=1.5, top_k=8, top_p=0.8, min_p=0.12),
        # Prefix filters: only the tightest (top_p here) binds, so drop it or the temperature.
        [dict(temperature=1.5, top_k=8, min_p=0.12), dict(top_k=8, top_p=0.8, min_p=0.12)],
    ),
    "plain": (dict(), [dict(temperature=0.8), dict(temperature=1.25)]),
}
DRAWS = 24_576  # per case


@pytest.fixture(scope="module")
def mixed_batch_counts():
    """One batch in which every case gets DRAWS rows (interleaved), each row its own key."""
    names = list(CASES)
    sps = [params(**CASES[name][0]) for name in names]
    rows = [
        row(sps[i % len(names)], rng_stream=i, sample_index=0) for i in range(DRAWS * len(names))
    ]
    t = build(rows, len(rows), LOGITS.size)
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (len(rows), LOGITS.size))
    ids = np.asarray(sample_jit(logits, t, num_logprobs=0).token_ids)
    return {
        name: np.bincount(ids[i :: len(names)], minlength=LOGITS.size)
        for i, name in enumerate(names)
    }


@pytest.mark.parametrize("name", list(CASES))
def test_sampled_distribution_matches_definition(mixed_batch_counts, name):
    counts = mixed_batch_counts[name]
    spec, wrongs = CASES[name]
    probs = ref_probs(LOGITS, **spec)
    assert counts.sum() == DRAWS
    # Excluded tokens are never drawn.
    assert np.all(counts[probs == 0] == 0), (counts, probs)
    stat = chi2(counts, probs)
    assert stat < chi2_bound(probs), (stat, counts, np.round(probs * DRAWS))
    # The same check must reject a wrong distribution (so it cannot pass by accident).
    for wrong in wrongs:
        wrong_probs = ref_probs(LOGITS, **wrong)  # the full wrong spec
        assert not np.allclose(wrong_probs, probs)
        assert chi2(counts, wrong_probs) > 3 * chi2_bound(wrong_probs), wrong


def test_top_p_one_and_top_k_off_keep_whole_large_vocab():
    """top_p=1 must not drop the tail where float32 cumulative mass rounds to 1."""
    v = 50_000
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(0, 6, (2, v)).astype(np.float32))
    out = apply_top_k_top_p(logits, jnp.array([v, v]), jnp.array([1.0, 1.0]))
    assert bool(jnp.all(jnp.isfinite(out)))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(logits))


def test_top_k_top_p_mask_exact():
    logits = jnp.asarray(np.log(np.array([[0.5, 0.05, 0.3, 0.15], [0.5, 0.05, 0.3, 0.15]])))
    out = np.asarray(apply_top_k_top_p(logits, jnp.array([2, 4]), jnp.array([1.0, 0.85])))
    np.testing.assert_array_equal(np.isfinite(out), [[1, 0, 1, 0], [1, 0, 1, 1]])


def ref_top_k_top_p_mask(x, k, p):
    """Sort-based definition (ties with the last kept value kept), float64."""
    desc = np.sort(x)[::-1]
    in_k = x >= desc[k - 1]
    if p >= 1.0:
        return in_k
    z = np.where(in_k, x.astype(np.float64), -np.inf)
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    order = np.argsort(-z, kind="stable")
    cum = np.cumsum(probs[order])
    j = int(np.argmax(cum >= p)) if (cum >= p).any() else len(cum) - 1
    return in_k & (x >= z[order[j]])


def test_top_k_top_p_bisection_matches_sort_definition():
    rng = np.random.default_rng(6)
    b, v = 64, 97
    x = rng.normal(0, 2, (b, v)).astype(np.float32)
    x[::3] = np.round(x[::3])  # many ties
    x[2::5] *= -1e-3  # tiny values, with -0.0 and 0.0 mixed (equal: a tie)
    x[1::4, :5] = -np.inf  # banned tokens
    k = rng.integers(1, v + 1, b).astype(np.int32)
    k[::7] = v
    p = rng.uniform(0.05, 1.0, b).astype(np.float32)
    p[::6] = 1.0
    got = np.isfinite(np.asarray(jax.jit(apply_top_k_top_p)(jnp.asarray(x), k, p)))
    want = np.stack([ref_top_k_top_p_mask(x[i], k[i], p[i]) for i in range(b)])
    want &= np.isfinite(x)
    np.testing.assert_array_equal(got, want)
    assert 0 < got.sum() < np.isfinite(x).sum()  # the filters did something


def test_inverse_cdf_draw_matches_float64_reference():
    rng = np.random.default_rng(8)
    b, v = 64, 1000  # 4 blocks of 256, the last one partial
    x = rng.normal(0, 3, (b, v)).astype(np.float32)
    x[::2, rng.integers(0, v, 300)] = -np.inf  # excluded tokens, whole runs at block edges
    x[1::4, 700:] = -np.inf  # all mass in the first blocks
    x[3::8, :600] = -np.inf  # all mass in the last blocks
    u = rng.uniform(0, 1, b).astype(np.float32)
    u[:4] = [0.0, np.nextafter(np.float32(1), 0), 0.5, 1e-9]
    got = np.asarray(jax.jit(sample_from_logits)(jnp.asarray(x), jnp.asarray(u)))
    assert np.isfinite(x[np.arange(b), got]).all()  # never an excluded token
    p = np.exp(x.astype(np.float64) - x.max(-1, keepdims=True))
    cum = np.cumsum(p, -1) / p.sum(-1, keepdims=True)
    want = np.array([np.searchsorted(cum[i], u[i], side="right") for i in range(b)])
    want = np.minimum(want, v - 1)
    margin = np.abs(cum - u[:, None]).min(-1)  # distance of u to the nearest boundary
    clear = margin > 1e-5
    assert clear.sum() >= b - 5
    np.testing.assert_array_equal(got[clear], want[clear])
    finite = np.isfinite(x)
    assert got[0] == np.argmax(finite[0])  # u = 0: the first token with weight
    assert got[1] == v - 1 - np.argmax(finite[1][::-1])  # u -> 1: the last one


@pytest.mark.parametrize("argmax", ARGMAXES)
def test_greedy_is_argmax_whatever_the_filters(argmax):
    rng = np.random.default_rng(1)
    b, v = B, V
    logits = rng.normal(size=(b, v)).astype(np.float32)
    sps = [
        params(temperature=0.0),
        params(temperature=0.0, top_k=5, top_p=0.3, min_p=0.5),
        params(temperature=1e-6, seed=3),
    ]
    rows = [row(sps[i % 3], rng_stream=i) for i in range(b - 3)]  # 3 padding rows
    out = sample_with(argmax)(jnp.asarray(logits), build(rows, b, v), num_logprobs=0)
    np.testing.assert_array_equal(np.asarray(out.token_ids), logits.argmax(-1))


def ref_penalties(logits, rows):
    """vLLM's penalties by hand, float64: repetition on prompt + output tokens, frequency and
    presence on output tokens."""
    out = logits.astype(np.float64).copy()
    for i, r in enumerate(rows):
        sp = r.params
        counts = {}
        for t in r.output:
            counts[t] = counts.get(t, 0) + 1
        for t in set(r.prompt) | set(r.output):
            rp = sp.repetition_penalty
            out[i, t] = out[i, t] / rp if out[i, t] > 0 else out[i, t] * rp
        for t, c in counts.items():
            out[i, t] -= sp.frequency_penalty * c + sp.presence_penalty
    return out


def test_penalties_change_exactly_the_right_logits():
    rng = np.random.default_rng(2)
    b, v = B, V
    logits = rng.normal(0, 2, (b, v)).astype(np.float32)
    sps = [
        params(temperature=0.0, repetition_penalty=1.7),
        params(temperature=0.0, presence_penalty=0.8),
        params(temperature=0.0, frequency_penalty=0.5),
        params(
            temperature=0.0, repetition_penalty=0.6, presence_penalty=-0.4, frequency_penalty=1.1
        ),
        params(temperature=0.0),  # no penalty: logits untouched even with a filled state row
    ]
    rows = []
    for sp in sps:
        prompt = rng.integers(0, v, rng.integers(1, 6)).tolist()
        output = rng.integers(0, v, rng.integers(0, 8)).tolist() + [prompt[0]] * 2
        rows.append(row(sp, prompt, output))
    t, state = build(rows, b, v)
    # The no-penalty row points at no state row; fill row 4 anyway to prove it is not read.
    state = init_state_row(
        state, np.int32(4), padded([0, 1, 2]), padded([3, 3]), np.int32(0), padded([])[:M]
    )
    got = np.asarray(jax.jit(apply_penalties)(jnp.asarray(logits), t, state))
    want = ref_penalties(logits[:4], rows[:4])
    np.testing.assert_allclose(got[:4], want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[4:], logits[4:])
    changed = got != logits
    assert changed[:4].any(axis=1).all() and not changed[4:].any()
    # Through sample(): greedy rows pick the argmax of the penalised logits.
    out = sample_jit(jnp.asarray(logits), Built(t, state), num_logprobs=0)
    np.testing.assert_array_equal(np.asarray(out.token_ids)[:4], want.argmax(-1))


def test_the_step_keeps_penalty_counts_current():
    """Counts updated on the device after each draw equal a fill from the host's tokens:
    no history needs to cross from the host."""
    rng = np.random.default_rng(7)
    sp = params(temperature=0.0, frequency_penalty=0.3, repetition_penalty=1.1)
    prompt, output = [1, 2, 3], [4, 4]
    built = build([row(sp, prompt, output), row(params())], B, V)
    state = built.state
    for _ in range(5):
        logits = jnp.asarray(rng.normal(size=(B, V)).astype(np.float32))
        out = sample_jit(logits, Built(built.t, state), num_logprobs=0)
        state = record_sampled(state, built.t.state_rows, out.token_ids)
        output.append(int(out.token_ids[0]))
    want = build([row(sp, prompt, output)], B, V).state
    np.testing.assert_array_equal(np.asarray(state.output_counts[0]), want.output_counts[0])
    np.testing.assert_array_equal(np.asarray(state.prompt_mask[0]), want.prompt_mask[0])
    assert int(state.output_counts[1:].sum()) == 0  # rows without penalties record nothing


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    v = V
    logits = np.zeros((B, v), np.float32)
    logits[:, 7] = 5.0  # EOS is the best token
    logits[:, 3] = 4.0  # a stop token id is second
    sp = params(temperature=0.0, min_tokens=2, stop_token_ids=[3])
    rows = [
        row(sp, output=[]),  # 0 < 2: both banned
        row(sp, output=[1, 1]),  # reached: EOS allowed
        row(params(temperature=0.0, min_tokens=5, ignore_eos=True, stop_token_ids=[3])),
    ]
    out = sample_jit(jnp.asarray(logits), build(rows, B, v, eos_token_ids=[7]), num_logprobs=0)
    assert np.asarray(out.token_ids)[:3].tolist() == [0, 7, 7]


def test_seeded_rows_reproduce_across_batches_positions_and_steps():
    rng = np.random.default_rng(3)
    v = V
    base = rng.normal(size=v).astype(np.float32)
    seeded = params(temperature=1.3, top_k=20, seed=42)
    others = [params(temperature=0.7), params(top_p=0.5), params(temperature=0.0), params(seed=7)]

    def draws(batch_size, position, n_steps=6, filler_offset=0):
        toks = []
        output: list[int] = []
        for _ in range(n_steps):
            rows = [
                row(others[(j + filler_offset) % 4], rng_stream=100 + j + filler_offset)
                for j in range(batch_size - 3)
            ]
            rows.insert(position, row(seeded, output=output, rng_stream=999))
            logits = np.tile(base, (batch_size, 1))
            out = sample_jit(jnp.asarray(logits), build(rows, batch_size, v), num_logprobs=0)
            tok = int(out.token_ids[position])
            toks.append(tok)
            output = output + [tok]
        return toks

    a = draws(B, 0)
    assert a == draws(B, 9, filler_offset=1)  # other rows, other position, padding
    assert a == draws(8, 4, filler_offset=2)  # another batch size
    assert len(set(a)) > 1  # the counter moves the key: not the same token every step
    # A different seed (or sample index) gives a different stream.
    rows = [
        row(params(temperature=1.3, top_k=20, seed=s), sample_index=i)
        for s in (42, 43)
        for i in (0, 1)
    ]
    t, state = build(rows * 4, B, v)
    t = t._replace(key_counter=np.repeat(np.arange(4, dtype=np.uint32), 4))
    logits = jnp.asarray(np.tile(base, (B, 1)))
    ids = np.asarray(sample_jit(logits, Built(t, state), num_logprobs=0).token_ids)
    per_stream = ids.reshape(4, 4).T
    assert len({tuple(s) for s in per_stream}) == 4


def test_unseeded_rows_have_independent_streams():
    rows = [row(params(), rng_stream=i) for i in range(B)]
    ids = np.asarray(sample_jit(jnp.zeros((B, V)), build(rows, B, V), num_logprobs=0).token_ids)
    assert len(set(ids.tolist())) >= 11  # 16 uniform draws over 64: ~14.3 distinct expected


def test_logprobs_are_raw_log_softmax():
    rng = np.random.default_rng(4)
    b, v, k = B, V, 20
    logits = rng.normal(0, 3, (b, v)).astype(np.float32)
    sps = [
        params(temperature=0.5, top_k=3, logprobs=5, repetition_penalty=1.3),
        params(temperature=0.0, logprobs=20),
        params(min_p=0.3, seed=1),
        params(top_p=0.2, logprobs=1),
    ]
    t = build([row(sp, output=[int(logits[0].argmax())]) for sp in sps], b, v)
    out = sample_jit(jnp.asarray(logits), t, num_logprobs=k)
    x = logits.astype(np.float64)
    ref = x - x.max(-1, keepdims=True)
    ref -= np.log(np.exp(ref).sum(-1, keepdims=True))
    ids = np.asarray(out.token_ids)
    np.testing.assert_allclose(np.asarray(out.logprobs), ref[np.arange(b), ids], atol=1e-5)
    top_ids = np.asarray(out.top_logprob_ids)
    np.testing.assert_array_equal(top_ids, np.argsort(-ref, axis=-1, kind="stable")[:, :k])
    np.testing.assert_allclose(
        np.asarray(out.top_logprobs), np.take_along_axis(ref, top_ids, -1), atol=1e-5
    )
    assert out.top_logprobs.shape == (b, k)
    none = sample_jit(jnp.asarray(logits), build([row(params())], b, v), num_logprobs=0)
    assert none.top_logprob_ids.shape == (b, 0)
    # No row asks: the logsumexp pass is skipped and the logprobs are zeros.
    assert not np.asarray(none.logprobs).any()
    # logprobs=0 alone (the sampled token's only) still runs it.
    one = sample_jit(
        jnp.asarray(logits), build([row(params()), row(params(logprobs=0))], b, v), num_logprobs=0
    )
    ids = np.asarray(one.token_ids)
    np.testing.assert_allclose(float(one.logprobs[1]), ref[1, ids[1]], atol=1e-5)


def test_jitted_sample_compiles_once_for_any_parameter_mix():
    fn = jax.jit(_sample, static_argnames="num_logprobs")
    b, v = 8, 136  # a shape no other test uses (jit caches are shared per function)
    rng = np.random.default_rng(5)
    mixes = [
        [params(temperature=0.0)],
        [params(), params(top_k=5)],
        [params(top_p=0.9, seed=3), params(repetition_penalty=1.2, logprobs=3)],
        [params(min_p=0.1, presence_penalty=0.5, frequency_penalty=0.2)] * 8,
        [params(temperature=0.0, min_tokens=4, stop_token_ids=[1, 2])],
        [],
    ]
    sizes = []
    for mix in mixes:
        t = build([row(sp, output=[5, 6]) for sp in mix], b, v, eos_token_ids=[0])
        fn(jnp.asarray(rng.normal(size=(b, v)).astype(np.float32)), t, num_logprobs=4)
        sizes.append(fn._cache_size())
    assert sizes[1:] == sizes[:-1], sizes  # the first call compiled; no other did


def test_build_sampling_tensors_padding_and_errors():
    t, _ = build([row(params(top_k=500, seed=9, logprobs=2))], 3, 100)
    assert t.top_k.tolist() == [100, 100, 100]  # clipped / off
    assert t.temperature.tolist() == [1.0, 0.0, 0.0]  # padding rows are greedy
    assert t.num_logprobs.tolist() == [2, -1, -1]  # padding rows want no logprobs
    np.testing.assert_array_equal(t.key_data[0], seed_to_key_data(9))
    assert (t.state_rows == -1).all()  # no penalty: no state row
    with pytest.raises(ValueError, match="batch_size"):
        build([row(params())] * 4, 3, 100)
    with pytest.raises(ValueError, match="engine_key_data"):
        build_sampling_tensors([], 2, vocab_size=10, engine_key_data=np.zeros(3))

    # A row that cannot be filled fails alone: it rides as padding, the others are kept.
    def seq(sp):
        return SimpleNamespace(params=sp, key_stream=0, key_counter=0, state_row=-1)

    good = seq(params(temperature=0.5))
    min_tokens_no_row = seq(params(min_tokens=3, stop_token_ids=[5]))
    penalty_no_row = seq(params(frequency_penalty=0.1))
    t, failed = build_sampling_tensors(
        [min_tokens_no_row, good, penalty_no_row], 4, vocab_size=100, engine_key_data=ENGINE_KEY
    )
    assert set(failed) == {0, 2}
    assert all("no state row" in why for why in failed.values())
    assert t.temperature.tolist() == [0.0, 0.5, 0.0, 0.0]
    assert (t.state_rows == -1).all() and t.frequency_penalty[2] == 0.0


@pytest.mark.parametrize("argmax", ARGMAXES)
def test_all_greedy_batch_with_a_penalty_takes_the_penalised_argmax(argmax):
    """A batch of greedy rows only skips the general path when nothing changes the logits:
    a penalty on one row must still move that row off its raw argmax."""
    logits = np.zeros((B, V), np.float32)
    logits[:, 5] = 2.0  # raw argmax everywhere
    logits[:, 9] = 1.5
    greedy = params(temperature=0.0)
    rows = [row(params(temperature=0.0, presence_penalty=1.0), output=[5]), row(greedy)]
    out = sample_with(argmax)(jnp.asarray(logits), build(rows, B, V), num_logprobs=0)
    assert np.asarray(out.token_ids)[:2].tolist() == [9, 5]


def test_min_tokens_ban_lifts_on_the_device():
    """The same step inputs, step after step: the device's own count of generated tokens
    lifts the ban once min_tokens is reached (the host never re-sends anything)."""
    logits = np.zeros((B, V), np.float32)
    logits[:, 7] = 5.0  # EOS is the best token
    logits[:, 3] = 4.0  # a stop token id is second
    sp = params(temperature=0.0, min_tokens=2, stop_token_ids=[3])
    t, state = build([row(sp, output=[]), row(params(temperature=0.0))], B, V, eos_token_ids=[7])
    picked = []
    for _ in range(3):
        out = sample_jit(jnp.asarray(logits), Built(t, state), num_logprobs=0)
        state = record_sampled(state, t.state_rows, out.token_ids)
        picked.append(np.asarray(out.token_ids)[:2].tolist())
    assert picked == [[0, 7], [0, 7], [7, 7]]  # banned twice, then EOS; row 1 never banned
    assert np.asarray(state.num_generated)[:2].tolist() == [3, 0]
