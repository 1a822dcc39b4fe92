"""The step's verification of drafts (jaxpaged.worker.spec_verify) keeps the target's
distribution: over many seeded sequences, the first emitted token follows the target's p0,
the draft x is accepted with probability p0(x), and after an accepted draft the next token
follows the target's p1 - total-variation distance within bounds of about four standard
errors. A verifier that resampled from p on rejection (instead of the residual) would put
p0(x) + (1 - p0(x)) p0(x) on x and fail the first bound."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.sampling_params import MAX_BANNED_IDS, SamplingParams
from jaxpaged.worker import sampler, spec_verify

V = 8
N = 4000  # sequences, each its own random stream (sample index)
K = 2


class _Row:
    def __init__(self, i: int) -> None:
        self.params = SamplingParams(temperature=1.0, seed=1234)
        self.key_stream, self.key_counter, self.state_row = i, 5, -1


def _tv(counts: np.ndarray, p: np.ndarray) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - p).sum())


def test_num_emitted_is_the_longest_matching_prefix_plus_one():
    drafts = jnp.array([[1, 2, 3], [1, 2, 3], [1, 9, 3], [4, 4, 4], [1, 2, 3]])
    targets = jnp.array([[1, 2, 3, 7], [1, 2, 0, 7], [1, 2, 3, 7], [0, 4, 4, 7], [1, 2, 3, 7]])
    n = jnp.array([3, 3, 3, 3, 1])  # the last verifies one draft only
    assert spec_verify.num_emitted(drafts, targets, n).tolist() == [4, 3, 2, 1, 2]


def test_verification_keeps_the_target_distribution():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 1, (K + 1, V)).astype(np.float32)
    x0 = 3
    logits[0, x0] = np.log(np.exp(np.delete(logits[0], x0)).sum())  # p0(x0) = 0.5
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)  # [K + 1, V]
    drafts = np.array([x0, int(np.argmin(p[1]))], np.int32)  # the second: rarely accepted
    t, _ = sampler.build_sampling_tensors(
        [_Row(i) for i in range(N)],
        N,
        vocab_size=V,
        engine_key_data=sampler.seed_to_key_data(0),
    )
    state = sampler.create_seq_state(1, V, MAX_BANNED_IDS)
    # a step that verifies drafts has a mask row per verified position (none set here)
    per_row = t._replace(allowed=np.repeat(t.allowed, K + 1, axis=0))

    # one program (op by op, the sampling without drafts compiled ~50 small ones)
    @jax.jit
    def verify(per_row, t):
        expanded = spec_verify.expand_sampling(per_row, K + 1)
        rows = jnp.tile(jnp.asarray(logits), (N, 1))  # [N * (K + 1), V]
        out = sampler.sample(rows, expanded, state, num_logprobs=0)
        targets = out.token_ids.reshape(N, K + 1)
        d = jnp.broadcast_to(jnp.asarray(drafts), (N, K))
        emitted = spec_verify.num_emitted(d, targets, jnp.full((N,), K, jnp.int32))
        plain = sampler.sample(jnp.tile(jnp.asarray(logits[:1]), (N, 1)), t, state, num_logprobs=0)
        return targets, emitted, plain.token_ids

    targets, emitted, plain = (
        np.asarray(a) for a in verify(*jax.tree.map(jnp.asarray, (per_row, t)))
    )
    first = targets[:, 0]
    assert _tv(np.bincount(first, minlength=V), p[0]) < 0.04
    accepted = emitted >= 2
    assert abs(accepted.mean() - p[0, x0]) < 4 * np.sqrt(0.25 / N)
    second = targets[accepted, 1]  # the token after an accepted draft
    assert _tv(np.bincount(second, minlength=V), p[1]) < 0.06
    # the streams are those of output positions counter, counter + 1, ...: position 0 is
    # what sampling without drafts draws
    np.testing.assert_array_equal(plain, first)
