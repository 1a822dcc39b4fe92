"""Runner: owns the device state (params, KV pool, per-sequence sampler state, the last step's
sampled tokens), pads each scheduled step into a shape bucket (:mod:`jaxpaged.worker.buckets`)
and dispatches the jitted step without waiting for it.

``dispatch(plan)`` applies the plan's block swaps and copies and its sampler-state row fills,
builds the padded batch and launches the step; it returns a :class:`PendingStep` at once, while the
device works. ``collect(pending)`` waits for that step and returns what it sampled. The engine
dispatches step N+1 before it collects step N, so the device never waits for the host: a
decode whose token the host has not seen yet reads it from the previous step's output on the
device (``StepBatch.prev_rows``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxpaged.distributed.parallel import kv_pool_sharding, replicated
from jaxpaged.kernels.platform import select_backend
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.families import family_class
from jaxpaged.models.llama import Params
from jaxpaged.outputs import Logprob
from jaxpaged.sampling_params import MAX_BANNED_IDS, MAX_LOGPROBS
from jaxpaged.sched.output import RunnerOutput, ScheduledSeq, SchedulerOutput, StateRowInit
from jaxpaged.worker import sampler
from jaxpaged.worker.buckets import Bucket, BucketSet, pow2_ladder
from jaxpaged.worker.kv_cache import (
    KVLayout,
    copy_blocks,
    create_pool,
    gather_blocks,
    scatter_blocks,
)
from jaxpaged.worker.step import StaticGraph, StepBatch, StepOutput, step

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, eq=False)
class PendingStep:
    """A dispatched step: its outputs are device arrays that may not be computed yet."""

    out: StepOutput
    num_seqs: int
    logprobs_wanted: tuple[int | None, ...]  # per sequence: top-k asked for, None = none
    failed: dict[str, str]  # sequences left out of the batch: request id -> reason


class Runner:
    """Device side of the engine. Not thread-safe: the engine thread alone calls it."""

    def __init__(
        self,
        *,
        model_config: ModelConfig,
        params: Params,
        layout: KVLayout,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        seed: int = 0,
        attention_backend: str | None = None,
        mesh: jax.sharding.Mesh | None = None,
        graphdef: nnx.GraphDef | None = None,
    ) -> None:
        """``params`` is the model's state as a pytree and ``graphdef`` its NNX graph
        definition (None: the Llama family over ``model_config``)."""
        self.model_config = model_config
        # host (numpy) leaves go to the default device once, not with every step
        params = jax.tree.map(
            lambda x: x if isinstance(x, jax.Array) else jax.device_put(x), params
        )
        self.mesh = mesh  # tensor parallelism: params already on it; the pool is split on it
        # multi-host: rank 0's hook that announces each device call to the followers
        # (see jaxpaged.distributed.multihost); None on one host
        self.leader = None
        self.layout = layout
        self.max_model_len = max_model_len
        self.backend = attention_backend

        # The model class's platform hooks: which weights a native matmul may repack
        # (map_matmul_weights; without it every matmul stays XLA's) and which a step streams.
        if graphdef is None:
            model_class = family_class(model_config)
        else:
            model_class = type(nnx.merge(graphdef, params))
        mapper = getattr(model_class, "map_matmul_weights", None)

        def weight_map(p, fn):
            return p if mapper is None else mapper(p, model_config, fn)

        streamed = getattr(model_class, "streamed_weights", jax.tree.leaves)
        # the platform's part, chosen once: on CPU the native kernels over weights packed
        # into their layout and the streamed weights on 2 MiB pages; elsewhere XLA's
        self.platform = select_backend(
            params, weight_map, attention_backend=attention_backend, sharded=mesh is not None
        )
        self.kernels = self.platform.kernels
        self.params = self.platform.pack_weights(params, weight_map)
        # packing may add a leaf (the tied vocabulary projection's own packed copy)
        graph_for = getattr(model_class, "graphdef_for", None)
        self.graphdef = StaticGraph(
            graphdef if graph_for is None else graph_for(model_config, self.params)
        )
        self.huge_page_bytes = self.platform.back_with_huge_pages(streamed(self.params))
        self.buckets = BucketSet(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            block_size=layout.block_size,
        )
        self.engine_key_data = sampler.seed_to_key_data(seed)
        self.pool = create_pool(
            layout=layout, sharding=None if mesh is None else kv_pool_sharding(mesh)
        )
        # one sampler-state row per running request at most; the scheduler hands them out
        self.seq_state = self._on_mesh(
            sampler.create_seq_state(max_num_seqs, model_config.vocab_size, MAX_BANNED_IDS)
        )
        # the last step's sampled tokens (StepOutput.token_ids), read by the next step
        self.sampled = self._on_mesh(jax.numpy.zeros((max_num_seqs,), jax.numpy.int32))
        # swapped-out blocks: host slot -> (k, v), each [L, block_size, Hkv, hd]
        self._host_blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.warmed_up = False

    def _on_mesh(self, tree):
        return tree if self.mesh is None else jax.device_put(tree, replicated(self.mesh))

    # ------------------------------------------------------------------ step
    def _step_kwargs(self) -> dict[str, object]:
        return dict(
            graphdef=self.graphdef,
            num_blocks=self.layout.num_blocks,
            block_size=self.layout.block_size,
            num_logprobs=MAX_LOGPROBS,
            backend=self.backend,
            mesh=self.mesh,
            kernels=self.kernels,
        )

    def activation_bytes(self) -> int:
        """Scratch memory XLA plans for the largest step program: what the KV pool must leave
        free on the device (the "profiling step" of KV sizing, without running it)."""
        bucket = max(self.buckets.all(), key=lambda b: (b.num_tokens, b.max_blocks))
        batch, _ = self.build_batch([], bucket)
        lowered = step.lower(
            self.params, self.pool, self.seq_state, self.sampled, batch, **self._step_kwargs()
        )
        analysis = lowered.compile().memory_analysis()
        return int(getattr(analysis, "temp_size_in_bytes", 0) or 0)

    def build_batch(
        self, seqs: Sequence[ScheduledSeq], bucket: Bucket
    ) -> tuple[StepBatch, dict[int, str]]:
        """Host-side padding of one step into ``bucket`` (numpy; one transfer per array), and
        the sequences whose sampling settings could not be filled (index -> reason: they ride
        as padding rows and their requests fail; the others are unaffected)."""
        t, s, b = bucket.num_tokens, bucket.num_seqs, bucket.max_blocks
        bs = self.layout.block_size
        tokens = np.zeros(t, np.int32)
        prev_rows = np.full(t, -1, np.int32)
        positions = np.zeros(t, np.int32)
        slots = np.full(t, -1, np.int32)
        kv_lens = np.zeros(s, np.int32)
        tables = np.zeros((s, b), np.int32)
        cu = np.zeros(s + 1, np.int32)
        sample_rows = np.zeros(s, np.int32)
        row = 0
        for i, seq in enumerate(seqs):
            n = seq.num_tokens
            pos = np.arange(seq.start_pos, seq.start_pos + n, dtype=np.int32)
            table = np.asarray(seq.block_table, np.int32)
            tokens[row : row + n] = seq.token_ids
            prev_rows[row] = seq.prev_row  # only a one-token decode is ever fed this way
            positions[row : row + n] = pos
            slots[row : row + n] = table[pos // bs] * bs + pos % bs
            nb = min(len(table), b)
            tables[i, :nb] = table[:nb]
            kv_lens[i] = seq.kv_len
            row += n
            cu[i + 1] = row
            sample_rows[i] = row - 1
        cu[len(seqs) + 1 :] = row
        sampling, failed = sampler.build_sampling_tensors(
            [seq.sampling for seq in seqs],
            s,
            vocab_size=self.model_config.vocab_size,
            engine_key_data=self.engine_key_data,
        )
        batch = StepBatch(
            tokens=tokens,
            prev_rows=prev_rows,
            positions=positions,
            slot_mapping=slots,
            kv_lens=kv_lens,
            block_tables=tables,
            cu_q_lens=cu,
            num_seqs=np.array([len(seqs)], np.int32),
            sample_rows=sample_rows,
            sampling=sampling,
        )
        return batch, failed

    def _run(self, batch: StepBatch, bucket: Bucket) -> StepOutput:
        kwargs = self._step_kwargs()
        if bucket.decode_only:
            kwargs.update(max_q_len=1)
        if self.leader is not None:
            self.leader.announce_step(batch, bucket)
        out, self.pool, self.seq_state = step(
            self.params, self.pool, self.seq_state, self.sampled, batch, **kwargs
        )
        self.sampled = out.token_ids
        return out

    def dispatch(self, plan: SchedulerOutput) -> PendingStep | None:
        """Applies the plan's swaps, copies and sampler-state row fills, then launches its step
        without waiting for it (None when the plan has no sequences)."""
        self._swap_out(plan.blocks_to_swap_out)
        self._swap_in(plan.blocks_to_swap_in)
        self._copy(plan.blocks_to_copy)
        for init in plan.state_rows_to_init:
            self._init_state_row(init)
        if not plan.seqs:
            return None
        bucket = self.buckets.pick(plan.seqs)
        batch, failed_rows = self.build_batch(plan.seqs, bucket)
        out = self._run(batch, bucket)
        wanted = tuple(
            None if s.sampling is None else s.sampling.params.logprobs for s in plan.seqs
        )
        # start the device->host copies now: they run as soon as the step is done
        for x in out if any(w is not None for w in wanted) else (out.token_ids,):
            x.copy_to_host_async()
        failed = {plan.seqs[i].request_id: why for i, why in failed_rows.items()}
        return PendingStep(out=out, num_seqs=len(plan.seqs), logprobs_wanted=wanted, failed=failed)

    def collect(self, pending: PendingStep | None) -> RunnerOutput:
        """Waits for a dispatched step and returns its sampled tokens (and logprobs)."""
        if pending is None:
            return RunnerOutput(sampled_token_ids=())
        n = pending.num_seqs
        want = pending.logprobs_wanted
        if all(w is None for w in want):  # the usual case: the tokens alone
            token_ids = np.asarray(pending.out.token_ids)
            return RunnerOutput(sampled_token_ids=token_ids[:n].tolist(), failed=pending.failed)
        out = jax.device_get(pending.out)
        logprobs = [
            None
            if w is None
            else Logprob(
                token_id=int(out.token_ids[i]),
                logprob=float(out.logprobs[i]),
                top=dict(
                    zip(out.top_ids[i, :w].tolist(), out.top_logprobs[i, :w].tolist(), strict=True)
                ),
            )
            for i, w in enumerate(want)
        ]
        return RunnerOutput(
            sampled_token_ids=out.token_ids[:n].tolist(), logprobs=logprobs, failed=pending.failed
        )

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        """dispatch + collect: one step, waiting for it (callers that do not overlap)."""
        return self.collect(self.dispatch(plan))

    # ------------------------------------------------------- sampler state rows
    def state_row_arrays(self, init: StateRowInit) -> tuple[np.ndarray, ...]:
        """The int32 inputs of ``init_state_row``: row [], prompt [H], output [H] (H =
        max_model_len), min_tokens [], banned ids [MAX_BANNED_IDS], -1 padded: one shape,
        one compiled program."""
        h = self.max_model_len
        prompt = np.full(h, -1, np.int32)
        output = np.full(h, -1, np.int32)
        banned = np.full(MAX_BANNED_IDS, -1, np.int32)
        prompt[: len(init.prompt_token_ids)] = init.prompt_token_ids
        output[: len(init.output_token_ids)] = init.output_token_ids
        banned[: len(init.banned_ids)] = init.banned_ids  # admission bounds its length
        row, min_tokens = np.array(init.row, np.int32), np.array(init.min_tokens, np.int32)
        return row, prompt, output, min_tokens, banned

    def _init_state_row(self, init: StateRowInit) -> None:
        arrays = self.state_row_arrays(init)
        if self.leader is not None:
            self.leader.announce_state_row(arrays)
        self.fill_state_row(arrays)

    def fill_state_row(self, arrays: tuple[np.ndarray, ...]) -> None:
        """The device call of a state-row fill (followers of a multi-host run too);
        ``arrays`` as :meth:`state_row_arrays` makes them."""
        self.seq_state = sampler.init_state_row(self.seq_state, *arrays)

    # ------------------------------------------------------------ block moves
    def _padded(self, ids: Sequence[int]) -> np.ndarray:
        n = 1 << max(0, (len(ids) - 1).bit_length())
        out = np.full(n, -1, np.int32)
        out[: len(ids)] = ids
        return out

    @property
    def _max_move(self) -> int:
        """Blocks moved per call: one sequence's worth, so a handful of sizes covers all."""
        return 1 << (self.buckets.full_blocks - 1).bit_length()

    def _in_chunks(self, move, pairs: Sequence[tuple[int, int]]) -> None:
        """Applies a block move ``_max_move`` pairs at a time (a few compiled sizes)."""
        m = self._max_move
        for i in range(0, len(pairs), m):
            move(pairs[i : i + m])

    def _copy(self, pairs: Sequence[tuple[int, int]]) -> None:
        self._in_chunks(self._copy_chunk, pairs)

    def _swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        self._in_chunks(self._swap_out_chunk, pairs)

    def _swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        self._in_chunks(self._swap_in_chunk, pairs)

    def _copy_chunk(self, pairs: Sequence[tuple[int, int]]) -> None:
        src, dst = zip(*pairs, strict=True)
        src, dst = self._padded(src), self._padded(dst)
        if self.leader is not None:
            self.leader.announce_copy(src, dst)
        self.apply_copy(src, dst)

    def apply_copy(
        self,
        src: np.ndarray,  # int32 [N] source block ids, -1 = padding
        dst: np.ndarray,  # int32 [N] destination block ids
    ) -> None:
        """The device call of a block copy (followers of a multi-host run too)."""
        self.pool = copy_blocks(
            self.pool,
            src,
            dst,
            num_layers=self.layout.num_layers,
            num_blocks=self.layout.num_blocks,
        )

    def _swap_out_chunk(self, pairs: Sequence[tuple[int, int]]) -> None:
        # waits for the steps already dispatched: the blocks hold what they wrote
        dev, host = zip(*pairs, strict=True)
        k, v = jax.device_get(
            gather_blocks(
                self.pool,
                self._padded(dev),
                num_layers=self.layout.num_layers,
                num_blocks=self.layout.num_blocks,
            )
        )
        for i, slot in enumerate(host):
            self._host_blocks[slot] = (k[:, i].copy(), v[:, i].copy())

    def _swap_in_chunk(self, pairs: Sequence[tuple[int, int]]) -> None:
        host, dev = zip(*pairs, strict=True)
        ids = self._padded(dev)
        shape = (self.layout.num_layers, len(ids), *self.layout.shape[1:])
        k = np.zeros(shape, self.pool[0].dtype)
        v = np.zeros(shape, self.pool[1].dtype)
        for i, slot in enumerate(host):
            k[:, i], v[:, i] = self._host_blocks.pop(slot)
        self.pool = scatter_blocks(
            self.pool,
            ids,
            (k, v),
            num_layers=self.layout.num_layers,
            num_blocks=self.layout.num_blocks,
        )

    @property
    def num_host_blocks_in_use(self) -> int:
        return len(self._host_blocks)

    # ---------------------------------------------------------------- warm-up
    def warm_up(self, *, swap: bool = False, show_progress: bool = True) -> tuple[int, float]:
        """Compiles every step bucket, the sampler-state row fill and the block-move sizes now, so
        serving never compiles. Returns (programs, seconds)."""
        start = time.perf_counter()
        buckets = self.buckets.all()
        moves = pow2_ladder(1, self._max_move)
        total = len(buckets) + 1 + len(moves) * (3 if swap else 1)
        bar = tqdm(total=total, desc="warm-up (compiling)", disable=not show_progress, unit="prog")
        for bucket in buckets:
            batch, _ = self.build_batch([], bucket)
            jax.block_until_ready(self._run(batch, bucket))
            bar.update()
        # row 0 is free while nothing runs: filling it with nothing leaves it as it was
        self._init_state_row(StateRowInit(row=0, prompt_token_ids=(), output_token_ids=()))
        bar.update()
        for n in moves:
            none = np.full(n, -1, np.int32)
            dims = dict(num_layers=self.layout.num_layers, num_blocks=self.layout.num_blocks)
            self.pool = copy_blocks(self.pool, none, none, **dims)
            bar.update()
            if swap:
                k, v = jax.device_get(gather_blocks(self.pool, none, **dims))
                bar.update()
                self.pool = scatter_blocks(self.pool, none, (k, v), **dims)
                bar.update()
        jax.block_until_ready((self.pool, self.seq_state))
        bar.close()
        self.warmed_up = True
        return total, time.perf_counter() - start
