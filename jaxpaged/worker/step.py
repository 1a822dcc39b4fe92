"""The jitted engine step: model forward over the paged KV pool, logits of each sequence's last
token, on-device sampling. Pure function of (model state, pool, per-sequence sampler state,
previous step's sampled tokens, batch); the model's NNX graph definition is static, the pool
and the sampler state are donated."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpaged.distributed.parallel import replicate_on, shard_attention
from jaxpaged.kernels import ragged_paged_attention, write_kv
from jaxpaged.kernels.step_kernels import XLA_KERNELS, StepKernels
from jaxpaged.models.llama import Params
from jaxpaged.worker import sampler
from jaxpaged.worker.kv_cache import KVPool


class StaticGraph:
    """A model's NNX graph definition as the step's static argument, its hash computed once:
    jit hashes static arguments on every call, and a GraphDef's hash walks its whole tree
    (~0.1 ms per step measured here, against ~10 us for a frozen config)."""

    def __init__(self, graphdef: nnx.GraphDef) -> None:
        self.graphdef = graphdef
        self._hash = hash(graphdef)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, StaticGraph) and self.graphdef == other.graphdef)


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
        "graphdef",
        "num_blocks",
        "block_size",
        "num_logprobs",
        "backend",
        "max_q_len",
        "max_kv_len",
        "mesh",
        "kernels",
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
    graphdef: StaticGraph,
    num_blocks: int,
    block_size: int,
    num_logprobs: int,
    backend: str | None = None,
    max_q_len: int | None = None,
    max_kv_len: int | None = None,
    mesh: jax.sharding.Mesh | None = None,
    kernels: StepKernels = XLA_KERNELS,
) -> tuple[StepOutput, KVPool, sampler.SeqState]:
    """Runs the model (``nnx.merge(graphdef.graphdef, params)``: a module of the paged-model protocol,
    docs/models.md) over the batch's tokens, writing their K/V into the pool first, and
    samples one token per sequence. Decode tokens the host has not seen yet come straight
    from ``prev_sampled`` (``batch.prev_rows``), so the host never waits for a step before
    dispatching the next. ``max_q_len`` / ``max_kv_len`` are the bucket's static
    bounds, passed to the attention kernel so it reads only blocks that can be live. With a
    ``mesh`` (tensor parallelism) the attention runs per device on its heads under shard_map,
    and logits and outputs are gathered whole onto every device."""
    model = nnx.merge(graphdef.graphdef, params)
    default_scale = model.config.head_dim**-0.5
    layer_slots = num_blocks * block_size

    def paged(q, k, v, layer, k_pages, v_pages, slot_mapping, kv_lens, tables, cu_q_lens, n, *,
              sm_scale, sliding_window, soft_cap):  # fmt: skip
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
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            backend=backend,
            max_q_len=max_q_len,
            max_kv_len=max_kv_len,
        )
        return out, k_pages, v_pages

    def attention_fn(q, k, v, layer, pool, *, sm_scale=None, sliding_window=None, soft_cap=None):
        attend = functools.partial(
            paged,
            sm_scale=default_scale if sm_scale is None else sm_scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
        )
        if mesh is not None:
            attend = shard_attention(attend, mesh)
        b = batch
        meta = (b.slot_mapping, b.kv_lens, b.block_tables, b.cu_q_lens, b.num_seqs)
        out, k_pages, v_pages = attend(q, k, v, layer, *pool, *meta)
        return out, (k_pages, v_pages)

    # The platform's matmul (a model the backend packed weights for takes it); none on
    # platforms that leave the matmuls to XLA's dots
    linear_fn = kernels.linear_fn(batch.cu_q_lens[-1])
    logits_fn = kernels.logits_fn(batch.num_seqs[0])
    model_kw = {} if linear_fn is None else {"linear_fn": linear_fn}
    logits_kw = {} if logits_fn is None else {"linear_fn": logits_fn}
    prev = prev_sampled[jnp.maximum(batch.prev_rows, 0)]  # [T]
    tokens = jnp.where(batch.prev_rows >= 0, prev, batch.tokens)
    hidden, pool = model(tokens, batch.positions, attention_fn, pool, **model_kw)
    rows = hidden[batch.sample_rows]  # [S, D]
    # XLA's own logits dot keeps float32 accumulation for bf16 params (preferred_element_type)
    logits = model.compute_logits(rows, **logits_kw).astype(jnp.float32)  # [S, V]
    logits = replicate_on(logits, mesh)
    out = sampler.sample(
        logits, batch.sampling, seq_state, num_logprobs=num_logprobs, argmax=kernels.argmax
    )
    seq_state = sampler.record_sampled(seq_state, batch.sampling.state_rows, out.token_ids)
    num_rows = prev_sampled.shape[0]
    token_ids = jnp.zeros((num_rows,), jnp.int32).at[: out.token_ids.shape[0]].set(out.token_ids)
    out = StepOutput(token_ids, out.logprobs, out.top_logprob_ids, out.top_logprobs)
    return replicate_on(out, mesh), pool, replicate_on(seq_state, mesh)
