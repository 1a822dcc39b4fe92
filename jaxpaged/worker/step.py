"""The jitted engine step: model forward over the paged KV pool, logits of each sequence's last
token, on-device sampling. Pure function of (params, pool, per-sequence sampler state,
previous step's sampled tokens, batch); the pool and the sampler state are donated."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxpaged.distributed.parallel import replicate_on, shard_attention
from jaxpaged.kernels.pool_format import SPLIT, PoolFormat
from jaxpaged.kernels.step_kernels import XLA_KERNELS, StepKernels
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.llama import Params, compute_logits, forward
from jaxpaged.worker import sampler
from jaxpaged.worker.kv_cache import KVPool
from jaxpaged.worker.logits_processors import LogitsProcessor


class StepBatch(NamedTuple):
    """One step's inputs, padded to a bucket: T tokens, S sequences, B block-table columns."""

    tokens: jax.Array  # int32 [T]; padding rows 0
    prev_rows: jax.Array  # int32 [T]; >= 0: take the previous step's sampled token of that row
    positions: jax.Array  # int32 [T]; padding rows 0
    slot_mapping: jax.Array  # int32 [T]; block_id * block_size + offset, -1 = padding
    kv_lens: jax.Array  # int32 [S]; cached tokens per sequence, this step's included
    block_tables: jax.Array  # int32 [S, B]; logical -> physical block, padding 0
    cu_q_lens: jax.Array  # int32 [S + 1]; cumulative query lengths
    num_seqs: jax.Array  # int32 [1]
    sample_rows: jax.Array  # int32 [S]; row of each sequence's last token (0 for padding)
    sampling: sampler.SamplingTensors  # per sequence, [S, ...]


class StepOutput(NamedTuple):
    token_ids: jax.Array  # int32 [R]; row i < S: sequence i's token; R = the runner's max rows
    logprobs: jax.Array  # float32 [S]; log-probability of the sampled token
    top_ids: jax.Array  # int32 [S, K]
    top_logprobs: jax.Array  # float32 [S, K]


@functools.partial(
    jax.jit,
    static_argnames=(
        "config",
        "num_blocks",
        "block_size",
        "pool_format",
        "num_logprobs",
        "backend",
        "max_q_len",
        "max_kv_len",
        "mesh",
        "kernels",
        "logits_processors",
    ),
    donate_argnums=(1, 2),
)
def step(
    params: Params,
    pool: KVPool,
    seq_state: sampler.SeqState,
    prev_sampled: jax.Array,  # int32 [R] the previous step's StepOutput.token_ids
    batch: StepBatch,
    *,
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    num_logprobs: int,
    pool_format: PoolFormat = SPLIT,
    backend: str | None = None,
    max_q_len: int | None = None,
    max_kv_len: int | None = None,
    mesh: jax.sharding.Mesh | None = None,
    kernels: StepKernels = XLA_KERNELS,
    logits_processors: tuple[LogitsProcessor, ...] = (),
) -> tuple[StepOutput, KVPool, sampler.SeqState]:
    """Runs every layer over the batch's tokens, writing their K/V into the pool first, and
    samples one token per sequence. Decode tokens the host has not seen yet come straight
    from ``prev_sampled`` (``batch.prev_rows``), so the host never waits for a step before
    dispatching the next. ``max_q_len`` / ``max_kv_len`` are the bucket's static
    bounds, passed to the attention kernel so it reads only blocks that can be live. With a
    ``mesh`` (tensor parallelism) the attention runs per device on its heads under shard_map,
    and logits and outputs are gathered whole onto every device."""
    sm_scale = config.head_dim**-0.5
    layer_slots = num_blocks * block_size

    def attend(q, k, v, layer, pool, slot_mapping, kv_lens, tables, cu_q_lens, n):
        slots = jnp.where(slot_mapping >= 0, slot_mapping + layer * layer_slots, -1)
        pool = pool_format.write(pool, k, v, slots)
        out = pool_format.attend(
            q,
            pool,
            kv_lens,
            tables + layer * num_blocks,
            cu_q_lens,
            n,
            num_kv_heads=k.shape[1],
            sm_scale=sm_scale,
            backend=backend,
            max_q_len=max_q_len,
            max_kv_len=max_kv_len,
        )
        return out, pool

    if mesh is not None:
        attend = shard_attention(attend, mesh)

    def attention_fn(q, k, v, layer, pool):
        b = batch
        meta = (b.slot_mapping, b.kv_lens, b.block_tables, b.cu_q_lens, b.num_seqs)
        return attend(q, k, v, layer, tuple(pool), *meta)

    # None on platforms that leave the matmuls to XLA's dots
    linear_fn = kernels.linear_fn(batch.cu_q_lens[-1])
    logits_fn = kernels.logits_fn(batch.num_seqs[0])
    prev = prev_sampled[jnp.maximum(batch.prev_rows, 0)]  # [T]
    tokens = jnp.where(batch.prev_rows >= 0, prev, batch.tokens)
    hidden, pool = forward(
        params,
        tokens,
        batch.positions,
        config=config,
        attention_fn=attention_fn,
        cache=pool,
        linear_fn=linear_fn,
    )
    rows = hidden[batch.sample_rows]  # [S, D]
    # XLA's own logits dot keeps float32 accumulation for bf16 params (preferred_element_type)
    logits = compute_logits(params, rows, config=config, linear_fn=logits_fn)  # [S, V]
    logits = replicate_on(logits, mesh)
    out = sampler.sample(
        logits,
        batch.sampling,
        seq_state,
        num_logprobs=num_logprobs,
        argmax=kernels.argmax,
        logits_processors=logits_processors,
    )
    seq_state = sampler.record_sampled(seq_state, batch.sampling.state_rows, out.token_ids)
    num_rows = prev_sampled.shape[0]
    token_ids = jnp.zeros((num_rows,), jnp.int32).at[: out.token_ids.shape[0]].set(out.token_ids)
    out = StepOutput(token_ids, out.logprobs, out.top_logprob_ids, out.top_logprobs)
    return replicate_on(out, mesh), pool, replicate_on(seq_state, mesh)
