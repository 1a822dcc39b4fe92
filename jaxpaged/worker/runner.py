"""Runner: owns the params and the KV pool on the device, pads each scheduled step into a shape
bucket, runs the jitted step, and applies the scheduler's block copies and swaps.

Buckets. XLA compiles one program per input shape, so every step is padded to one of a few
shapes, all compiled at start-up (warm-up) unless ``enforce_eager``:

* decode steps (every sequence feeds one token): S sequences in powers of two from 1 up to
  ``max_num_seqs``, compiled with ``max_q_len=1`` so attention skips its prefill path;
* mixed steps (prefill chunks, with or without decodes): T tokens in powers of two from 16 up
  to ``max_num_batched_tokens``, with S = min(T, max_num_seqs).

Block tables are always full width (``max_model_len / block_size``): the attention kernels
stop at the last KV chunk any sequence can see, so context length needs no bucket of its own
and the program count stays at a handful (log2 of the two limits).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from collections.abc import Sequence

import jax
import numpy as np
from tqdm.auto import tqdm

from jaxpaged.distributed.parallel import kv_pool_sharding
from jaxpaged.kernels.cpu.huge_pages import back_with_huge_pages
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.llama import Params, streamed_weights
from jaxpaged.sched.scheduler import RunnerOutput, ScheduledSeq, SchedulerOutput
from jaxpaged.worker import sampler
from jaxpaged.worker.kv_cache import (
    KVLayout,
    copy_blocks,
    create_pool,
    gather_blocks,
    scatter_blocks,
)
from jaxpaged.worker.step import StepBatch, StepOutput, pack_native_linear, step, use_native_linear

logger = logging.getLogger(__name__)

MAX_LOGPROBS = 20
MAX_BANNED_IDS = 16


def _pow2_ladder(lo: int, hi: int) -> tuple[int, ...]:
    """Powers of two from lo while below hi, then hi itself."""
    out = []
    x = lo
    while x < hi:
        out.append(x)
        x *= 2
    out.append(hi)
    return tuple(out)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True, order=True)
class Bucket:
    """A compiled step shape: T token rows, S sequences, B block-table columns."""

    num_tokens: int
    num_seqs: int
    max_blocks: int
    decode_only: bool


@dataclasses.dataclass(frozen=True, kw_only=True)
class BucketSet:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int

    @property
    def decode_seqs(self) -> tuple[int, ...]:
        # down to 1: XLA:CPU's dots cost ~3x more at 8 rows than at 1 (bench/RESULTS.md)
        return _pow2_ladder(1, self.max_num_seqs)

    @property
    def mixed_tokens(self) -> tuple[int, ...]:
        return _pow2_ladder(min(16, self.max_num_batched_tokens), self.max_num_batched_tokens)

    @property
    def full_blocks(self) -> int:
        return _cdiv(self.max_model_len, self.block_size)

    def all(self) -> list[Bucket]:
        out = [Bucket(s, s, self.full_blocks, True) for s in self.decode_seqs]
        out += [
            Bucket(t, min(t, self.max_num_seqs), self.full_blocks, False) for t in self.mixed_tokens
        ]
        return out

    def pick(self, seqs: Sequence[ScheduledSeq]) -> Bucket:
        n = len(seqs)
        num_tokens = sum(s.num_tokens for s in seqs)
        if all(s.num_tokens == 1 for s in seqs) and n <= self.max_num_seqs:
            s = self.decode_seqs[bisect.bisect_left(self.decode_seqs, n)]
            return Bucket(s, s, self.full_blocks, True)
        i = bisect.bisect_left(self.mixed_tokens, num_tokens)
        if i == len(self.mixed_tokens):
            raise ValueError(
                f"step of {num_tokens} tokens exceeds max_num_batched_tokens="
                f"{self.max_num_batched_tokens}"
            )
        # more sequences than tokens can't happen: each sequence feeds >= 1 token
        t = self.mixed_tokens[i]
        while min(t, self.max_num_seqs) < n:
            i += 1
            t = self.mixed_tokens[i]
        return Bucket(t, min(t, self.max_num_seqs), self.full_blocks, False)


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
    ) -> None:
        self.model_config = model_config
        self.mesh = mesh  # tensor parallelism: params already on it; the pool is split on it
        # multi-host: rank 0's hook that announces each device call to the followers
        # (see jaxpaged.distributed.multihost); None on one host
        self.leader = None
        self.layout = layout
        self.max_model_len = max_model_len
        self.backend = attention_backend
        # every matmul in the native CPU kernel, over weights packed once into its layout
        self.native_linear = use_native_linear(params, model_config, attention_backend, mesh)
        self.params = pack_native_linear(params, model_config) if self.native_linear else params
        # host-resident weights on 2 MiB pages: a step streams them all (jaxpaged.kernels.cpu.huge_pages)
        self.huge_page_bytes = back_with_huge_pages(streamed_weights(self.params))
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
        # swapped-out blocks: host slot -> (k, v), each [L, block_size, Hkv, hd]
        self._host_blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.warmed_up = False

    # ------------------------------------------------------------------ step
    def _step_kwargs(self) -> dict[str, object]:
        return dict(
            config=self.model_config,
            num_blocks=self.layout.num_blocks,
            block_size=self.layout.block_size,
            num_logprobs=MAX_LOGPROBS,
            backend=self.backend,
            mesh=self.mesh,
            native_linear=self.native_linear,
        )

    def activation_bytes(self) -> int:
        """Scratch memory XLA plans for the largest step program: what the KV pool must leave
        free on the device (the "profiling step" of KV sizing, without running it)."""
        bucket = max(self.buckets.all(), key=lambda b: (b.num_tokens, b.max_blocks))
        batch = self.build_batch([], bucket)
        lowered = step.lower(self.params, self.pool, batch, **self._step_kwargs())
        analysis = lowered.compile().memory_analysis()
        return int(getattr(analysis, "temp_size_in_bytes", 0) or 0)

    def build_batch(
        self, seqs: Sequence[ScheduledSeq], bucket: Bucket, eos_token_ids: Sequence[int] = ()
    ) -> StepBatch:
        """Host-side padding of one step into ``bucket`` (numpy; one transfer per array)."""
        t, s, b = bucket.num_tokens, bucket.num_seqs, bucket.max_blocks
        bs = self.layout.block_size
        tokens = np.zeros(t, np.int32)
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
            positions[row : row + n] = pos
            slots[row : row + n] = table[pos // bs] * bs + pos % bs
            nb = min(len(table), b)
            tables[i, :nb] = table[:nb]
            kv_lens[i] = seq.kv_len
            row += n
            cu[i + 1] = row
            sample_rows[i] = row - 1
        cu[len(seqs) + 1 :] = row
        sampling = sampler.build_sampling_tensors(
            [seq.request for seq in seqs],
            s,
            vocab_size=self.model_config.vocab_size,
            engine_key_data=self.engine_key_data,
            history_len=self.max_model_len,
            eos_token_ids=eos_token_ids,
            max_banned=MAX_BANNED_IDS,
        )
        return StepBatch(
            tokens=tokens,
            positions=positions,
            slot_mapping=slots,
            kv_lens=kv_lens,
            block_tables=tables,
            cu_q_lens=cu,
            num_seqs=np.array([len(seqs)], np.int32),
            sample_rows=sample_rows,
            sampling=sampling,
        )

    def _run(self, batch: StepBatch, bucket: Bucket) -> StepOutput:
        kwargs = self._step_kwargs()
        if bucket.decode_only:
            kwargs.update(max_q_len=1)
        if self.leader is not None:
            self.leader.announce_step(batch, bucket)
        out, self.pool = step(self.params, self.pool, batch, **kwargs)
        return out

    def execute(self, plan: SchedulerOutput, eos_token_ids: Sequence[int] = ()) -> RunnerOutput:
        """Applies the plan's swaps and copies, then runs its sequences (one device->host
        copy of the sampled tokens)."""
        self._swap_out(plan.blocks_to_swap_out)
        self._swap_in(plan.blocks_to_swap_in)
        self._copy(plan.blocks_to_copy)
        if not plan.seqs:
            return RunnerOutput(sampled_token_ids=())
        bucket = self.buckets.pick(plan.seqs)
        batch = self.build_batch(plan.seqs, bucket, eos_token_ids)
        out = self._run(batch, bucket)
        n = len(plan.seqs)
        want = [seq.request.sampling_params.logprobs for seq in plan.seqs]
        logprobs = None
        if all(w is None for w in want):  # the usual case: copy back the tokens alone
            token_ids = np.asarray(out.token_ids)
        else:
            out = jax.device_get(out)
            token_ids = out.token_ids
            logprobs = [
                None
                if w is None
                else (
                    float(out.logprobs[i]),
                    dict(
                        zip(
                            out.top_ids[i, :w].tolist(),
                            out.top_logprobs[i, :w].tolist(),
                            strict=True,
                        )
                    ),
                )
                for i, w in enumerate(want)
            ]
        return RunnerOutput(sampled_token_ids=token_ids[:n].tolist(), logprobs=logprobs)

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
        self.pool = copy_blocks(
            self.pool,
            src,
            dst,
            num_layers=self.layout.num_layers,
            num_blocks=self.layout.num_blocks,
        )

    def _swap_out_chunk(self, pairs: Sequence[tuple[int, int]]) -> None:
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
        """Compiles every step bucket (and block-move sizes) now, so serving never compiles.
        Returns (programs, seconds)."""
        start = time.perf_counter()
        buckets = self.buckets.all()
        moves = _pow2_ladder(1, self._max_move)
        total = len(buckets) + len(moves) * (3 if swap else 1)
        bar = tqdm(total=total, desc="warm-up (compiling)", disable=not show_progress, unit="prog")
        for bucket in buckets:
            batch = self.build_batch([], bucket)
            jax.block_until_ready(self._run(batch, bucket))
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
        jax.block_until_ready(self.pool)
        bar.close()
        self.warmed_up = True
        return total, time.perf_counter() - start
