"""Scheduler: continuous batching over the paged KV cache (host side only, no JAX).

Steps overlap. The engine loop is: ``plan_k = schedule()``, dispatch it to the device, then
``update(plan_{k-1}, output_{k-1})`` with the tokens the previous step sampled, while step k
runs. So when the scheduler plans step k it has not seen step k-1's tokens yet: a request that
sampled in step k-1 has one token *in flight* (``Request.num_inflight``), and its decode in
step k is fed from step k-1's on-device output (``ScheduledSeq.prev_row``). Used strictly in
turn (schedule, run, update, schedule, ...) nothing is ever in flight and every fed token is a
host token. Either way the outputs are the same: the overlap only changes when the host learns
them. What it costs: a request that stops on EOS, a stop token id or a stop string in step k-1
has already been given a step-k token, which is dropped (its blocks are freed at the update).
Length limits cost nothing: a request whose last allowed token is in flight is not scheduled.
A request with ``structured_output`` is not scheduled while its token is in flight either (its
grammar's next mask needs that token): it decodes every other step, the others overlap.

A step (:meth:`Scheduler.schedule`) takes, under a token budget: running requests (decodes
first, then unfinished prefills; when blocks run out the latest arrival, or the lowest
priority, is preempted by recompute or swap), then swapped ones coming back, then waiting ones
admitted from the longest cached prefix. :meth:`update` appends the sampled tokens and ends
requests on token-based conditions; stop strings are the engine's (:meth:`finish`). What
crosses to the runner is what changed (a request's settings once, then its tokens and changed
block ids). The rules in full, with speculative decoding, sampler-state rows, the host tier
and the metrics: docs/architecture.md, "Scheduling a step".
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

from jaxpaged.config import CacheConfig, SchedulerConfig
from jaxpaged.sampling_params import banned_ids_for_min_tokens
from jaxpaged.sched.block_pool import BlockPool, CopyPair
from jaxpaged.sched.host_slots import host_block_counts
from jaxpaged.sched.images import fit_chunk
from jaxpaged.sched.lora_slots import LoraSlots
from jaxpaged.sched.output import (
    NewRequestData,
    RequestUpdate,
    RunnerOutput,
    ScheduledSeq,
    SchedulerOutput,
    SchedulerStats,
    StateRowInit,
)
from jaxpaged.sched.request import Request, RequestStatus
from jaxpaged.sched.request_checks import check_new_request
from jaxpaged.sched.request_queues import RequestQueues
from jaxpaged.sched.step_plan import StepPlan
from jaxpaged.spec import DeviceDraftSlots, NgramProposer, SpeculativeConfig, proposer_for

__all__ = [
    "NewRequestData",
    "StateRowInit",
    "RequestUpdate",
    "RunnerOutput",
    "ScheduledSeq",
    "Scheduler",
    "SchedulerOutput",
    "SchedulerStats",
]


class Scheduler:
    """Waiting / running / swapped queues over one BlockPool, which keeps every request's
    block table under its id (see the module docstring)."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        *,
        num_blocks: int,
        bytes_per_block: int | None = None,
        num_host_blocks: int | None = None,
        num_tier_blocks: int | None = None,
        num_disk_blocks: int | None = None,
        clock: Callable[[], float] = time.time,
        max_loras: int = 0,
        step_sizes: Sequence[int] = (),
        speculative_config: SpeculativeConfig | None = None,
    ) -> None:
        """``num_blocks``: device KV blocks (the runner's sizing); ``max_loras``: device
        LoRA slots (0: LoRA off); ``step_sizes``: token counts of the runner's compiled
        mixed-step shapes, which the prefill cap rounds to with ``fit_prefill_to_buckets``
        (:mod:`.prefill_cap`); ``speculative_config``: draft tokens for decodes, verified
        by the runner's step. Host swap, tier and disk slots: as given, else from their
        settings' bytes over ``bytes_per_block`` (:func:`.host_slots.host_block_counts`)."""
        self.config = scheduler_config
        self.cache_config = cache_config
        self.bytes_per_block = bytes_per_block or 0  # for the byte counts of metrics

        num_host_blocks, num_tier_blocks, num_disk_blocks = host_block_counts(
            scheduler_config,
            cache_config,
            bytes_per_block,
            host=num_host_blocks,
            tier=num_tier_blocks,
            disk=num_disk_blocks,
        )
        self.pool = BlockPool(
            num_blocks,
            cache_config.block_size,
            enable_prefix_caching=cache_config.enable_prefix_caching,
            num_host_blocks=num_host_blocks,
            num_tier_blocks=num_tier_blocks,
            num_disk_blocks=num_disk_blocks,
        )
        self.block_size = cache_config.block_size
        self.clock = clock
        q = self.queues = RequestQueues(by_priority=scheduler_config.scheduling_policy != "fcfs")
        self.waiting, self.running, self.swapped = q.waiting, q.running, q.swapped  # in place only
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.stats = SchedulerStats()
        self._groups: dict[str, list[Request]] = {}  # parent_id -> unfinished samples
        self._finished_ids: list[str] = []
        self._next_order = 0
        # penalty rows: one per running request at most, so max_num_seqs of them
        self._free_state_rows = list(range(scheduler_config.max_num_seqs - 1, -1, -1))
        # rows of the last planned step's sampled tokens: request id -> row
        self._prev_rows: dict[str, int] = {}
        # ids in the runner's batch: sent as NewRequestData and not yet sent as finished or
        # preempted (the runner keeps their settings and block tables)
        self._in_batch: set[str] = set()
        self.lora_slots = LoraSlots(max_loras) if max_loras else None
        self.step_sizes = tuple(step_sizes) if scheduler_config.fit_prefill_to_buckets else ()
        self._caps: tuple[int, ...] = ()  # cap by decodes in the step (set_prefill_caps)
        self.speculative_config = speculative_config
        self.proposer: NgramProposer | DeviceDraftSlots | None = None
        if speculative_config is not None:
            self.proposer = proposer_for(speculative_config)
            self.stats.spec_accepted_per_pos = [0] * speculative_config.num_speculative_tokens

    def set_prefill_cap(self, cap: int) -> None:
        """Sets ``max_prefill_tokens_with_decodes`` (the engine's measured cap, before any
        request arrives), the same for any number of decodes."""
        self.config = dataclasses.replace(self.config, max_prefill_tokens_with_decodes=cap)
        self._caps = ()

    def set_prefill_caps(self, caps: Sequence[int]) -> None:
        """Sets the cap of a step by its decodes: ``caps[d]`` prompt tokens beside ``d``
        decodes, ``caps[-1]`` beside more (the engine's measured caps, which keep a step
        within the same multiple of a decode step's time at any load). The config's
        ``max_prefill_tokens_with_decodes`` becomes the largest of them."""
        caps = tuple(caps)
        if len(caps) < 2 or any(not isinstance(c, int) or c < 1 for c in caps):
            raise ValueError(f"prefill caps must be ints >= 1 for 0, 1, ... decodes, got {caps}")
        self.set_prefill_cap(max(caps[1:]))
        self._caps = caps

    # ---------------------------------------------------------------- requests
    def add_request(self, request: Request) -> None:
        """Queues a new request. Raises ValueError if its id is in use or if it could
        never fit: prompt over max_model_len - 1, or more blocks than the whole pool."""
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already in use")
        request.max_tokens = check_new_request(
            request,
            self.config,
            block_size=self.block_size,
            num_blocks=self.pool.num_blocks,
            lora=self.lora_slots is not None,
        )
        request.arrival_order = self._next_order
        request.rng_stream = self._next_order
        self._next_order += 1
        self.requests[rid] = request
        if request.parent_id is not None:
            self._groups.setdefault(request.parent_id, []).append(request)
        self.queues.add_waiting(request)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def abort(self, request_id: str) -> bool:
        """Ends a request in any state and frees its blocks; False if unknown/finished."""
        return self.finish(request_id, RequestStatus.FINISHED_ABORTED)

    def finish(
        self,
        request_id: str,
        status: RequestStatus = RequestStatus.FINISHED_STOPPED,
        stop_reason: int | str | None = None,
    ) -> bool:
        """Ends a request from outside (stop string, abort, error); False if unknown."""
        if not status.is_finished:
            raise ValueError(f"status must be a FINISHED_* status, got {status}")
        request = self.requests.get(request_id)
        if request is None:
            return False
        request.stop_reason = stop_reason
        self._finish(request, status)
        return True

    def _finish(self, request: Request, status: RequestStatus) -> None:
        old = request.status
        if old is RequestStatus.RUNNING:
            self.running.remove(request)
            self.pool.free(request.request_id)
            self._release_state_row(request)
        elif old is RequestStatus.SWAPPED:
            self.swapped.remove(request)
            self.pool.free_host(request.request_id)
        elif old is RequestStatus.WAITING:
            self.waiting.remove(request)
            self.pool.free(request.request_id)  # no blocks, maybe memoised prefix keys
        if request.lora_slot:
            self.lora_slots.release(request.lora_slot)
            request.lora_slot = 0
        request.status = status
        request.finish_time = self.clock()
        del self.requests[request.request_id]
        if request.parent_id is not None:
            group = self._groups[request.parent_id]
            group.remove(request)
            if not group:
                del self._groups[request.parent_id]
        self._finished_ids.append(request.request_id)
        self._in_batch.discard(request.request_id)

    # ---------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        """Plans one step (see the module docstring) and advances ``num_computed_tokens``
        of every scheduled request: the step's K/V will be written before any later step
        runs."""
        self.pool.release_host_slots()
        budget = self.config.max_num_batched_tokens
        plan = StepPlan(
            budget=budget,
            cap=self.config.max_prefill_tokens_with_decodes or budget,  # long chunks stall decodes
            caps=self._caps,
            step_sizes=self.step_sizes,
        )
        room = plan.room
        emit = functools.partial(self._emit, plan)
        start_running = functools.partial(self._start_running, plan)
        scheduled, fed, copies, preempted = plan.scheduled, plan.fed, plan.copies, plan.preempted

        limit = None if self.proposer is None else self.speculative_config.disable_by_batch_size
        drafting = self.proposer is not None and (limit is None or len(self.running) <= limit)

        # 1. running: decodes first, then prefills; preempt the latest arrival on shortage.
        order = [r for r in self.running if not r.is_prefill]
        order += [r for r in self.running if r.is_prefill]
        for req in order:
            if room() <= 0:
                break
            if req.status is not RequestStatus.RUNNING or req.length_reached(
                self.config.max_model_len
            ):
                continue  # preempted earlier in this loop, or its last token is in flight
            if req.num_inflight and req.sampling_params.structured_output is not None:
                continue  # its grammar's next mask needs the token in flight
            drafts: tuple[int, ...] = ()
            if (
                drafting
                and req.can_speculate
                and (self.proposer.grammar_drafts or req.sampling_params.structured_output is None)
            ):
                if req.num_inflight:
                    continue  # drafting reads its tokens: the one in flight first
                drafts = self._drafts(req, room() - 1)
            n = min(req.num_total_tokens - req.num_computed_tokens, room())
            n = fit_chunk(req.num_computed_tokens, n, req.images)  # a whole image, or none
            if n == 0:
                continue
            if drafts and not self.pool.can_allocate(
                req.request_id, req.num_computed_tokens, n + len(drafts)
            ):
                drafts = ()  # no blocks to spare for drafts: a plain decode
            new_copies = self._allocate(req, n + len(drafts))
            while new_copies is None:
                victim = next(r for r in reversed(self.running) if r not in scheduled)
                plan.swap_out.extend(self._preempt(victim))
                preempted.append(victim.request_id)
                if victim is req:
                    break
                new_copies = self._allocate(req, n)
            if new_copies is None:
                continue
            copies.extend(new_copies)
            emit(req, req.num_computed_tokens, n, drafts)

        # 2. swapped, oldest first (once their in-flight token is known).
        if not preempted:
            while self.swapped and room() > 0 and len(self.running) < self.config.max_num_seqs:
                req = self.swapped[0]
                n = min(req.num_tokens - req.num_computed_tokens, room())
                n = fit_chunk(req.num_computed_tokens, n, req.images)
                if (
                    n == 0
                    or req.num_inflight
                    or not self.pool.can_swap_in(req.request_id, req.num_computed_tokens, n)
                ):
                    break
                self.swapped.pop(0)
                plan.swap_in.extend(self.pool.swap_in(req.request_id))
                new_copies = self._allocate(req, n)
                assert new_copies is not None  # checked by can_swap_in
                copies.extend(new_copies)
                start_running(req)
                emit(req, req.num_computed_tokens, n)

        # 3. waiting, first come first served (held n>1 samples are passed over).
        if not preempted and not self.swapped:
            held: list[Request] = []
            while self.waiting and room() > 0 and len(self.running) < self.config.max_num_seqs:
                req = self.waiting.popleft()
                if req.lora_name and not req.lora_slot:  # every slot held by other adapters
                    if not self.lora_slots.can_acquire(req.lora_name):
                        held.append(req)
                        continue
                admitted = None if req.num_inflight else self._admit(req, room(), held, fed)
                if admitted is None:
                    self.waiting.appendleft(req)
                    break
                if admitted is False:
                    continue
                start, n, new_copies = admitted
                if req.lora_name and not req.lora_slot:
                    req.lora_slot, load = self.lora_slots.acquire(req.lora_name)
                    if load:
                        plan.lora_loads.append((req.lora_slot, req.lora_name))
                copies.extend(new_copies)
                start_running(req)
                emit(req, start, n)
            self.waiting.extendleft(reversed(held))

        # Full blocks computed by this step go into the prefix cache now: any step that
        # finds them is dispatched after this one, which writes them.
        for req in scheduled:
            self.pool.register_computed(
                req.request_id,
                req.num_computed_tokens,
                req.num_tokens,
                req.prefix_key_slice,
                req.lora_name,
            )
        self._prev_rows = {s.request_id: i for i, s in enumerate(plan.seqs) if s.do_sample}
        finished, self._finished_ids = tuple(self._finished_ids), []
        moves = self.pool.take_tier_moves()
        self.stats.num_steps += 1
        self.stats.kv_offload_blocks_stored += len(moves.offload)
        self.stats.kv_offload_blocks_loaded += len(moves.load) + len(moves.disk_load)
        self.stats.kv_offload_disk_blocks_stored += len(moves.spill)
        self.stats.kv_offload_disk_blocks_loaded += len(moves.disk_load)
        return plan.output(finished, moves)

    def _emit(
        self, plan: StepPlan, req: Request, start: int, n: int, drafts: Sequence[int] = ()
    ) -> None:
        """Schedules ``n`` tokens of ``req`` from position ``start`` (plus ``drafts`` after a
        decode's token, to verify) and advances its computed count past them."""
        rid = req.request_id
        new = rid not in self._in_batch
        if new:  # joins the runner's batch: its settings and whole table cross once
            self._in_batch.add(rid)
            plan.new_requests.append(req.new_request_data())
        changes = self.pool.take_block_changes(rid, whole=new)
        seq = req.scheduled_seq(
            start, n, prev_rows=self._prev_rows, block_changes=changes, drafts=drafts
        )
        plan.add(req, seq, n + len(drafts), len(drafts))
        req.num_computed_tokens = start + n + len(drafts)
        req.num_inflight += int(seq.do_sample)

    def _start_running(self, plan: StepPlan, req: Request) -> None:
        """Moves ``req`` into ``running``, with a sampler-state row when it needs one."""
        self.queues.set_running(req)
        if req.needs_state_row:
            sp = req.sampling_params
            banned = banned_ids_for_min_tokens(sp, req.eos_token_ids) if sp.min_tokens else ()
            req.state_row = self._free_state_rows.pop()
            plan.row_inits.append(
                StateRowInit(
                    row=req.state_row,
                    prompt_token_ids=tuple(req.prompt_token_ids),
                    output_token_ids=tuple(req.output_token_ids),
                    min_tokens=sp.min_tokens,
                    banned_ids=banned,
                    logit_bias=sp.logit_bias,
                )
            )

    def _drafts(self, req: Request, room: int) -> tuple[int, ...]:
        """Draft tokens for a decode of ``req``'s last known token (none for a prefill):
        at most ``room`` of them, and none that would run past ``max_tokens`` or
        ``max_model_len`` if all were accepted (the step adds one token of its own)."""
        if req.num_tokens - req.num_computed_tokens != 1:
            return ()
        k = min(
            room,
            req.max_tokens - req.num_generated - 1,
            self.config.max_model_len - req.num_tokens - 1,
        )
        if k <= 0:
            return ()
        return self.proposer.propose(req.all_token_ids, k)

    def _admit(
        self, req: Request, budget: int, held: list[Request], fed: dict[str, int]
    ) -> tuple[int, int, list[CopyPair]] | bool | None:
        """Gives a waiting request its blocks. Returns (start, num_tokens, copies), False if
        it is held (appended to ``held``), None if the pool cannot take it now. A sample of
        an n > 1 group forks a sibling whose prompt an earlier step computed (``fed``: this
        step's tokens, not yet written when the fork's copy-on-write runs)."""
        fresh = req.num_computed_tokens == 0 and not req.output_token_ids
        if fresh and req.parent_id is not None:
            n_prompt = req.num_prompt_tokens
            siblings = [
                r
                for r in self._groups[req.parent_id]
                if r is not req and r.status is RequestStatus.RUNNING
            ]
            donor = next(
                (
                    r
                    for r in siblings
                    if r.num_computed_tokens - fed.get(r.request_id, 0) >= n_prompt
                ),
                None,
            )
            if donor is not None:
                self.pool.fork(
                    donor.request_id, req.request_id, n_prompt, donor.num_computed_tokens
                )
                req.num_computed_tokens = n_prompt - 1
                new_copies = self._allocate(req, 1)
                if new_copies is None:
                    self.pool.free(req.request_id)
                    req.num_computed_tokens = 0
                    return None
                req.num_cached_tokens = n_prompt - 1
                self.stats.prefix_cache_queries += n_prompt
                self.stats.prefix_cache_hits += n_prompt - 1
                return n_prompt - 1, 1, new_copies
            if siblings:  # a sibling is prefilling this prompt: fork from it later
                held.append(req)
                return False
        prefix = (  # prompt logprobs need every prompt position computed
            []
            if req.wants_prompt_logprobs
            else self.pool.find_prefix(
                req.request_id, req.num_tokens, req.prefix_key_slice, req.lora_name
            )
        )
        start = len(prefix) * self.block_size
        n = fit_chunk(start, min(req.num_tokens - start, budget), req.images)
        if n == 0:  # the next image does not fit this step (sched/images.py: fit_chunk)
            return None
        new_copies = self._allocate(req, n, prefix)
        if new_copies is None:
            return None
        req.num_computed_tokens = start
        if fresh:
            req.num_cached_tokens = start
        self.stats.prefix_cache_queries += req.num_tokens
        self.stats.prefix_cache_hits += start
        self.stats.kv_offload_hits += self.block_size * sum(isinstance(b, bytes) for b in prefix)
        return start, n, new_copies

    def _allocate(
        self, req: Request, n: int, prefix_blocks: Sequence[int] = ()
    ) -> list[CopyPair] | None:
        """The pool's allocate_slots for ``n`` tokens past the request's computed ones."""
        return self.pool.allocate_slots(req.request_id, req.num_computed_tokens, n, prefix_blocks)

    def _release_state_row(self, req: Request) -> None:
        if req.state_row >= 0:
            self._free_state_rows.append(req.state_row)
            req.state_row = -1

    def _preempt(self, victim: Request) -> list[CopyPair]:
        """Takes a running request off the device; returns its swap-out pairs (if any)."""
        self.running.remove(victim)
        self._in_batch.discard(victim.request_id)
        self._release_state_row(victim)
        victim.num_preemptions += 1
        self.stats.num_preemptions += 1
        if (
            self.config.preemption_mode == "swap"
            and self.pool.num_blocks_of(victim.request_id)
            and self.pool.can_swap_out(victim.request_id)
        ):
            pairs = self.pool.swap_out(victim.request_id)
            self.queues.set_swapped(victim)
            self.stats.num_swap_outs += 1
            return pairs
        self.pool.free(victim.request_id)
        victim.num_computed_tokens = 0
        self.queues.requeue(victim)
        return []

    # ------------------------------------------------------------------ update
    def update(
        self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput
    ) -> list[RequestUpdate]:
        """Applies one executed step's samples: appends each sampled token to its request
        (whatever state it is in now: a request preempted since still gets its token), ends
        requests that hit a token-based stop condition (freeing their blocks), and ends the
        requests the runner could not batch with an error. Requests that ended since the
        step was planned are skipped. Returns one update per request that changed."""
        seqs = scheduler_output.seqs
        sampled = runner_output.sampled_token_ids
        logprobs = runner_output.logprobs
        if len(sampled) != len(seqs):
            raise ValueError(
                f"runner_output.sampled_token_ids has {len(sampled)} entries for "
                f"{len(seqs)} scheduled sequences"
            )
        if logprobs is not None and len(logprobs) != len(seqs):
            raise ValueError(
                f"runner_output.logprobs has {len(logprobs)} entries for {len(seqs)} sequences"
            )
        now = self.clock()
        updates: list[RequestUpdate] = []
        prompt_lps = runner_output.prompt_logprobs or [None] * len(seqs)
        for i, s in enumerate(seqs):
            req = self.requests.get(s.request_id)
            if req is not None and req.arrival_order == s.seq_id and prompt_lps[i]:
                req.add_prompt_logprobs(s.start_pos, prompt_lps[i])
            if req is None or req.arrival_order != s.seq_id or not s.do_sample:
                continue  # ended since (abort / stop), or a chunk that does not sample
            req.num_inflight -= 1
            error = runner_output.failed.get(s.request_id)
            if error is not None:
                self._finish(req, RequestStatus.FINISHED_ERROR)
                updates.append(
                    RequestUpdate(
                        request_id=s.request_id,
                        new_token_ids=(),
                        finish_reason="error",
                        error=error,
                    )
                )
                continue
            tokens, lps = runner_output.emitted(i)
            if req.first_token_time is None:
                req.first_token_time = now
            first = not req.output_token_ids and req.sampling_params.prompt_logprobs is not None
            status = None
            kept = 0
            for token in tokens:  # stops at the first token that ends it, as one at a time
                req.output_token_ids.append(token)
                kept += 1
                status = req.stop_status(token, self.config.max_model_len)
                if status is not None:
                    break
            if s.num_draft_tokens:
                self.stats.count_drafts(s.num_draft_tokens, len(tokens) - 1)
                # rejected drafts' K/V is stale: the next step rewrites from the bonus token
                req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
                self.pool.trim(req.request_id, req.num_computed_tokens)
            if status is not None:
                self._finish(req, status)
            updates.append(
                RequestUpdate(
                    request_id=s.request_id,
                    new_token_ids=tuple(tokens[:kept]),
                    new_logprobs=tuple(lps[:kept]),
                    prompt_logprobs=tuple(req.prompt_logprobs) if first else None,
                    finish_reason=None if status is None else status.finish_reason,
                    stop_reason=req.stop_reason if status is not None else None,
                )
            )
        return updates

    # ----------------------------------------------------------------- metrics
    def kv_cache_usage(self) -> float:
        """Fraction of device blocks held by requests."""
        return self.pool.usage

    def kv_cache_waste(self) -> float:
        """1 - tokens stored / slots of held blocks, now. Shared blocks count once; only
        the unfilled tails of block tables waste slots."""
        return self.pool.waste((r.request_id, r.num_computed_tokens) for r in self.running)
