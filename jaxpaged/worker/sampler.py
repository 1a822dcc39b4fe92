"""On-device sampling for a padded batch of sequences, one parameter set per row.

The runner calls :func:`sample` inside its jitted step. Every per-row setting is an
array in :class:`SamplingTensors`, so one compiled program serves any mix of greedy,
temperature, top-k/top-p/min-p, penalised and seeded rows: nothing about the mix is
static. The costly stages run under ``lax.cond`` and are skipped at run time when no
row needs them (the program is the same either way):

* penalties: a gather of the rows' ``[B, V]`` token counts from the on-device state;
* top-k, and top-p: each an exact per-row threshold search (32 passes, no sort);
* the random draw and all filters, when every row is greedy.

Order of operations: the structured-output mask (tokens its grammar forbids get -inf; a
packed int32 bitmask per row, all ones for rows without a grammar), ``logit_bias (added to the raw logits, as OpenAI and vLLM do),
penalties (repetition on prompt + output tokens; frequency
and presence on output tokens), ``min_tokens`` bans of EOS / stop token ids, greedy argmax
for rows with temperature < 1e-5, temperature, top-k, top-p, min-p, then an inverse-CDF
draw with one uniform per row (see :func:`sample_from_logits`).

Logprobs are those of the raw model distribution, ``log_softmax(logits)`` before any
penalty, temperature or filter (vLLM's default ``raw_logprobs``): they say what the model
thought, not what the sampler was allowed to pick.

Randomness: each row's key is ``fold_in(fold_in(key(key_data), stream), counter)`` where
``counter`` is the number of tokens the sequence has generated so far. Seeded rows use the
request's seed as key data and the sample index (0..n-1) as stream, so a seeded request
draws the same tokens whatever else is in the batch, at whatever row, across runs.
Unseeded rows use the engine's key data and an engine-unique per-sequence stream.

Per-sequence state (:class:`SeqState`): the runner keeps, on the device, one row per running
request that has penalties, ``min_tokens`` or ``logit_bias``: a ``[V]`` mask of its prompt's
tokens, ``[V]`` counts of the tokens it generated, how many it generated, its ``min_tokens``
and the ids that holds back (EOS and ``stop_token_ids``), and its logit-bias pairs. A row is filled once when the request starts running
(:func:`init_state_row`, from its prompt and output so far) and the step adds each sampled
token to its row (:func:`record_sampled`), so no token history crosses from the host per step
and the state stays exact when the host learns the tokens a step late.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpaged.sampling_params import MAX_PROCESSOR_ARGS
from jaxpaged.worker.engine_jit import engine_jit
from jaxpaged.worker.logits_processors import apply_logits_processors

GREEDY_EPS = 1e-5  # temperatures below this are greedy, as in vLLM
_PRNG_IMPL = "threefry2x32"  # explicit, so key data is always [2] uint32
_U32 = 0xFFFFFFFF


class SamplingTensors(NamedTuple):
    """Per-row sampling settings of one padded batch (a pytree of arrays)."""

    temperature: jax.Array  # [B] float32; < GREEDY_EPS means greedy
    top_p: jax.Array  # [B] float32 in (0, 1]; 1 = off
    top_k: jax.Array  # [B] int32 in [1, V]; V = off
    min_p: jax.Array  # [B] float32 in [0, 1]; 0 = off
    repetition_penalty: jax.Array  # [B] float32; 1 = off
    presence_penalty: jax.Array  # [B] float32; 0 = off
    frequency_penalty: jax.Array  # [B] float32; 0 = off
    key_data: jax.Array  # [B, 2] uint32 threefry key data (seed or engine key)
    key_stream: jax.Array  # [B] uint32 sample index (seeded) or sequence stream (unseeded)
    key_counter: jax.Array  # [B] uint32 tokens generated so far by the sequence
    state_rows: jax.Array  # [B] int32 row in the SeqState; -1 = none (no penalty, no ban)
    num_logprobs: jax.Array  # [B] int32 top logprobs the row wants (-1: no logprobs at all)
    processor: jax.Array  # [B] int32 index of the row's logits processor; -1 = none
    processor_args: jax.Array  # [B, MAX_PROCESSOR_ARGS] float32 its per-request parameters
    allowed: jax.Array  # [B, ceil(V / 32)] int32 packed: bit j of word i allows token 32i+j


class SamplerOutput(NamedTuple):
    """Sampled tokens and logprobs of one batch (raw model distribution)."""

    token_ids: jax.Array  # [B] int32
    logprobs: jax.Array  # [B] float32 logprob of the sampled token
    top_logprob_ids: jax.Array  # [B, K] int32 (zeros when no row asked)
    top_logprobs: jax.Array  # [B, K] float32


class SamplingRow(Protocol):
    """What :func:`build_sampling_tensors` reads of each sampling sequence (the persistent
    batch's rows, worker/input_batch.py)."""

    params: Any  # duck-typed SamplingParams
    key_stream: int  # sample index (seeded rows) or engine-unique stream (unseeded)
    key_counter: int  # output tokens sampled before this one
    state_row: int  # row in the SeqState, -1 = none


class SeqState(NamedTuple):
    """Per-request sampler state on the device, one row per running request that has
    penalties or ``min_tokens`` (donated every step): what the sampler needs of the request's
    past, kept current by the step itself."""

    prompt_mask: jax.Array  # bool [R, V]: token appears in the row's prompt
    output_counts: jax.Array  # int32 [R, V]: times the row's request generated the token
    num_generated: jax.Array  # int32 [R]: output tokens the row's request has sampled
    min_tokens: jax.Array  # int32 [R]: its min_tokens
    banned_ids: jax.Array  # int32 [R, M]: ids held back until min_tokens is reached, -1 padded
    # for logits processors: the row's tokens in order (prompt, then output), -1 after
    # num_tokens; H = max_model_len when the engine has processors, else 1 (unused)
    tokens: jax.Array  # int32 [R, H]
    num_tokens: jax.Array  # int32 [R]
    bias_ids: jax.Array  # int32 [R, L]: logit_bias token ids, -1 padded
    bias_values: jax.Array  # float32 [R, L]: the bias of each, 0 padded


def create_seq_state(
    num_rows: int, vocab_size: int, max_banned: int, max_bias: int = 1, history_len: int = 1
) -> SeqState:
    """Empty rows, filled on the host and copied to the default device: ``jnp.zeros`` and
    ``jnp.full`` would each compile a program of their own at start-up."""
    host = SeqState(
        prompt_mask=np.zeros((num_rows, vocab_size), np.bool_),
        output_counts=np.zeros((num_rows, vocab_size), np.int32),
        num_generated=np.zeros((num_rows,), np.int32),
        min_tokens=np.zeros((num_rows,), np.int32),
        banned_ids=np.full((num_rows, max_banned), -1, np.int32),
        tokens=np.full((num_rows, history_len), -1, np.int32),
        num_tokens=np.zeros((num_rows,), np.int32),
        bias_ids=np.full((num_rows, max_bias), -1, np.int32),
        bias_values=np.zeros((num_rows, max_bias), np.float32),
    )
    return SeqState(*(jax.device_put(a, may_alias=False) for a in host))


def _drop_padding(ids: jax.Array, size: int) -> jax.Array:
    """ids < 0 -> ``size`` (out of range, so a scatter with mode="drop" skips them)."""
    return jnp.where(ids < 0, size, ids)


@functools.partial(engine_jit, donate_argnums=(0,))
def init_state_row(
    state: SeqState,
    row: jax.Array,  # int32 []
    prompt_ids: jax.Array,  # int32 [H] the prompt, -1 padded
    output_ids: jax.Array,  # int32 [H] the output so far, -1 padded
    min_tokens: jax.Array,  # int32 []
    banned_ids: jax.Array,  # int32 [M] ids held back until min_tokens, -1 padded
    bias_ids: jax.Array | None = None,  # int32 [L] logit_bias ids, -1 padded
    bias_values: jax.Array | None = None,  # float32 [L] their biases
) -> SeqState:
    """Fills one row from a request (when it starts running). One compiled shape: H is fixed
    by the runner (``max_model_len``), M by ``MAX_BANNED_IDS``, L by ``MAX_LOGIT_BIAS``."""
    if bias_ids is None:  # no bias: the row's list all padding
        bias_ids = jnp.full(state.bias_ids.shape[1:], -1, jnp.int32)
        bias_values = jnp.zeros(state.bias_values.shape[1:], jnp.float32)
    v = state.prompt_mask.shape[1]
    mask = jnp.zeros((v,), jnp.bool_).at[_drop_padding(prompt_ids, v)].set(True, mode="drop")
    counts = jnp.zeros((v,), jnp.int32).at[_drop_padding(output_ids, v)].add(1, mode="drop")
    num_prompt, num_output = jnp.sum(prompt_ids >= 0), jnp.sum(output_ids >= 0)
    at = jnp.arange(state.tokens.shape[1])  # prompt then output, both -1 padded at the end
    history = jnp.where(
        at < num_prompt,
        prompt_ids[jnp.minimum(at, prompt_ids.shape[0] - 1)],
        output_ids[jnp.clip(at - num_prompt, 0, output_ids.shape[0] - 1)],
    )
    history = jnp.where(at < num_prompt + num_output, history, -1)
    return SeqState(
        prompt_mask=state.prompt_mask.at[row].set(mask),
        output_counts=state.output_counts.at[row].set(counts),
        num_generated=state.num_generated.at[row].set(num_output),
        min_tokens=state.min_tokens.at[row].set(min_tokens),
        banned_ids=state.banned_ids.at[row].set(banned_ids),
        tokens=state.tokens.at[row].set(history),
        num_tokens=state.num_tokens.at[row].set(num_prompt + num_output),
        bias_ids=state.bias_ids.at[row].set(bias_ids),
        bias_values=state.bias_values.at[row].set(bias_values),
    )


def record_sampled(
    state: SeqState,
    rows: jax.Array,  # int32 [B] state rows of the batch, -1 = none
    token_ids: jax.Array,  # int32 [B] the tokens just sampled
) -> SeqState:
    """Adds each sampled token to its row (inside the jitted step)."""
    r = state.output_counts.shape[0]
    rows = _drop_padding(rows, r)
    counts = state.output_counts.at[rows, token_ids].add(1, mode="drop")
    generated = state.num_generated.at[rows].add(1, mode="drop")
    at = state.num_tokens[jnp.minimum(rows, r - 1)]  # past the end of [R, H]: dropped
    tokens = state.tokens.at[rows, at].set(token_ids, mode="drop")
    num_tokens = state.num_tokens.at[rows].add(1, mode="drop")
    return state._replace(
        output_counts=counts, num_generated=generated, tokens=tokens, num_tokens=num_tokens
    )


def banned_now(
    t: SamplingTensors, state: SeqState
) -> jax.Array:  # int32 [B, M] ids each row may not sample now, -1 padded
    """The ban lists of the rows whose request is still short of its min_tokens."""
    r = state.num_generated.shape[0]
    rows = jnp.clip(t.state_rows, 0, r - 1)
    active = (t.state_rows >= 0) & (state.num_generated[rows] < state.min_tokens[rows])
    return jnp.where(active[:, None], state.banned_ids[rows], -1)


def apply_allowed(
    logits: jax.Array,  # [B, V] float32
    allowed: jax.Array,  # [B, ceil(V / 32)] int32 packed mask
) -> jax.Array:  # [B, V]
    """-inf for every token a row's mask does not allow."""
    b, v = logits.shape
    bits = jnp.right_shift(allowed[:, :, None], jnp.arange(32, dtype=jnp.int32)) & 1
    return jnp.where(bits.reshape(b, -1)[:, :v] != 0, logits, -jnp.inf)


def apply_logit_bias(
    logits: jax.Array,  # [B, V] float32
    t: SamplingTensors,
    state: SeqState,
) -> jax.Array:  # [B, V]
    """Adds each row's logit_bias pairs to its logits (rows without a state row: none)."""
    b, v = logits.shape
    rows = jnp.clip(t.state_rows, 0, state.bias_ids.shape[0] - 1)
    ids = jnp.where((t.state_rows >= 0)[:, None], state.bias_ids[rows], -1)  # [B, L]
    batch_rows = jnp.broadcast_to(jnp.arange(b)[:, None], ids.shape)
    return logits.at[batch_rows, _drop_padding(ids, v)].add(state.bias_values[rows], mode="drop")


def seed_to_key_data(seed: int) -> np.ndarray:
    """Threefry key data [2] uint32 of an integer seed (taken modulo 2**64)."""
    seed = int(seed) % (1 << 64)
    return np.array([(seed >> 32) & _U32, seed & _U32], dtype=np.uint32)


def build_sampling_tensors(
    rows: Sequence[SamplingRow | None],
    batch_size: int,
    *,
    vocab_size: int,
    engine_key_data: np.ndarray,  # [2] uint32, e.g. seed_to_key_data(engine seed)
    processor_names: Sequence[str] = (),  # the engine's logits processors, in index order
    allowed: Mapping[int, np.ndarray] | None = None,  # row -> int32 [ceil(V / 32)] mask
) -> tuple[SamplingTensors, dict[int, str]]:
    """Host-side (numpy) tensors for ``rows`` padded to ``batch_size`` rows, and the rows
    that could not be filled (index -> reason; left as padding, so one bad row cannot stop
    the batch). None rows (sequences that do not sample) and padding rows are greedy with
    every filter off; rows without an ``allowed`` mask may take any token.
    """
    n = len(rows)
    if n > batch_size:
        raise ValueError(f"rows: {n} rows do not fit batch_size={batch_size}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    engine_key_data = np.asarray(engine_key_data, dtype=np.uint32)
    if engine_key_data.shape != (2,):
        raise ValueError(f"engine_key_data must have shape (2,), got {engine_key_data.shape}")

    b = batch_size
    t = SamplingTensors(
        temperature=np.zeros(b, np.float32),
        top_p=np.ones(b, np.float32),
        top_k=np.full(b, vocab_size, np.int32),
        min_p=np.zeros(b, np.float32),
        repetition_penalty=np.ones(b, np.float32),
        presence_penalty=np.zeros(b, np.float32),
        frequency_penalty=np.zeros(b, np.float32),
        key_data=np.zeros((b, 2), np.uint32),
        key_stream=np.zeros(b, np.uint32),
        key_counter=np.zeros(b, np.uint32),
        state_rows=np.full(b, -1, np.int32),
        num_logprobs=np.full(b, -1, np.int32),
        processor=np.full(b, -1, np.int32),
        processor_args=np.zeros((b, MAX_PROCESSOR_ARGS), np.float32),
        allowed=np.full((b, -(-vocab_size // 32)), -1, np.int32),
    )
    for i, mask in (allowed or {}).items():
        t.allowed[i] = mask
    failed: dict[int, str] = {}
    for i, row in enumerate(rows):
        if row is None:
            continue
        try:
            _fill_row(t, i, row, vocab_size, engine_key_data, processor_names)
        except (ValueError, TypeError, OverflowError) as e:
            failed[i] = f"{type(e).__name__}: {e}"
            for arr, pad in zip(t, _padding_values(vocab_size), strict=True):
                arr[i] = pad
    return t, failed


def _padding_values(vocab_size: int) -> tuple[object, ...]:
    """Each SamplingTensors field's value for a padding row (greedy, filters off)."""
    return (0.0, 1.0, vocab_size, 0.0, 1.0, 0.0, 0.0, 0, 0, 0, -1, -1, -1, 0.0, -1)


def _fill_row(
    t: SamplingTensors,
    i: int,
    row: SamplingRow,
    vocab_size: int,
    engine_key_data: np.ndarray,
    processor_names: Sequence[str] = (),
) -> None:
    sp = row.params
    t.temperature[i] = sp.temperature
    t.top_p[i] = sp.top_p
    k = int(sp.top_k)
    t.top_k[i] = vocab_size if k <= 0 else min(k, vocab_size)
    t.min_p[i] = sp.min_p
    t.repetition_penalty[i] = sp.repetition_penalty
    t.presence_penalty[i] = sp.presence_penalty
    t.frequency_penalty[i] = sp.frequency_penalty
    t.key_data[i] = engine_key_data if sp.seed is None else seed_to_key_data(sp.seed)
    t.key_stream[i] = int(row.key_stream) & _U32
    t.key_counter[i] = int(row.key_counter) & _U32
    has_penalty = (
        sp.repetition_penalty != 1.0 or sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0
    )
    processor = getattr(sp, "logits_processor", None)
    needs_row = has_penalty or sp.min_tokens > 0 or sp.logit_bias or processor is not None
    if needs_row and row.state_row < 0:
        raise ValueError(
            "penalties / min_tokens / logit_bias / logits_processor: the sequence has no state row"
        )
    t.state_rows[i] = row.state_row
    t.num_logprobs[i] = -1 if sp.logprobs is None else sp.logprobs
    if processor is not None:
        if processor not in processor_names:
            raise ValueError(f"logits_processor: {processor!r} is not registered")
        t.processor[i] = processor_names.index(processor)
        args = sp.logits_processor_args
        t.processor_args[i, : len(args)] = args


def apply_penalties(
    logits: jax.Array,  # [B, V] float32
    t: SamplingTensors,
    state: SeqState,
) -> jax.Array:  # [B, V]
    """vLLM penalties: repetition on prompt+output tokens, frequency/presence on output."""
    r = state.output_counts.shape[0]
    has_row = (t.state_rows >= 0)[:, None]  # [B, 1]
    rows = jnp.clip(t.state_rows, 0, r - 1)
    out_counts = jnp.where(has_row, state.output_counts[rows], 0).astype(jnp.float32)  # [B, V]
    seen = has_row & (state.prompt_mask[rows] | (out_counts > 0))  # [B, V]
    rp = t.repetition_penalty[:, None]
    penalised = jnp.where(logits > 0, logits / rp, logits * rp)
    logits = jnp.where(seen, penalised, logits)
    logits = logits - t.frequency_penalty[:, None] * out_counts
    logits = logits - t.presence_penalty[:, None] * (out_counts > 0).astype(logits.dtype)
    return logits


def _ordered_bits(x: jax.Array) -> jax.Array:
    """Map float32 to uint32 so that the unsigned order is the float order (NaN aside)."""
    x = jnp.where(x == 0, jnp.zeros_like(x), x)  # -0.0 == 0.0: one key for both
    i = lax.bitcast_convert_type(x, jnp.int32)
    i = jnp.where(i < 0, i ^ jnp.int32(0x7FFFFFFF), i)  # negatives: reverse magnitude order
    return lax.bitcast_convert_type(i, jnp.uint32) ^ jnp.uint32(0x80000000)


def _bisect_bits(
    keys: jax.Array,  # [B, V] uint32 (see _ordered_bits)
    pred,  # (threshold [B, 1] uint32) -> [B] bool, monotone: True up to some point, then False
) -> jax.Array:  # [B] uint32: the largest threshold with pred True (row minimum if none)
    """Exact per-row search over the 32-bit keys: 32 passes over [B, V], no sort."""
    lo = jnp.min(keys, axis=-1)
    hi = jnp.max(keys, axis=-1)

    def body(_, bounds):
        lo, hi = bounds
        gap = hi - lo
        mid = lo + gap // 2 + (gap & 1)  # ceil midpoint without overflow
        ok = pred(mid[:, None]) & (lo < hi)
        return jnp.where(ok, mid, lo), jnp.where(ok | (lo >= hi), hi, mid - 1)

    lo, _ = lax.fori_loop(0, 32, body, (lo, hi))
    return lo


def apply_top_k(
    logits: jax.Array,  # [B, V] float32
    top_k: jax.Array,  # [B] int32 in [1, V]
) -> jax.Array:  # [B, V]
    """Mask to -inf all but the top_k largest logits of each row (ties with the k-th kept).

    One exact per-row threshold found by bisection on the float bit patterns (32
    elementwise passes instead of a full sort: on CPU a [32, 49152] sort takes seconds).
    """
    keys = _ordered_bits(logits)
    thresh = _bisect_bits(keys, lambda t: jnp.sum(keys >= t, axis=-1) >= top_k)  # [B]
    return jnp.where(keys >= thresh[:, None], logits, -jnp.inf)


def apply_top_p(
    logits: jax.Array,  # [B, V] float32 (-inf = already excluded)
    top_p: jax.Array,  # [B] float32 in (0, 1]
) -> jax.Array:  # [B, V]
    """Keep the smallest most-likely set of tokens whose probability reaches top_p: a token
    stays if the tokens more likely than it hold less than top_p; the best always stays.

    The kept set is {logit >= T} for the largest T with mass(logit >= T) >= top_p, found by
    bisection as in :func:`apply_top_k` (ties with the last kept token are kept).
    """
    keys = _ordered_bits(logits)
    probs = jax.nn.softmax(logits, axis=-1)  # [B, V]
    thresh = _bisect_bits(
        keys, lambda t: jnp.sum(jnp.where(keys >= t, probs, 0.0), axis=-1) >= top_p
    )
    # top_p = 1 keeps everything (float rounding of the total mass must not drop the tail).
    keep = (keys >= thresh[:, None]) | (top_p[:, None] >= 1.0)
    return jnp.where(keep, logits, -jnp.inf)


def apply_top_k_top_p(
    logits: jax.Array,  # [B, V] float32, temperature already applied
    top_k: jax.Array,  # [B] int32 in [1, V]
    top_p: jax.Array,  # [B] float32 in (0, 1]
) -> jax.Array:  # [B, V]
    """top-k, then top-p on the renormalised survivors (vLLM's order)."""
    return apply_top_p(apply_top_k(logits, top_k), top_p)


def _row_uniform(
    key_data: jax.Array,  # [2] uint32
    stream: jax.Array,  # [] uint32
    counter: jax.Array,  # [] uint32
) -> jax.Array:  # [] float32 in [0, 1)
    key = jax.random.wrap_key_data(key_data, impl=_PRNG_IMPL)
    key = jax.random.fold_in(jax.random.fold_in(key, stream), counter)
    return jax.random.uniform(key, (), jnp.float32)


def sample_from_logits(
    logits: jax.Array,  # [B, V] float32, filtered (-inf = excluded)
    u: jax.Array,  # [B] float32 uniforms in [0, 1)
    *,
    block: int = 256,
) -> jax.Array:  # [B] int32
    """Inverse-CDF draw from softmax(logits), one uniform per row.

    Cumulative sums run in two levels (per block of ``block`` tokens, then inside the one
    chosen block), so the cost is one exp and one sum over [B, V]; Gumbel-max would need
    B*V random numbers, which on CPU cost more than all the rest of sampling. Tokens with
    zero weight (excluded, or underflowing below ~1e-38 of the best) are never drawn.
    """
    b, v = logits.shape
    nb = -(-v // block)
    w = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))  # [B, V], best token = 1
    w = jnp.pad(w, ((0, 0), (0, nb * block - v))).reshape(b, nb, block)
    block_sum = jnp.sum(w, axis=-1)  # [B, nb]
    block_cum = jnp.cumsum(block_sum, axis=-1)
    target = u * block_cum[:, -1]  # [B], in [0, total) up to rounding
    last_block = jnp.max(jnp.where(block_sum > 0, jnp.arange(nb)[None, :], 0), axis=-1)
    j = jnp.minimum(jnp.sum(block_cum <= target[:, None], axis=-1), last_block)  # [B]
    before = jnp.where(j > 0, jnp.take_along_axis(block_cum, (j - 1)[:, None], -1)[:, 0], 0.0)
    inner = jnp.take_along_axis(w, j[:, None, None], axis=1)[:, 0]  # [B, block]
    cum = before[:, None] + jnp.cumsum(inner, axis=-1)
    i = jnp.sum(cum <= target[:, None], axis=-1)  # [B]
    # Rounding can push `j` / `i` past the last positive weight: clamp to the last block /
    # token that has weight.
    pos = jnp.arange(block)[None, :]
    last = jnp.max(jnp.where(inner > 0, pos, -1), axis=-1)
    i = jnp.minimum(i, last)
    return (j * block + i).astype(jnp.int32)


def greedy_argmax(x: jax.Array) -> jax.Array:  # float32 [B, V] -> int32 [B]
    return jnp.argmax(x, axis=-1).astype(jnp.int32)


def sample(
    logits: jax.Array,  # [B, V] float32 raw model logits
    t: SamplingTensors,
    state: SeqState,
    *,
    num_logprobs: int,
    argmax: Callable[[jax.Array], jax.Array] = greedy_argmax,
    logits_processors: tuple[Any, ...] = (),
) -> SamplerOutput:
    """Pick one token per row. ``num_logprobs`` (static) is K, the most top logprobs any
    row may ask for; the top-K pass runs only when some row asks (``t.num_logprobs``).
    ``argmax`` ([B, V] float32 -> int32 [B], ``jnp.argmax``'s answer) picks greedy rows: a
    backend may pass a faster one. ``logits_processors`` (static; ``LogitsProcessor``s, see
    :mod:`jaxpaged.worker.logits_processors`) rewrite the rows that chose one before
    penalties and filters; logprobs stay those of the raw logits."""
    logits = logits.astype(jnp.float32)
    raw_logits = logits
    b, v = logits.shape
    if logits_processors:
        logits = apply_logits_processors(logits, t, state, logits_processors)

    needs_penalty = jnp.any(
        (t.repetition_penalty != 1.0) | (t.presence_penalty != 0.0) | (t.frequency_penalty != 0.0)
    )
    greedy = t.temperature < GREEDY_EPS  # [B]
    banned = banned_now(t, state)  # [B, M]
    r = state.bias_ids.shape[0]
    biased = (t.state_rows >= 0) & (state.bias_ids[jnp.clip(t.state_rows, 0, r - 1), 0] >= 0)
    needs_bias = jnp.any(biased)
    needs_mask = jnp.any(t.allowed != -1)

    def _pick(logits):
        x = lax.cond(needs_mask, apply_allowed, lambda lg, _: lg, logits, t.allowed)
        x = lax.cond(needs_bias, apply_logit_bias, lambda lg, *_: lg, x, t, state)
        x = lax.cond(needs_penalty, apply_penalties, lambda lg, *_: lg, x, t, state)
        # min_tokens: EOS / stop ids may not be sampled yet (padding -1 -> dropped).
        banned_cols = jnp.where(banned < 0, v, banned)
        banned_rows = jnp.broadcast_to(jnp.arange(b)[:, None], banned_cols.shape)
        x = x.at[banned_rows, banned_cols].set(-jnp.inf, mode="drop")
        greedy_ids = argmax(x)

        def _sample_random(x):
            x = x / jnp.where(greedy, 1.0, t.temperature)[:, None]
            sampling = ~greedy
            x = lax.cond(
                jnp.any(sampling & (t.top_k < v)),
                apply_top_k,
                lambda lg, _k: lg,
                x,
                jnp.clip(t.top_k, 1, v),
            )
            x = lax.cond(
                jnp.any(sampling & (t.top_p < 1.0)), apply_top_p, lambda lg, _p: lg, x, t.top_p
            )
            # min_p keeps p_i >= min_p * p_max, i.e. x_i >= x_max + log(min_p): no softmax.
            x_max = jnp.max(x, axis=-1, keepdims=True)
            x = jnp.where(x < x_max + jnp.log(t.min_p)[:, None], -jnp.inf, x)
            u = jax.vmap(_row_uniform)(t.key_data, t.key_stream, t.key_counter)  # [B]
            return sample_from_logits(x, u)

        # All-greedy batches skip the draw and the filters.
        sampled_ids = lax.cond(jnp.all(greedy), lambda _: greedy_ids, _sample_random, x)
        return jnp.where(greedy, greedy_ids, sampled_ids)

    # The common case (greedy, no penalty, no ban) is one argmax over the raw logits: the
    # general path's conditionals and scatter each copy the [B, V] logits.
    plain = jnp.all(greedy) & ~needs_penalty & ~needs_bias & ~needs_mask & jnp.all(banned < 0)
    token_ids = lax.cond(plain, argmax, _pick, logits)

    # Logprobs (as logits - logsumexp: no [B, V] log_softmax) only when some row asks: the
    # logsumexp is an exp over [B, V], a third of a greedy batch's sampling time.
    k = int(num_logprobs)

    def _logprobs(lg):
        lse = jax.nn.logsumexp(lg, axis=-1)  # [B]
        token = jnp.take_along_axis(lg, token_ids[:, None], axis=-1)[:, 0] - lse
        if k == 0:
            return token, jnp.zeros((b, 0), jnp.int32), jnp.zeros((b, 0), jnp.float32)

        def _top(lg):
            vals, ids = lax.top_k(lg, k)
            return ids.astype(jnp.int32), vals - lse[:, None]

        def _none(lg):
            return jnp.zeros((b, k), jnp.int32), jnp.zeros((b, k), jnp.float32)

        return token, *lax.cond(jnp.any(t.num_logprobs > 0), _top, _none, lg)

    def _no_logprobs(_):
        return (
            jnp.zeros(b, jnp.float32),
            jnp.zeros((b, k), jnp.int32),
            jnp.zeros((b, k), jnp.float32),
        )

    token_logprobs, top_ids, top_vals = lax.cond(
        jnp.any(t.num_logprobs >= 0), _logprobs, _no_logprobs, raw_logits
    )
    return SamplerOutput(token_ids, token_logprobs, top_ids, top_vals)
