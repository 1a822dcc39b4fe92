"""Custom logits processors: the two shipped rules against plain numpy on the same logits, and
in the engine, chosen per request in one batch, without recompiling."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.engine import LLMEngine
from jaxpaged.models.testing import random_params, tiny_config
from jaxpaged.sampling_params import MAX_PROCESSOR_ARGS
from jaxpaged.worker.compile_counter import CompileCounter
from jaxpaged.worker.logits_processors import (
    apply_logits_processors,
    guidance_mix,
    no_repeat_ngram,
)

V, H = 24, 20
PROCESSORS = (no_repeat_ngram(max_n=4), guidance_mix())


class _Tensors(NamedTuple):  # what apply_logits_processors reads of SamplingTensors
    processor: np.ndarray
    processor_args: np.ndarray
    state_rows: np.ndarray


class _State(NamedTuple):  # ... and of SeqState
    tokens: np.ndarray
    num_tokens: np.ndarray


def _apply(logits, processor, args, histories):
    b = len(histories)
    tokens = np.full((b, H), -1, np.int32)
    for i, h in enumerate(histories):
        tokens[i, : len(h)] = h
    padded = np.zeros((b, MAX_PROCESSOR_ARGS), np.float32)
    for i, a in enumerate(args):
        padded[i, : len(a)] = a
    t = _Tensors(np.array(processor, np.int32), padded, np.arange(b, dtype=np.int32))
    state = _State(tokens, np.array([len(h) for h in histories], np.int32))
    return np.asarray(apply_logits_processors(jnp.asarray(logits), t, state, PROCESSORS))


def _numpy_no_repeat(logits, history, n):
    out = logits.copy()
    if len(history) < n - 1:
        return out
    tail = tuple(history[len(history) - (n - 1) :])
    for j in range(len(history) - n + 1):
        if tuple(history[j : j + n - 1]) == tail:
            out[history[j + n - 1]] = -np.inf
    return out


def test_no_repeat_ngram_matches_numpy():
    rng = np.random.default_rng(0)
    for trial in range(6):
        b = 5
        # few distinct tokens, so n-grams repeat often
        histories = [list(rng.integers(0, 4 + trial, rng.integers(0, H + 1))) for _ in range(b)]
        ns = [2, 3, 4, 2, 3]
        chose = [0, 0, 0, -1, 0]  # row 3 did not choose it
        logits = rng.normal(size=(b, V)).astype(np.float32)
        got = _apply(logits, chose, [(n,) for n in ns], histories)
        for i in range(b):
            want = logits[i] if chose[i] < 0 else _numpy_no_repeat(logits[i], histories[i], ns[i])
            np.testing.assert_array_equal(got[i], want)


def _log_softmax(x):
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def test_guidance_mix_matches_numpy():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(7, V)).astype(np.float32) * 3
    # rows: (group, role, scale); row 4 has no partner; row 5 chose nothing; row 6 pairs with 2
    args = [(1, 1, 1.5), (2, 0, 0), (2, 1, 3.0), (1, 0, 0), (9, 1, 2.0), (1, 0, 0), (2, 0, 0)]
    chose = [1, 1, 1, 1, 1, -1, 1]
    got = _apply(logits, chose, args, [[1]] * 7)
    pairs = {0: (0, 3), 3: (0, 3), 1: (2, 1), 2: (2, 1), 6: (2, 1)}
    for i in range(7):
        if i in pairs:
            c, u = pairs[i]
            lc, lu = _log_softmax(logits[c]), _log_softmax(logits[u])
            want = lu + args[c][2] * (lc - lu)
            np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5)
        else:
            np.testing.assert_array_equal(got[i], logits[i])


# ------------------------------------------------------------------- in the engine
GREEDY = dict(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    engine = LLMEngine.from_params(
        tiny_config(),
        random_params(tiny_config(), seed=0),
        max_model_len=48,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        num_kv_blocks=16,
        show_progress=False,
        logits_processors=PROCESSORS,
    )
    yield LLM.from_engine(engine)
    engine.close()


def _ids(out) -> list[int]:
    return list(out.outputs[0].token_ids)


def _ngrams(seq, n):
    return [tuple(seq[i : i + n]) for i in range(len(seq) - n + 1)]


def test_processors_in_the_engine(llm):
    a, b = [5, 9, 2, 7, 30], [11, 3, 3, 60]
    plain = SamplingParams(**GREEDY)
    with CompileCounter() as compiles:
        plain_a, plain_b = (_ids(o) for o in llm.generate([a, b], plain, use_tqdm=False))
        no_rep = SamplingParams(
            **GREEDY, logits_processor="no_repeat_ngram", logits_processor_args=(2,)
        )
        outs = llm.generate([a, b], [no_rep, plain], use_tqdm=False)

        # classifier-free-guidance pairs: scale 1 is the conditional prompt's own greedy
        # decode, scale 0 the unconditional one's, for both members of the pair
        def cfg(role, scale):
            return SamplingParams(
                **GREEDY, logits_processor="guidance", logits_processor_args=(7, role, scale)
            )

        one = llm.generate([a, b], [cfg(1, 1.0), cfg(0, 0.0)], use_tqdm=False)
        zero = llm.generate([a, b], [cfg(1, 0.0), cfg(0, 0.0)], use_tqdm=False)
    assert len(set(_ngrams(a + plain_a, 2))) < len(_ngrams(a + plain_a, 2))  # it repeats
    got = a + _ids(outs[0])
    assert len(set(_ngrams(got, 2))) == len(_ngrams(got, 2))  # no bigram twice
    assert _ids(outs[1]) == plain_b  # the other request in the batch is untouched
    assert [_ids(o) for o in one] == [plain_a, plain_a]
    assert [_ids(o) for o in zero] == [plain_b, plain_b]
    assert compiles.count == 0


def test_unknown_processor_is_refused(llm):
    with pytest.raises(ValueError, match="logits_processor: 'nope' is not registered"):
        llm.generate([[1, 2]], SamplingParams(logits_processor="nope"), use_tqdm=False)
    with pytest.raises(ValueError, match="without a logits_processor"):
        SamplingParams(logits_processor_args=(1.0,))
