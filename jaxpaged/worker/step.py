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
from jaxpaged.kernels import BACKENDS
from jaxpaged.kernels.pool_format import SPLIT, PoolFormat
from jaxpaged.kernels.step_kernels import XLA_KERNELS, StepKernels
from jaxpaged.models.eagle3 import Eagle3Config
from jaxpaged.models.llama import Params
from jaxpaged.models.lora import LoraInputs
from jaxpaged.worker import sampler, spec_eagle, spec_verify
from jaxpaged.worker.engine_jit import engine_jit
from jaxpaged.worker.kv_cache import KVPool
from jaxpaged.worker.logits_processors import LogitsProcessor


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

    def program_key(self) -> str:
        """The graph definition's text (its node types, their static attributes, the model's
        config): what keys the step's programs on disk (jaxpaged.worker.program_key)."""
        return repr(self.graphdef)


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
    # int32 [T]; the prompt token that follows the row, for rows whose prompt logprob is
    # wanted (SamplingParams.prompt_logprobs), -1 = none
    prompt_targets: jax.Array
    lora_slots: jax.Array | None = None  # int32 [T]; each row's LoRA slot, 0 = none (LoRA on)
    # speculative decoding on (K drafts at most per sequence): the rows sampled to verify
    # each sequence's drafts, and how many it feeds (jaxpaged.worker.spec_verify)
    verify_rows: jax.Array | None = None  # int32 [S, K + 1]
    num_drafts: jax.Array | None = None  # int32 [S]; 0 = no drafts
    # EAGLE-3 on: each sequence's row of the persistent batch (its EagleState row)
    seq_rows: jax.Array | None = None  # int32 [S]; padding R
    # the known token after each sequence's fed ones (ScheduledSeq.next_token), -1: sampled
    next_tokens: jax.Array | None = None  # int32 [S]
    # 1: the sequence's draft rows hold drafts the host gave (a grammar request's, read back
    # for its masks: jaxpaged.worker.spec_grammar); the step drafts none of its own there
    host_drafts: jax.Array | None = None  # int32 [S]
    # a vision-language model: each row's image features in the encoder cache (flat index
    # slot * I + j, jaxpaged.worker.images), -1 = a text token
    image_rows: jax.Array | None = None  # int32 [T]
    # M-RoPE (models/qwen2_vl.py): each row's (temporal, height, width) positions
    mrope_positions: jax.Array | None = None  # int32 [3, T]
    # the last key position each row sees (an image's tokens: their image's last; else the
    # row's own position), when the model attends over an image both ways (worker/images.py)
    causal_limits: jax.Array | None = None  # int32 [T]


class StepOutput(NamedTuple):
    """With speculative decoding (``StepBatch.verify_rows``) the logprob fields have S * (D +
    1) rows (row ``i * (D + 1) + j``: sequence i's position j; D = drafts at most) and
    ``token_ids`` holds each sequence's first token."""

    token_ids: jax.Array  # int32 [R]; row i < S: sequence i's token; R = the runner's max rows
    logprobs: jax.Array  # float32 [S]; log-probability of the sampled token
    top_ids: jax.Array  # int32 [S, K]
    top_logprobs: jax.Array  # float32 [S, K]
    prompt_logprobs: jax.Array  # float32 [T]; log-probability of the row's prompt target
    prompt_top_ids: jax.Array  # int32 [T, K]
    prompt_top_logprobs: jax.Array  # float32 [T, K]
    spec_token_ids: jax.Array | None = None  # int32 [S, D + 1] the target's samples
    num_emitted: jax.Array | None = None  # int32 [S] of those, the tokens each emits
    spec_draft_ids: jax.Array | None = None  # int32 [S, D] the drafts verified (fed)
    # float32 [S, D]: each sequence's final hidden state at its last fed row (a pooling
    # request's embedding at its final prefill chunk); read back only when one is pooled
    pooled: jax.Array | None = None


_PROMPT_CHUNK = 64  # rows of [rows, V] logits at a time when prompt logprobs are wanted


def token_seq_lens(batch: StepBatch) -> jax.Array:  # int32 [T]
    """Each token's sequence length once this step has run (its sequence's ``kv_lens``; a
    padding row gets some sequence's, never read), for dynamic RoPE: sequence i owns rows
    ``cu_q_lens[i]`` to ``cu_q_lens[i + 1] - 1``."""
    rows = jnp.arange(batch.tokens.shape[0], dtype=batch.cu_q_lens.dtype)
    seq = jnp.searchsorted(batch.cu_q_lens[1:], rows, side="right")
    return batch.kv_lens[jnp.minimum(seq, batch.kv_lens.shape[0] - 1)]


def prompt_logprobs(
    model: nnx.Module,  # of the paged-model protocol (docs/models.md)
    hidden: jax.Array,  # [T, D] every fed row's final hidden state
    targets: jax.Array,  # int32 [T] the token whose logprob each row gives, -1 = none
    *,
    num_logprobs: int,
    kernels: StepKernels = XLA_KERNELS,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # [T], [T, K] int32, [T, K]
    """Raw log-probabilities of each row's next prompt token and the top K, computed only
    when some row wants them and then in chunks of rows, so no [T, V] array is ever live."""
    t = hidden.shape[0]
    k = num_logprobs
    chunk = min(t, _PROMPT_CHUNK)
    pad = -t % chunk
    logits_fn = kernels.logits_fn(chunk)  # the params may be in a kernel's own layout
    logits_kw = {} if logits_fn is None else {"linear_fn": logits_fn}

    def one(args):
        h, tgt = args  # [C, D], [C]
        logits = model.compute_logits(h, **logits_kw).astype(jnp.float32)  # [C, V]
        lse = jax.nn.logsumexp(logits, axis=-1)  # [C]
        own = jnp.take_along_axis(logits, jnp.maximum(tgt, 0)[:, None], axis=-1)[:, 0] - lse
        if k == 0:
            return own, jnp.zeros((chunk, 0), jnp.int32), jnp.zeros((chunk, 0), jnp.float32)
        vals, ids = jax.lax.top_k(logits, k)
        return own, ids.astype(jnp.int32), vals - lse[:, None]

    def run(_):
        h = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(-1, chunk, hidden.shape[1])
        tgt = jnp.pad(targets, (0, pad), constant_values=-1).reshape(-1, chunk)
        own, ids, top = jax.lax.map(one, (h, tgt))
        return own.reshape(-1)[:t], ids.reshape(-1, k)[:t], top.reshape(-1, k)[:t]

    def none(_):
        return (
            jnp.zeros((t,), jnp.float32),
            jnp.zeros((t, k), jnp.int32),
            jnp.zeros((t, k), jnp.float32),
        )

    return jax.lax.cond(jnp.any(targets >= 0), run, none, None)


@functools.partial(
    engine_jit,
    static_argnames=(
        "graphdef",
        "num_blocks",
        "block_size",
        "pool_format",
        "num_logprobs",
        "backend",
        "interpret",
        "max_q_len",
        "max_kv_len",
        "mesh",
        "kernels",
        "logits_processors",
        "eagle_config",
        "propose_only",
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
    backend: str,
    pool_format: PoolFormat = SPLIT,
    interpret: bool = False,
    max_q_len: int | None = None,
    max_kv_len: int | None = None,
    mesh: jax.sharding.Mesh | None = None,
    kernels: StepKernels = XLA_KERNELS,
    logits_processors: tuple[LogitsProcessor, ...] = (),
    lora_weights: dict[str, tuple[jax.Array, jax.Array]] | None = None,
    eagle_config: Eagle3Config | None = None,
    eagle_params: dict[str, jax.Array] | None = None,
    eagle_state: spec_eagle.EagleState | None = None,
    image_cache: jax.Array | None = None,  # [C, I, D] encoded images (jaxpaged.worker.images)
    propose_only: bool = False,
) -> tuple[StepOutput, KVPool, sampler.SeqState, spec_eagle.EagleState | None]:
    """Runs the model (``nnx.merge(graphdef.graphdef, params)``: a module of the paged-model protocol,
    docs/models.md) over the batch's tokens, writing their K/V into the pool first, and
    samples one token per sequence. Decode tokens the host has not seen yet come straight
    from ``prev_sampled`` (``batch.prev_rows``), so the host never waits for a step before
    dispatching the next. ``max_q_len`` / ``max_kv_len`` are the bucket's static
    bounds, passed to the attention kernel so it reads only blocks that can be live. With a
    ``mesh`` (tensor parallelism) the attention runs per device on its heads under shard_map,
    and logits and outputs are gathered whole onto every device. ``lora_weights`` (LoRA on:
    site -> A [L, S, r', in], B [L, S, out, r'], see jaxpaged.models.lora) add each row's
    adapter (``batch.lora_slots``) to the projections it targets. ``backend`` and
    ``interpret``: the attention kernel as the engine's Platform chose it (a name, never None:
    the step never leaves the choice to trace time). ``eagle_config`` / ``eagle_params`` /
    ``eagle_state``: an EAGLE-3 head drafting in the step (jaxpaged.worker.spec_eagle), its
    K/V the pool's layer after the model's; its new state is returned fourth (else None).
    ``image_cache`` [C, I, D]: the encoded images ``batch.image_rows`` index, whose features
    replace those rows' embeddings. ``propose_only`` (EAGLE-3, a batch with verification
    rows): stop after the head's passes and return its drafts (int32 [S, K]) in the
    StepOutput's place, for grammar requests' masks (jaxpaged.worker.spec_grammar)."""
    if backend not in BACKENDS:
        raise ValueError(
            f"step: backend must be a resolved attention backend of {BACKENDS} (the engine's "
            f"Platform.attention_backend), got {backend!r}"
        )
    model = nnx.merge(graphdef.graphdef, params)
    default_scale = model.config.head_dim**-0.5
    layer_slots = num_blocks * block_size

    def paged(q, k, v, layer, pool, slot_mapping, kv_lens, tables, cu_q_lens, n, *slopes,
              sm_scale, sliding_window, soft_cap, q_len_bound, causal_limits=None):  # fmt: skip
        # slopes: () or (float32 [Hq] ALiBi slopes,), head-sliced like q under shard_map
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
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            backend=backend,
            interpret=interpret,
            max_q_len=q_len_bound,
            max_kv_len=max_kv_len,
            **({"alibi_slopes": slopes[0]} if slopes else {}),
            **({} if causal_limits is None else {"causal_limits": causal_limits}),
        )
        return out, pool

    def attention_for(slot_mapping, kv_lens, cu_q_lens, q_len_bound, causal_limits=None):
        """The AttentionFn of rows with this metadata over the step's block tables."""

        def attention_fn(q, k, v, layer, pool, *, sm_scale=None, sliding_window=None,
                         soft_cap=None, alibi_slopes=None):  # fmt: skip
            attend = functools.partial(
                paged,
                sm_scale=default_scale if sm_scale is None else sm_scale,
                sliding_window=sliding_window,
                soft_cap=soft_cap,
                q_len_bound=q_len_bound,
                causal_limits=causal_limits,
            )
            slopes = () if alibi_slopes is None else (jnp.asarray(alibi_slopes, jnp.float32),)
            if mesh is not None:
                if causal_limits is not None:
                    raise ValueError("causal_limits are not supported with tensor parallelism")
                attend = shard_attention(attend, mesh, alibi=bool(slopes))
            meta = (slot_mapping, kv_lens, batch.block_tables, cu_q_lens, batch.num_seqs)
            return attend(q, k, v, layer, tuple(pool), *meta, *slopes)

        return attention_fn

    attention_fn = attention_for(
        batch.slot_mapping, batch.kv_lens, batch.cu_q_lens, max_q_len, batch.causal_limits
    )

    # The platform's matmul (a model the backend packed weights for takes it); none on
    # platforms that leave the matmuls to XLA's dots
    model_kw = kernels.model_kwargs(batch.cu_q_lens[-1])
    scaling = getattr(model.config, "rope_scaling", None)
    if scaling is not None and scaling.rope_type == "dynamic":
        model_kw["rope_lengths"] = token_seq_lens(batch)
    logits_fn = kernels.logits_fn(batch.num_seqs[0])
    if lora_weights is not None:
        slots = batch.lora_slots
        model_kw["lora"] = LoraInputs(lora_weights, slots, jnp.any(slots > 0))
    logits_kw = {} if logits_fn is None else {"linear_fn": logits_fn}
    if batch.image_rows is not None:
        flat = image_cache.reshape(-1, image_cache.shape[-1])  # [C * I, D]
        rows = batch.image_rows
        model_kw["image_embeds"] = (flat[jnp.maximum(rows, 0)], rows >= 0)
    if batch.mrope_positions is not None:
        model_kw["mrope_positions"] = batch.mrope_positions
    prev = prev_sampled[jnp.maximum(batch.prev_rows, 0)]  # [T]
    tokens = jnp.where(batch.prev_rows >= 0, prev, batch.tokens)
    speculative = batch.verify_rows is not None
    eagle = eagle_config is not None
    head_layer = model.config.num_layers  # the head's K/V: the pool's layer after the model's
    if eagle:
        model_kw["aux_layers"] = eagle_config.aux_layers(model.config.num_layers)
        target_embed = model.embed.get_value()
    if propose_only and not (eagle and speculative):
        raise ValueError("step: propose_only needs an EAGLE-3 head and verification rows")
    if eagle and speculative:  # the drafts, into the draft rows' placeholder tokens
        drafts, pool = spec_eagle.propose(
            eagle_params, eagle_config, eagle_state, target_embed, pool,
            seq_rows=batch.seq_rows, cu_q_lens=batch.cu_q_lens, positions=batch.positions,
            slot_mapping=batch.slot_mapping, num_drafts=batch.num_drafts,
            num_speculative_tokens=batch.verify_rows.shape[1] - 1, layer_index=head_layer,
            attention_for=attention_for,
        )  # fmt: skip
        if propose_only:
            return replicate_on(drafts, mesh), pool, seq_state, eagle_state
        k = drafts.shape[1]
        draft_rows = batch.verify_rows[:, 1:]  # [S, K]
        own = batch.host_drafts[:, None] == 0  # given drafts stay (the grammar walked them)
        fed = (jnp.arange(k)[None, :] < batch.num_drafts[:, None]) & own
        at = jnp.where(fed, draft_rows, tokens.shape[0])
        tokens = tokens.at[at.reshape(-1)].set(drafts.reshape(-1), mode="drop")
    hidden, pool, *aux = model(tokens, batch.positions, attention_fn, pool, **model_kw)
    sampling, sample_rows = batch.sampling, batch.sample_rows
    if speculative:  # every verification row of every sequence samples
        num_seqs, k1 = batch.verify_rows.shape
        sample_rows = batch.verify_rows.reshape(-1)  # [S * (D + 1)]
        sampling = spec_verify.expand_sampling(sampling, k1)
        logits_fn = kernels.logits_fn(batch.num_seqs[0] * k1)
        logits_kw = {} if logits_fn is None else {"linear_fn": logits_fn}
    rows = hidden[sample_rows]  # [S, D]
    pooled = hidden[batch.sample_rows].astype(jnp.float32)  # [S, D]
    # XLA's own logits dot keeps float32 accumulation for bf16 params (preferred_element_type)
    logits = model.compute_logits(rows, **logits_kw).astype(jnp.float32)  # [S, V]
    logits = replicate_on(logits, mesh)
    out = sampler.sample(
        logits,
        sampling,
        seq_state,
        num_logprobs=num_logprobs,
        argmax=kernels.argmax,
        logits_processors=logits_processors,
    )
    first, spec = out.token_ids, ()
    last_rows, next_tokens = batch.sample_rows, out.token_ids  # the last accepted row
    if speculative:
        targets = out.token_ids.reshape(num_seqs, k1)  # [S, D + 1]
        drafts = tokens[batch.verify_rows[:, 1:]]  # [S, D]
        first = targets[:, 0]
        emitted = spec_verify.num_emitted(drafts, targets, batch.num_drafts)
        spec = (targets, emitted, drafts)
        last = (emitted - 1)[:, None]
        last_rows = jnp.take_along_axis(batch.verify_rows, last, axis=1)[:, 0]
        next_tokens = jnp.take_along_axis(targets, last, axis=1)[:, 0]
    if eagle:
        next_tokens = jnp.where(batch.next_tokens >= 0, batch.next_tokens, next_tokens)
        eagle_state, pool = spec_eagle.catch_up(
            eagle_params, eagle_config, eagle_state, target_embed, pool,
            aux=aux[0], tokens=tokens, positions=batch.positions, seq_rows=batch.seq_rows,
            last_rows=last_rows, next_tokens=next_tokens, num_seqs=batch.num_seqs[0],
            layer_index=head_layer, attention_fn=attention_fn,
        )  # fmt: skip
    seq_state = sampler.record_sampled(seq_state, batch.sampling.state_rows, first)
    num_rows = prev_sampled.shape[0]
    token_ids = jnp.zeros((num_rows,), jnp.int32).at[: first.shape[0]].set(first)
    prompt = prompt_logprobs(
        model,
        hidden,
        batch.prompt_targets,
        num_logprobs=num_logprobs,
        kernels=kernels,
    )
    out = StepOutput(token_ids, out.logprobs, out.top_logprob_ids, out.top_logprobs, *prompt, *spec)
    out = out._replace(pooled=pooled)
    return replicate_on(out, mesh), pool, replicate_on(seq_state, mesh), eagle_state
