"""The sampler's per-request logit_bias and the structured-output mask, against numpy."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from test_sampler import ARGMAXES, B, Built, V, build, params, row, sample_jit, sample_with


@pytest.mark.parametrize("argmax", ARGMAXES)
def test_logit_bias_is_added_to_exactly_its_rows_tokens(argmax):
    """Greedy rows pick the argmax of logits + bias (numpy), with and without penalties;
    rows without a bias are untouched; +100 forces a token even at temperature 1, -100
    keeps the model's favourite out; logprobs stay those of the raw logits."""
    rng = np.random.default_rng(11)
    logits = rng.normal(0, 2, (B, V)).astype(np.float32)
    favourite = logits.argmax(-1)
    biases = [((5, 3.5), (9, -2.0), (17, 1.25)), ((40, 4.0),), ()]
    sps = [params(temperature=0.0, logit_bias=bias) for bias in biases]
    sps.append(params(temperature=0.0, logit_bias=((3, 2.0),), presence_penalty=0.5))
    sps.append(params(temperature=1.0, logit_bias=((7, 100.0),)))
    sps.append(params(temperature=0.0, logit_bias=((int(favourite[5]), -100.0),)))
    sps.append(params(temperature=0.0, logprobs=0, logit_bias=((2, 50.0),)))
    rows = [row(sp, output=[3]) for sp in sps]
    out = sample_with(argmax)(jnp.asarray(logits), build(rows, B, V), num_logprobs=0)
    got = np.asarray(out.token_ids)
    want = logits.copy()
    for i, sp in enumerate(sps):
        for token, bias in sp.logit_bias:
            want[i, token] += bias
    want[3, 3] -= 0.5  # the presence penalty on the output token 3, after the bias
    np.testing.assert_array_equal(got[:4], want[:4].argmax(-1))
    assert got[0] == want[0].argmax() and got[2] == favourite[2]
    assert got[4] == 7 and got[5] != favourite[5] and got[6] == 2
    np.testing.assert_array_equal(got[len(sps) :], favourite[len(sps) :])
    raw = logits[6] - np.log(np.exp(logits[6].astype(np.float64)).sum())
    np.testing.assert_allclose(np.asarray(out.logprobs)[6], raw[2], rtol=1e-5, atol=1e-5)


def _packed(allowed: np.ndarray) -> np.ndarray:  # bool [V] -> int32 [ceil(V / 32)]
    bits = np.zeros(-(-allowed.size // 32) * 32, np.uint32)
    bits[: allowed.size] = allowed
    words = (bits.reshape(-1, 32) << np.arange(32, dtype=np.uint32)).sum(axis=1, dtype=np.uint32)
    return words.view(np.int32)


@pytest.mark.parametrize("argmax", ARGMAXES)
def test_structured_output_mask_allows_exactly_its_tokens(argmax):
    """Masked rows pick only allowed tokens (greedy: the best allowed one; sampled: many
    draws, none outside the mask); rows without a mask are untouched; logprobs stay raw."""
    rng = np.random.default_rng(5)
    logits = rng.normal(0, 2, (B, V)).astype(np.float32)
    masks = [rng.random(V) < 0.2 for _ in range(3)]
    masks[2][:] = False
    masks[2][V - 1] = True  # the last word's high bit: a single allowed token
    sps = [params(temperature=0.0), params(temperature=1.0), params(temperature=0.0)]
    sps += [params(temperature=0.0, logprobs=0)]
    rows = [row(sp, rng_stream=i) for i, sp in enumerate(sps)]
    built = build(rows, B, V)
    allowed = np.asarray(built.t.allowed).copy()
    for i, m in enumerate(masks):
        allowed[i] = _packed(m)
    t = built.t._replace(allowed=allowed)
    out = sample_with(argmax)(jnp.asarray(logits), Built(t, built.state), num_logprobs=0)
    got = np.asarray(out.token_ids)
    assert got[0] == np.where(masks[0], logits[0], -np.inf).argmax()
    assert masks[1][got[1]] and got[2] == V - 1
    np.testing.assert_array_equal(got[3:], logits[3:].argmax(-1))
    raw = logits[3] - np.log(np.exp(logits[3].astype(np.float64)).sum())
    np.testing.assert_allclose(np.asarray(out.logprobs)[3], raw[got[3]], rtol=1e-5, atol=1e-5)
    for counter in range(1, 40):  # sampled row: fresh draws, never outside its mask
        key_counter = np.asarray(t.key_counter).copy()
        key_counter[1] = counter
        tc = t._replace(key_counter=key_counter)
        drawn = sample_jit(jnp.asarray(logits), Built(tc, built.state), num_logprobs=0)
        assert masks[1][int(drawn.token_ids[1])]
