"""A hand-computable stand-in for the model runner, for scheduler and block pool tests.

The "KV cache" is a numpy array of token ids, one slot per (block, offset): the fake writes
each fed token (and its position) into its slot, applies the plan's swap-out, offload,
swap-in, load and copy lists in the runner's order first, keeps each request's block table from the plans'
changes in the runner's persistent batch (:class:`jaxpaged.worker.input_batch.PersistentBatch`,
so a wrong or missed block-table change is caught here), and then "attends": it reads positions
``0 .. kv_len - 1`` back through that block table, asserts they hold exactly the request's
tokens (the host's, then, for a token the host has not seen yet, what the fake model makes of
the context), and samples ``next_token(those tokens)``. Like the real runner it can run
overlapped: ``dispatch`` a step before ``collect``-ing the previous one, a decode fed from the
previous step's sampled row (``prev_row``). So a wrong slot, a missed copy-on-write,
a bad swap or a wrongly shared prefix block either fails the assertion or changes the
output, which tests compare with :func:`reference_output` (the same rule on the token list
alone, no cache).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from jaxpaged.engine.testing import FakeDeviceAdmin
from jaxpaged.sched.request import Request, RequestStatus
from jaxpaged.sched.scheduler import RunnerOutput, Scheduler, SchedulerOutput
from jaxpaged.worker.input_batch import PersistentBatch

VOCAB = 1000


def next_token(tokens: Sequence[int]) -> int:
    """The fake model: (sum of the context + its length) mod VOCAB. [1, 2, 3] -> 9."""
    return (int(sum(tokens)) + len(tokens)) % VOCAB


def reference_output(prompt: Sequence[int], num_tokens: int) -> list[int]:
    """What a request alone produces: next_token applied num_tokens times."""
    seq = list(prompt)
    out = []
    for _ in range(num_tokens):
        t = next_token(seq)
        out.append(t)
        seq.append(t)
    return out


class FakeRunner(FakeDeviceAdmin):
    """Device pool [num_blocks, block_size], host pool [num_host_blocks, block_size] and
    host tier [num_tier_blocks, block_size] of token ids (-1 = never written), plus the
    positions written, to catch misplaced writes.
    A ``DeviceRunner``: releasing the KV pool (sleep) forgets what the device pool held."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_host_blocks: int = 0,
        *,
        scheduler: Scheduler,
        num_tier_blocks: int = 0,
        num_disk_blocks: int = 0,
    ) -> None:
        self.scheduler = scheduler  # to read the host's tokens of each request (checks only)
        self.block_size = block_size
        self.sampled: list[int] = []  # the last step's sampled tokens, by row
        self.dev_tok = np.full((num_blocks, block_size), -1, np.int64)
        self.dev_pos = np.full((num_blocks, block_size), -1, np.int64)
        self.host_tok = np.full((max(num_host_blocks, 1), block_size), -1, np.int64)
        self.host_pos = np.full((max(num_host_blocks, 1), block_size), -1, np.int64)
        self.tier_tok = np.full((max(num_tier_blocks, 1), block_size), -1, np.int64)
        self.tier_pos = np.full((max(num_tier_blocks, 1), block_size), -1, np.int64)
        self.disk_tok = np.full((max(num_disk_blocks, 1), block_size), -1, np.int64)
        self.disk_pos = np.full((max(num_disk_blocks, 1), block_size), -1, np.int64)
        self.steps: list[SchedulerOutput] = []
        cfg = scheduler.config
        self.batch = PersistentBatch(
            max_rows=cfg.max_num_seqs, max_blocks=-(-cfg.max_model_len // block_size)
        )

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        return self.collect(self.dispatch(plan))

    def collect(self, pending: RunnerOutput | None) -> RunnerOutput:
        return RunnerOutput(sampled_token_ids=()) if pending is None else pending

    def dispatch(
        self, plan: SchedulerOutput, allowed: Mapping[int, np.ndarray] | None = None
    ) -> RunnerOutput | None:
        """Runs the plan's step at once (``allowed`` masks are not applied: the fake model
        has no grammar requests)."""
        self.check_kv()
        return self._step(plan)

    def release_kv(self) -> int:
        """Sleep: what the device pool held is gone."""
        super().release_kv()
        self.dev_tok[:] = -1
        self.dev_pos[:] = -1
        return self.dev_tok.nbytes + self.dev_pos.nbytes

    def _step(self, out: SchedulerOutput) -> RunnerOutput | None:
        self.steps.append(out)
        for slot, disk in out.blocks_to_spill:
            self.disk_tok[disk] = self.tier_tok[slot]
            self.disk_pos[disk] = self.tier_pos[slot]
        for dev, host in out.blocks_to_swap_out:
            self.host_tok[host] = self.dev_tok[dev]
            self.host_pos[host] = self.dev_pos[dev]
        for dev, slot in out.blocks_to_offload:
            self.tier_tok[slot] = self.dev_tok[dev]
            self.tier_pos[slot] = self.dev_pos[dev]
        for host, dev in out.blocks_to_swap_in:
            self.dev_tok[dev] = self.host_tok[host]
            self.dev_pos[dev] = self.host_pos[host]
        for slot, dev in out.blocks_to_load:
            self.dev_tok[dev] = self.tier_tok[slot]
            self.dev_pos[dev] = self.tier_pos[slot]
        for disk, dev in out.blocks_to_load_from_disk:
            self.dev_tok[dev] = self.disk_tok[disk]
            self.dev_pos[dev] = self.disk_pos[disk]
        # copies are simultaneous (all sources read, then all written), like copy_blocks
        dsts = [d for _, d in out.blocks_to_copy]
        srcs = [s for s, _ in out.blocks_to_copy]
        assert len(set(dsts)) == len(dsts), "copy destinations must be distinct"
        self.dev_tok[dsts], self.dev_pos[dsts] = self.dev_tok[srcs], self.dev_pos[srcs]
        self.batch.update(out)
        flat_tok = self.dev_tok.reshape(-1)
        flat_pos = self.dev_pos.reshape(-1)
        written: set[int] = set()
        bs = self.block_size
        for s in out.seqs:
            table = self.batch.block_table(s.request_id)
            assert len(table) == -(-s.kv_len // bs), f"{s.request_id}: table vs kv_len"
            req = self.scheduler.requests.get(s.request_id)
            if req is not None and req.arrival_order == s.seq_id:
                pool_table = self.scheduler.pool.block_table(s.request_id)
                assert tuple(table.tolist()) == pool_table, f"{s.request_id}: stale table"
            slots = [int(table[p // bs]) * bs + p % bs for p in s.positions()]
            assert not written & set(slots), f"{s.request_id}: two sequences write one slot"
            written |= set(slots)
            fed = list(s.token_ids)
            if s.prev_row >= 0:
                assert s.num_tokens == 1, f"{s.request_id}: only a decode reads the device"
                fed = [self.sampled[s.prev_row]]
            flat_tok[slots] = fed
            flat_pos[slots] = list(s.positions())
        sampled = []
        for s in out.seqs:
            req = self.scheduler.requests.get(s.request_id)
            table = self.batch.block_table(s.request_id)
            pos = np.arange(s.kv_len)
            slots = table[pos // bs] * bs + pos % bs
            cached = flat_tok[slots].tolist()
            assert flat_pos[slots].tolist() == pos.tolist(), f"{s.request_id}: misplaced K/V"
            if req is not None and req.arrival_order == s.seq_id:  # not ended since
                known = req.all_token_ids
                assert cached[: len(known)] == known[: s.kv_len], f"{s.request_id}: wrong K/V"
                for j in range(len(known), s.kv_len):  # in flight: the model's own tokens
                    assert cached[j] == next_token(cached[:j]), f"{s.request_id}: wrong K/V"
            sampled.append(next_token(cached) if s.do_sample else -1)
        self.sampled = sampled
        return RunnerOutput(sampled_token_ids=sampled)


def check_invariants(sched: Scheduler) -> None:
    """Ref counts equal the number of block tables naming each block; free + used = total;
    running requests hold exactly the blocks of their computed tokens; queues agree with
    statuses; the pool keeps device blocks only for running requests, host slots only for
    swapped ones, and nothing for a request that has ended."""
    pool = sched.pool
    holders: dict[int, int] = {}
    for req in sched.running:
        assert req.status is RequestStatus.RUNNING
        table = pool.block_table(req.request_id)
        assert len(table) == -(-req.num_computed_tokens // pool.block_size), req.request_id
        assert len(set(table)) == len(table)
        for b in table:
            holders[b] = holders.get(b, 0) + 1
    for req in sched.waiting:
        assert req.status is RequestStatus.WAITING and not pool.block_table(req.request_id)
        assert not pool.host_block_table(req.request_id)
    for req in sched.swapped:
        assert req.status is RequestStatus.SWAPPED and not pool.block_table(req.request_id)
        assert pool.host_block_table(req.request_id)
    for b in range(pool.num_blocks):
        assert pool.ref_count(b) == holders.get(b, 0), f"block {b}"
    assert pool.num_used_blocks == len(holders)
    host_held = sum(len(pool.host_block_table(r.request_id)) for r in sched.swapped)
    assert pool.num_free_host_blocks + host_held <= pool.num_host_blocks
    queued = len(sched.waiting) + len(sched.running) + len(sched.swapped)
    assert queued == len(sched.requests)
    assert set(pool.req_to_blocks) == {r.request_id for r in sched.running}
    assert pool.tracked_request_ids() <= set(sched.requests)


def run(
    sched: Scheduler,
    runner: FakeRunner,
    max_steps: int = 1000,
    on_step=None,
    *,
    overlap: bool = False,
) -> dict[str, list[int]]:
    """Steps until no request is left; returns every finished request's output tokens.
    ``overlap``: plan and dispatch step k before updating with step k-1 (the engine's loop).
    ``on_step(plan, updates)`` sees each plan with the updates of its own step."""
    done: dict[str, list[int]] = {}
    in_flight = None

    def finish_step(plan, pending) -> None:
        requests = {s.request_id: sched.requests.get(s.request_id) for s in plan.seqs}
        updates = sched.update(plan, runner.collect(pending))
        check_invariants(sched)
        for u in updates:
            if u.finished:
                done[u.request_id] = list(requests[u.request_id].output_token_ids)
        if on_step is not None:
            on_step(plan, updates)

    for _ in range(max_steps):
        if not sched.has_unfinished_requests() and in_flight is None:
            return done
        plan = sched.schedule()
        check_invariants_during_step(sched, plan)
        pending = runner.dispatch(plan)
        if not overlap:
            finish_step(plan, pending)
            continue
        if in_flight is not None:
            finish_step(*in_flight)
        in_flight = (plan, pending) if plan.seqs else None
    raise AssertionError(f"not finished after {max_steps} steps")


def check_invariants_during_step(sched: Scheduler, out: SchedulerOutput) -> None:
    """Between schedule() and update(): budget, max_num_seqs, one entry per request."""
    cfg = sched.config
    assert out.num_batched_tokens <= cfg.max_num_batched_tokens
    assert out.num_seqs <= cfg.max_num_seqs
    ids = [s.request_id for s in out.seqs]
    assert len(set(ids)) == len(ids)
    for s in out.seqs:
        req = sched.requests[s.request_id]
        assert s.kv_len == req.num_computed_tokens  # advanced when scheduled
        assert s.num_tokens >= 1
        if s.do_sample:  # reaches the end of its tokens: one more is now in flight
            assert s.kv_len == req.num_total_tokens - 1 and req.num_inflight >= 1
        else:  # a prefill chunk that stops short of the end
            assert s.kv_len < req.num_total_tokens
        table = sched.pool.block_table(s.request_id)  # the runner's copy: FakeRunner checks
        assert len(table) == -(-s.kv_len // sched.block_size)
        assert (s.prev_row >= 0) == (s.start_pos >= req.num_tokens)  # fed the unseen token


def make_request(
    request_id: str,
    prompt: Sequence[int],
    max_tokens: int = 8,
    *,
    arrival_time: float = 0.0,
    **params,
) -> Request:
    from jaxpaged.sampling_params import SamplingParams

    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=max_tokens, **params),
        arrival_time=arrival_time,
    )
