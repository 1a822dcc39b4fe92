"""Several hosts, one model: ``jax.distributed`` plus a leader/follower step loop.

Control flow (N processes, one per host, each owning its local accelerators):

1. Every process calls :func:`initialize` with the same ``num_processes`` and
   ``coordinator_address`` and its own ``process_id``; after it, ``jax.devices()`` lists the
   devices of all hosts and ``jaxpaged.distributed.parallel.make_mesh(tp)`` builds one global
   mesh (tp = total devices, e.g. 2 hosts x 8 GPUs -> ``-tp 16``).
2. Every process builds the same ``LLMEngine`` with the same arguments: it loads its shards
   of the weights (Orbax folders read only those slices), creates its part of the KV pool and
   runs the same warm-up, so all processes compile and run the same programs in the same
   order (each program's collectives need every process).
3. Rank 0 (:func:`lead`) runs the scheduler, the tokenizer and the gRPC/HTTP servers as on
   one host. Its runner announces every device call before making it: a fixed-size header
   (op, bucket shape) and then the step's padded host batch (tokens, positions, slot
   mapping, block tables, sampling tensors), both sent with
   ``jax.experimental.multihost_utils.broadcast_one_to_all`` (a psum over all devices in
   which only rank 0 contributes; exact for every dtype).
4. Every other rank runs :func:`follow`: receive the header, build a dummy batch of that
   bucket's shapes, receive rank 0's batch into it, run the same jitted step (or block copy)
   on its own params and KV shards, and drop the result (the sampled tokens are replicated,
   so rank 0 alone reads them; each rank keeps its own copy as the next step's input, as
   rank 0 does). Penalty-row fills are announced the same way. ``Leader.stop`` ends the
   followers.

While rank 0 has no work, followers simply wait inside the next broadcast (no polling; a
400 s idle wait was tested with CPU/gloo collectives). If a process dies, the
``jax.distributed`` coordination service ends the others.

The scheduler, block tables and sampling state exist only on rank 0; followers hold only
device state (their shards, the sampler state, the last sampled tokens), which the broadcast
calls keep identical to rank 0's.
Not supported across hosts: ``preemption_mode="swap"`` (swapping reads the KV shards of
every host back to rank 0's memory); use ``"recompute"``.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import numpy as np

from jaxpaged.sched.output import StateRowInit
from jaxpaged.worker.buckets import Bucket, pow2_ladder
from jaxpaged.worker.runner import Runner

logger = logging.getLogger(__name__)

OP_STEP, OP_COPY, OP_WARM_STEP, OP_WARM_COPY, OP_STOP, OP_STATE_ROW = 1, 2, 3, 4, 5, 6
_HEADER = 6  # op, num_tokens, num_seqs, max_blocks, decode_only, move_len


def initialize(
    *,
    num_processes: int,
    process_id: int,
    coordinator_address: str | None,
) -> None:
    """``jax.distributed.initialize`` from the serving flags (a no-op for one process). Must
    run before anything touches a JAX device. On CPU the cross-process collectives use gloo."""
    for name, value in (("num_processes", num_processes), ("process_id", process_id)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}")
    if not 0 <= process_id < num_processes:
        raise ValueError(
            f"process_id must be in [0, num_processes={num_processes}), got {process_id}"
        )
    if num_processes == 1:
        return
    if not coordinator_address:
        raise ValueError(
            "coordinator_address (host:port of process 0) is required when num_processes > 1"
        )
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
    )


def check_engine_args(
    *,
    num_processes: int,
    preemption_mode: str = "recompute",
    kv_offloading_size: float | None = None,
) -> None:
    """ValueError for engine settings that cannot work across hosts."""
    if num_processes > 1 and preemption_mode == "swap":
        raise ValueError(
            "preemption_mode='swap' is not supported with num_processes > 1 (swap reads every "
            "host's KV shards back to one host); use preemption_mode='recompute'"
        )
    if num_processes > 1 and kv_offloading_size:
        raise ValueError(
            "kv_offloading_size is not supported with num_processes > 1 (the host tier reads "
            "every host's KV shards back to one host); leave it unset"
        )


def agree_min_bytes(value: int) -> int:
    """The smallest of every process's ``value`` (bytes, MiB granularity), so that all hosts
    size the KV pool alike (its shape is part of every program they run together)."""
    from jax.experimental import multihost_utils

    mib = np.array([value >> 20], np.int32)
    return int(np.min(multihost_utils.process_allgather(mib))) << 20


def _broadcast(tree: Any) -> Any:
    from jax.experimental import multihost_utils

    return multihost_utils.broadcast_one_to_all(tree)


def _header(op: int, bucket: Bucket | None = None, move_len: int = 0) -> np.ndarray:
    h = np.zeros(_HEADER, np.int32)
    h[0] = op
    if bucket is not None:
        h[1:5] = (bucket.num_tokens, bucket.num_seqs, bucket.max_blocks, int(bucket.decode_only))
    h[5] = move_len
    return h


class Leader:
    """Rank 0's side: installed as ``runner.leader``, it announces each device call."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner

    def announce_step(self, batch: Any, bucket: Bucket, *, op: int = OP_STEP) -> None:
        _broadcast(_header(op, bucket))
        _broadcast(batch)

    def announce_copy(
        self,
        src: np.ndarray,  # int32 [N]; -1 = padding
        dst: np.ndarray,  # int32 [N]
        *,
        op: int = OP_COPY,
    ) -> None:
        _broadcast(_header(op, move_len=len(src)))
        _broadcast((np.asarray(src, np.int32), np.asarray(dst, np.int32)))

    def announce_state_row(self, arrays: tuple[np.ndarray, ...]) -> None:
        """``arrays``: Runner.state_row_arrays' (fixed shapes)."""
        _broadcast(_header(OP_STATE_ROW))
        _broadcast(arrays)

    def warm_up(self) -> None:
        """Compile the broadcasts of every bucket and move size now (followers mirror it)."""
        for bucket in self.runner.buckets.all():
            batch, _ = self.runner.build_batch([], bucket)
            self.announce_step(batch, bucket, op=OP_WARM_STEP)
        for n in pow2_ladder(1, self.runner.moves.max_move):
            none = np.full(n, -1, np.int32)
            self.announce_copy(none, none, op=OP_WARM_COPY)

    def stop(self) -> None:
        """Ends every follower's loop (call once, when rank 0 shuts down)."""
        _broadcast(_header(OP_STOP))


def lead(engine: Any) -> Leader:
    """Make ``engine`` (rank 0's LLMEngine) announce its device calls to the followers; after
    this, serve as usual and call ``Leader.stop()`` at shutdown."""
    leader = Leader(engine.runner)
    leader.warm_up()
    # the broadcast programs compiled just now belong to warm-up, not to serving
    engine.core.mark_compiled()
    engine.runner.leader = leader
    return leader


def follow(engine: Any) -> int:
    """A follower's loop (ranks > 0): mirror rank 0's device calls until it stops. Returns
    the number of steps run."""
    runner: Runner = engine.runner
    steps = 0
    while True:
        header = _broadcast(_header(0))
        op = int(header[0])
        if op == OP_STOP:
            return steps
        if op in (OP_STEP, OP_WARM_STEP):
            t, s, b, decode_only = (int(x) for x in header[1:5])
            bucket = Bucket(t, s, b, bool(decode_only))
            batch = _broadcast(runner.build_batch([], bucket)[0])
            if op == OP_STEP:
                jax.block_until_ready(runner._run(batch, bucket))
                steps += 1
        elif op in (OP_COPY, OP_WARM_COPY):
            n = int(header[5])
            none = np.zeros(n, np.int32)
            src, dst = _broadcast((none, none))
            if op == OP_COPY:
                runner.apply_copy(src, dst)
        elif op == OP_STATE_ROW:
            empty = StateRowInit(row=0, prompt_token_ids=(), output_token_ids=())
            runner.fill_state_row(_broadcast(runner.state_row_arrays(empty)))
        else:
            raise RuntimeError(f"follower: unknown op {op} from rank 0")
