"""The jitted engine step: model forward over the paged KV pool, logits of each sequence's last
token, on-device sampling. Pure function of (params, pool, penalty state, previous step's
sampled tokens, batch); the pool and the penalty state are donated."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxpaged.distributed.parallel import replicate_on, shard_attention
from jaxpaged.kernels import cpu, default_backend, ragged_paged_attention, write_kv
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.llama import (
    Params,
    compute_logits,
    forward,
    linear_xla,
    map_matmul_weights,
)
from jaxpaged.worker import sampler
from jaxpaged.worker.kv_cache import KVPool


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
        "num_logprobs",
        "backend",
        "max_q_len",
        "max_kv_len",
        "mesh",
        "native_linear",
    ),
    donate_argnums=(1, 2),
)
def step(
    params: Params,
    pool: KVPool,
    penalties: sampler.PenaltyState,
    prev_sampled: jax.Array,  # int32 [R] the previous step's StepOutput.token_ids
    batch: StepBatch,
    *,
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    num_logprobs: int,
    backend: str | None = None,
    max_q_len: int | None = None,
    max_kv_len: int | None = None,
    mesh: jax.sharding.Mesh | None = None,
    native_linear: bool = False,
) -> tuple[StepOutput, KVPool, sampler.PenaltyState]:
    """Runs every layer over the batch's tokens, writing their K/V into the pool first, and
    samples one token per sequence. Decode tokens the host has not seen yet come straight
    from ``prev_sampled`` (``batch.prev_rows``), so the host never waits for a step before
    dispatching the next. ``max_q_len`` / ``max_kv_len`` are the bucket's static
    bounds, passed to the attention kernel so it reads only blocks that can be live. With a
    ``mesh`` (tensor parallelism) the attention runs per device on its heads under shard_map,
    and logits and outputs are gathered whole onto every device."""
    sm_scale = config.head_dim**-0.5
    layer_slots = num_blocks * block_size

    def attend(q, k, v, layer, k_pages, v_pages, slot_mapping, kv_lens, tables, cu_q_lens, n):
        slots = jnp.where(slot_mapping >= 0, slot_mapping + layer * layer_slots, -1)
        k_pages, v_pages = write_kv(k_pages, v_pages, k, v, slots)
        out = ragged_paged_attention(
            q,
            k_pages,
            v_pages,
            kv_lens,
            tables + layer * num_blocks,
            cu_q_lens,
            n,
            sm_scale=sm_scale,
            backend=backend,
            max_q_len=max_q_len,
            max_kv_len=max_kv_len,
        )
        return out, k_pages, v_pages

    if mesh is not None:
        attend = shard_attention(attend, mesh)

    def attention_fn(q, k, v, layer, pool):
        b = batch
        meta = (b.slot_mapping, b.kv_lens, b.block_tables, b.cu_q_lens, b.num_seqs)
        out, k_pages, v_pages = attend(q, k, v, layer, *pool, *meta)
        return out, (k_pages, v_pages)

    linear_fn, logits_fn = linear_xla, None
    if native_linear:  # padding rows cost nothing: the kernel stops at the real ones
        linear_fn = functools.partial(cpu.linear, num_rows=batch.cu_q_lens[-1])
        logits_fn = functools.partial(cpu.linear, num_rows=batch.num_seqs[0], out_dtype=jnp.float32)
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
    argmax = cpu.argmax if on_native_cpu(backend, mesh) else sampler.greedy_argmax
    out = sampler.sample(
        logits, batch.sampling, penalties, num_logprobs=num_logprobs, argmax=argmax
    )
    penalties = sampler.record_sampled(penalties, batch.sampling.penalty_rows, out.token_ids)
    num_rows = prev_sampled.shape[0]
    token_ids = jnp.zeros((num_rows,), jnp.int32).at[: out.token_ids.shape[0]].set(out.token_ids)
    out = StepOutput(token_ids, out.logprobs, out.top_logprob_ids, out.top_logprobs)
    return replicate_on(out, mesh), pool, replicate_on(penalties, mesh)


def on_native_cpu(backend: str | None, mesh: jax.sharding.Mesh | None) -> bool:
    """Whether the step runs on one CPU device with the native kernels ("cpu" backend)."""
    return (backend or default_backend()) == "cpu" and mesh is None


def use_native_linear(
    params: Params, config: ModelConfig, backend: str | None, mesh: jax.sharding.Mesh | None
) -> bool:
    """Whether the steps should run every matmul in the native CPU kernel: float32 or
    bfloat16 weights on one CPU device, the native kernels in use ("cpu" attention
    backend), and every output size a multiple of the kernel's panel width. The caller then
    packs the weights once (`pack_native_linear`)."""
    if not on_native_cpu(backend, mesh):
        return False
    if params["embed"].dtype not in cpu.LINEAR_DTYPES or not cpu.available():
        return False
    views: list[tuple[int, jnp.dtype]] = []

    def record(w):  # [L', N, K]: the views pack_native_linear would pack (shapes only)
        views.append((w.shape[-2], jnp.dtype(w.dtype)))
        return w

    jax.eval_shape(lambda p: map_matmul_weights(p, config, record), params)
    return all(n % cpu.PANEL == 0 and dtype in cpu.LINEAR_DTYPES for n, dtype in views)


def pack_native_linear(params: Params, config: ModelConfig) -> Params:
    """The params with every matmul weight in the native kernel's panel layout (one copy;
    the embedding table stays as it is for the token lookup)."""
    return map_matmul_weights(params, config, cpu.pack_panels)
