"""EngineCore: the engine loop. One thread owns the scheduler, the runner and the output
processing; nothing here takes a lock. Other threads talk to it through its inbox
(:meth:`EngineCore.add_request`, :meth:`EngineCore.abort`, both safe from any thread), drained
at the start of every step, and get outputs back from :meth:`EngineCore.step`.

The step overlaps host and device work::

    plan_k = scheduler.schedule()        # host: sees tokens up to step k-2
    pending_k = runner.dispatch(plan_k)  # device starts step k (its decodes read step k-1's
                                         # tokens on the device)
    out_{k-1} = runner.collect(pending_{k-1})   # waits for step k-1, which ran meanwhile
    scheduler.update(plan_{k-1}, out_{k-1}); output processing -> deltas

so while the device runs step k, the host finishes step k-1 and then plans step k+1: the device
waits for Python only when the host work of a step takes longer than the step itself.

The one exception: a step that carries a structured-output request verifying drafts made on
the device (a draft model, an EAGLE-3 head). Its grammar masks need those drafts, so
``dispatch`` reads them back (waiting for step k-1 and the drafting) before it launches the
target's part of step k (jaxpaged.worker.spec_grammar).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np

from jaxpaged.engine.output_processor import OutputProcessor
from jaxpaged.engine.protocol import EngineStats
from jaxpaged.engine.step_log import StepLog
from jaxpaged.outputs import RequestOutput, RequestOutputKind
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.sched.images import ImageItem
from jaxpaged.sched.output import RequestUpdate, RunnerOutput, SchedulerOutput
from jaxpaged.sched.request import Request, RequestStatus
from jaxpaged.sched.scheduler import Scheduler
from jaxpaged.worker.grammar import GrammarMatchers
from jaxpaged.worker.lora import LoraAdapters
from jaxpaged.worker.spec_grammar import DraftMasks

__all__ = ["DeviceRunner", "EngineCore", "EngineRequest", "EngineStepError"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineRequest:
    """A validated, tokenized user request on its way to the engine thread (plain data)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    arrival_time: float
    output_kind: RequestOutputKind = RequestOutputKind.DELTA
    lora_name: str | None = None  # the registered LoRA adapter it runs with
    images: tuple[ImageItem, ...] = ()  # its prompt's images, preprocessed (engine/images.py)
    pooling: bool = False  # a pooling request (engine/paged_pooling.py)


@dataclasses.dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclasses.dataclass(frozen=True, eq=False)
class _Call:
    """An admin call (weights, sleep, wake) for the engine thread to run between steps."""

    fn: Callable[[], Any]
    future: concurrent.futures.Future


@runtime_checkable
class DeviceRunner(Protocol):
    """Everything the engine (this core and the LLMEngine builder) calls on a runner:
    jaxpaged.worker.runner.Runner, and the fakes of the tests and jaxpaged.engine.testing.
    The step: ``dispatch`` launches a plan's step without waiting (``allowed``: sequence
    index -> its structured-output mask [vocab] bool), ``collect`` waits for it, ``execute``
    does both. ``warm_up`` compiles every step program. Between steps (admin calls): new
    weights, and for sleep mode dropping the weights and freeing / restoring the KV pool.
    tests/engine/test_device_runner.py checks each implementation member by member: a
    member added here is added to each of them."""

    def dispatch(
        self, plan: SchedulerOutput, allowed: Mapping[int, np.ndarray] | None = None
    ) -> Any: ...  # noqa: ANN401 - the runner's pending step, for collect

    def collect(self, pending: Any) -> RunnerOutput: ...  # noqa: ANN401

    def execute(self, plan: SchedulerOutput) -> RunnerOutput: ...

    def warm_up(self, *, swap: bool = False, show_progress: bool = True) -> tuple[int, float]:
        """Compiles every program serving runs; returns (programs, seconds)."""
        ...

    def update_params(self, params: Any) -> None: ...  # noqa: ANN401 - the params pytree

    def release_params(self) -> None: ...

    def release_kv(self) -> int:
        """Frees the KV pool (nothing running); returns the bytes freed."""
        ...

    def restore_kv(self) -> None: ...

    @property
    def kv_released(self) -> bool: ...


class EngineCore:
    """The engine state and its loop (see the module docstring)."""

    def __init__(
        self,
        *,
        scheduler: Scheduler,
        runner: DeviceRunner,
        tokenizer: Any,
        eos_token_ids: tuple[int, ...],
        num_kv_blocks: int,
        compilations: Callable[[], int] = lambda: 0,
        clock: Callable[[], float] = time.time,
        grammars: GrammarMatchers | None = None,
        lora: LoraAdapters | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.lora = lora  # the registered LoRA adapters and their device slots (LoRA on)
        self.grammars = grammars  # structured output: a matcher per grammar request
        self.runner = runner
        self.eos_token_ids = eos_token_ids
        self.num_kv_blocks = num_kv_blocks
        self.outputs = OutputProcessor(tokenizer, clock)
        self._compilations = compilations
        self._compilations_at_warmup = compilations()
        self._inbox: queue.SimpleQueue[EngineRequest | _Abort | _Call] = queue.SimpleQueue()
        self.sleep_level = 0  # 0 awake; 1 KV pool freed; 2 weights dropped too
        self._admin_outputs: list[RequestOutput] = []  # produced by admin calls
        self._wake = threading.Event()
        self._in_flight: tuple[SchedulerOutput, Any] | None = None
        # pooling requests' hidden states, request id -> float32 [D], until the engine takes them
        self.pooled_hidden: dict[str, np.ndarray] = {}
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._waste_sum = 0.0
        self._waste_steps = 0
        self.step_log = StepLog.from_env()  # $JAXPAGED_STEP_LOG: per-step times (debugging)
        self.stats = self._snapshot()

    # ----------------------------------------------------- any thread: the inbox
    def add_request(self, request: EngineRequest) -> None:
        """Queues a validated request for the engine thread."""
        self._inbox.put(request)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Queues an abort: the request ends (finish_reason "abort") at the next step."""
        self._inbox.put(_Abort(request_id))
        self._wake.set()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Queues ``fn`` for the engine thread, to run between two steps (before the next
        step is planned); the future holds its result or its exception."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(_Call(fn, future))
        self._wake.set()
        return future

    def wake(self) -> None:
        """Ends a ``wait_for_work`` early (e.g. to stop the engine thread)."""
        self._wake.set()

    def wait_for_work(self, timeout: float) -> None:
        """Blocks until something arrives in the inbox (or ``timeout`` seconds pass)."""
        self._wake.wait(timeout)
        self._wake.clear()

    def mark_compiled(self) -> None:
        """Compilations up to now belong to warm-up (not to serving)."""
        self._compilations_at_warmup = self._compilations()

    # ------------------------------------------------------- engine thread only
    def has_work(self) -> bool:
        return (
            bool(len(self.outputs))
            or self._in_flight is not None
            or not self._inbox.empty()
            or self.scheduler.has_unfinished_requests()
        )

    def step(self) -> list[RequestOutput]:
        """One iteration: drain the inbox, plan and dispatch step k, then finish step k-1.
        A device failure ends every request with an error and is raised."""
        started = time.time(), time.perf_counter()
        finished: SchedulerOutput | None = None
        outputs = self._drain_inbox()
        plan = self.scheduler.schedule()
        pending = None
        try:
            if plan.has_work:
                self.outputs.scheduled((s.request_id for s in plan.seqs), self._num_cached_tokens)
                allowed = self._grammar_masks(plan)
                pending = (
                    self.runner.dispatch(plan, allowed) if allowed else self.runner.dispatch(plan)
                )
            if self._in_flight is not None:
                prev_plan, prev_pending = self._in_flight
                finished = prev_plan
                self._in_flight = None
                result = self.runner.collect(prev_pending)
                outputs += self._apply(prev_plan, result)
        except Exception as exc:
            self._in_flight = None
            outputs += self.fail_all(exc)
            raise EngineStepError(outputs) from exc
        if plan.seqs:
            self._in_flight = (plan, pending)
            self._waste_sum += self.scheduler.kv_cache_waste()
            self._waste_steps += 1
        self.stats = self._snapshot()
        if self.step_log is not None:
            self.step_log.record(
                started[0],
                time.perf_counter() - started[1],
                finished,
                self._first_chunk_arrivals(plan),
            )
        return outputs

    def _first_chunk_arrivals(self, plan: SchedulerOutput) -> dict[str, float]:
        """Arrival times of the requests whose first chunk ``plan`` carries (step log)."""
        out = {}
        for s in plan.seqs:
            req = self.scheduler.requests.get(s.request_id)
            if (
                req is not None
                and not req.output_token_ids
                and s.start_pos == req.num_cached_tokens
            ):
                out[s.request_id] = req.arrival_time
        return out

    def step_inbox(self) -> list[RequestOutput]:
        """Applies what is in the inbox now (adds, aborts) without running a step: an abort
        frees the request's blocks at once."""
        outputs = self._drain_inbox()
        self.stats = self._snapshot()
        return outputs

    def fail_all(self, exc: BaseException) -> list[RequestOutput]:
        """Ends every request with finish_reason "error" and frees its blocks."""
        logger.error("engine failed (%s); ending %d requests", exc, len(self.outputs))
        outputs = self.outputs.fail_all(f"{type(exc).__name__}: {exc}")
        for rid in list(self.scheduler.requests):
            self.scheduler.finish(rid, RequestStatus.FINISHED_ERROR)
        self.stats = self._snapshot()
        return outputs

    def reset_prefix_cache(self) -> None:
        self.scheduler.pool.reset_prefix_cache()

    # ------------------------------------ engine thread only: admin (through call())
    def update_weights(self, params: Any) -> None:  # noqa: ANN401 - the runner's params pytree
        """Swaps the runner's weights between steps. Cached prefixes were computed with the
        old weights, so they are forgotten; requests still running continue on the new
        weights with the KV they have."""
        self.runner.update_params(params)
        self.scheduler.pool.reset_prefix_cache()
        if self.sleep_level == 2:
            self.sleep_level = 1  # weights are back; the KV pool still needs wake_up

    def sleep(self, level: int) -> int:
        """Frees the KV pool (level 1) and drops the weights too (level 2), so another
        program can use the memory. Refused while requests are unfinished. Returns the KV
        bytes freed (0 when it was already freed)."""
        if level not in (1, 2):
            raise ValueError(
                f"sleep level must be 1 (free the KV pool) or 2 (and the weights), got {level!r}"
            )
        unfinished = len(self.outputs)
        if unfinished:
            raise RuntimeError(
                f"sleep: {unfinished} requests are unfinished (let them finish or abort them)"
            )
        self._finish_in_flight()  # the last step: only finished requests' dropped tokens
        self.scheduler.pool.reset_prefix_cache()  # the cached blocks' contents go
        freed = 0 if self.runner.kv_released else self.runner.release_kv()
        if level == 2:
            self.runner.release_params()
        self.sleep_level = max(self.sleep_level, level)
        self.stats = self._snapshot()
        return freed

    def wake_up(self) -> None:
        """Restores a fresh KV pool after :meth:`sleep`; after level 2 the weights must
        have come back first (:meth:`update_weights`)."""
        if self.sleep_level == 0:
            return
        if self.sleep_level == 2:
            raise RuntimeError("wake_up: the weights were dropped (sleep level 2); give new params")
        self.runner.restore_kv()
        self.sleep_level = 0

    def add_lora(self, name: str, weights: Any, path: str) -> bool:  # noqa: ANN401
        """Registers adapter ``name`` (LoraWeights read by the caller); False when that name
        is registered already with the same path (ValueError with another)."""
        if self.lora is None:
            raise ValueError("LoRA is not enabled (enable_lora=True, --enable-lora)")
        if name in self.lora.registered:
            if self.lora.registered[name][1] == path:
                return False
            raise ValueError(f"LoRA adapter {name!r} is already loaded (unload it first)")
        self.lora.register(name, weights, path)
        return True

    def remove_lora(self, name: str) -> None:
        """Unregisters adapter ``name`` (ValueError if unknown or in use by a request).
        Its cached prefixes go too: a later adapter may take the name."""
        if self.lora is None or name not in self.lora.registered:
            raise ValueError(f"LoRA adapter {name!r} is not loaded")
        users = sum(r.lora_name == name for r in self.scheduler.requests.values())
        if users:
            raise ValueError(f"LoRA adapter {name!r} is in use by {users} unfinished requests")
        self.scheduler.lora_slots.forget(name)
        self.lora.unregister(name)
        self.scheduler.pool.reset_prefix_cache()

    # ------------------------------------------------------------------ private
    def _finish_in_flight(self) -> None:
        if self._in_flight is not None:
            plan, pending = self._in_flight
            self._in_flight = None
            self._admin_outputs += self._apply(plan, self.runner.collect(pending))

    def _drain_inbox(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                outputs += self._admin_outputs
                self._admin_outputs = []
                return outputs
            if isinstance(item, _Call):
                if item.future.set_running_or_notify_cancel():
                    try:
                        item.future.set_result(item.fn())
                    except Exception as exc:  # noqa: BLE001 - the caller gets it
                        item.future.set_exception(exc)
            elif isinstance(item, _Abort):
                ids, out = self.outputs.end(item.request_id, "abort")
                for sid in ids:
                    self.scheduler.abort(sid)
                if out is not None:
                    outputs.append(out)
            else:
                outputs += self._admit(item)

    def _admit(self, item: EngineRequest) -> list[RequestOutput]:
        """Hands a request to the scheduler. The caller validated it; if the scheduler still
        refuses it, that request ends with an error and nobody else notices."""
        if item.request_id in self.outputs:
            logger.error("request_id %r is already in use; dropped", item.request_id)
            return []
        ids = self.outputs.add(
            item.request_id,
            prompt=item.prompt,
            prompt_token_ids=item.prompt_token_ids,
            params=item.params,
            kind=item.output_kind,
            arrival_time=item.arrival_time,
        )
        if self.sleep_level:
            # queued before the engine went to sleep: it ends with the error a caller
            # adding it now would get
            why = f"EngineAsleepError: {asleep_message(self.sleep_level)}"
            _, out = self.outputs.end(item.request_id, "error", why)
            return [] if out is None else [out]
        n = len(ids)
        try:
            lora = item.lora_name
            if lora is not None and (self.lora is None or lora not in self.lora.registered):
                raise ValueError(f"LoRA adapter {lora!r} is not loaded")
            for i, sid in enumerate(ids):
                self.scheduler.add_request(
                    Request(
                        request_id=sid,
                        prompt_token_ids=list(item.prompt_token_ids),
                        sampling_params=item.params,
                        eos_token_ids=self.eos_token_ids,
                        prompt=item.prompt,
                        parent_id=None if n == 1 else item.request_id,
                        sample_index=i,
                        arrival_time=item.arrival_time,
                        lora_name=lora,
                        images=item.images,
                        pooling=item.pooling,
                    )
                )
            spec = item.params.structured_output
            if spec is not None:
                if self.grammars is None:
                    raise ValueError("structured_output needs a tokenizer (this engine has none)")
                for sid in ids:
                    self.grammars.add(sid, spec)
        except ValueError as exc:
            logger.error("request %r refused by the scheduler: %s", item.request_id, exc)
            for sid in ids:
                self.scheduler.abort(sid)
            _, out = self.outputs.end(item.request_id, "error", f"ValueError: {exc}")
            return [] if out is None else [out]
        self._prompt_tokens_total += len(item.prompt_token_ids)
        return []

    def _apply(self, plan: SchedulerOutput, result: RunnerOutput) -> list[RequestOutput]:
        live = self.scheduler.requests  # an aborted request's late hidden state is dropped
        self.pooled_hidden.update((k, v) for k, v in result.pooled_hidden.items() if k in live)
        updates = self.scheduler.update(plan, result)
        if self.grammars:
            updates = self._advance_grammars(updates)
        self._generation_tokens_total += sum(len(u.new_token_ids) for u in updates)
        return self.outputs.process(updates, self._finish_on_stop_string)

    def _grammar_masks(self, plan: SchedulerOutput) -> dict[int, np.ndarray]:
        """Sequence index -> the allowed-token mask of each grammar request that samples in
        this plan (its matcher has seen all its tokens: the scheduler saw to that); for one
        that verifies drafts, the mask of each verified position ([d + 1, W]), made here
        for n-gram drafts and after the drafting for drafts made on the device."""
        if not self.grammars:
            return {}
        rows = [i for i, s in enumerate(plan.seqs) if s.do_sample and s.request_id in self.grammars]
        if not rows:
            return {}
        drafting = [i for i in rows if plan.seqs[i].num_draft_tokens]
        rows = [i for i in rows if not plan.seqs[i].num_draft_tokens]
        out: dict[int, np.ndarray] = {}
        if rows:
            masks = self.grammars.masks([plan.seqs[i].request_id for i in rows])
            out.update(zip(rows, masks, strict=True))
        if drafting and not self.scheduler.proposer.drafts_on_host:
            # drafts made on the device: the runner reads them back before the target's
            # step and makes these masks then (jaxpaged.worker.spec_grammar)
            walk = self.grammars.masks_through
            pending = {i: functools.partial(walk, plan.seqs[i].request_id) for i in drafting}
            return DraftMasks(out, pending)
        for i in drafting:
            s = plan.seqs[i]
            out[i] = self.grammars.masks_through(s.request_id, s.token_ids[-s.num_draft_tokens :])
        return out

    def _advance_grammars(self, updates: list[RequestUpdate]) -> list[RequestUpdate]:
        """Feeds new tokens to their requests' matchers; a request whose grammar has ended
        (or that broke it) stops there: tokens after it in the same update (accepted drafts
        and the token after them) are dropped, as one-token decoding would have stopped."""
        out = []
        for u in updates:
            if u.request_id in self.grammars and u.new_token_ids:
                ends = _grammar_end(self.grammars, u)
                if ends is not None and (not u.finished or ends < len(u.new_token_ids)):
                    if not u.finished:
                        self.scheduler.finish(u.request_id, RequestStatus.FINISHED_STOPPED)
                    u = dataclasses.replace(
                        u,
                        new_token_ids=u.new_token_ids[:ends],
                        new_logprobs=u.new_logprobs[:ends],
                        finish_reason="stop",
                        stop_reason=None,
                    )
            out.append(u)
        self.grammars.retain(self.scheduler.requests)
        return out

    def _finish_on_stop_string(self, sample_id: str, stop: str) -> None:
        self.scheduler.finish(sample_id, RequestStatus.FINISHED_STOPPED, stop_reason=stop)

    def _num_cached_tokens(self, sample_id: str) -> int:
        req = self.scheduler.get_request(sample_id)
        return 0 if req is None else req.num_cached_tokens

    def _snapshot(self) -> EngineStats:
        s = self.scheduler
        st = s.stats
        tier = s.pool.tier
        compiles = self._compilations()
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            num_swapped=len(s.swapped),
            kv_cache_usage=s.kv_cache_usage(),
            kv_cache_waste=self._waste_sum / self._waste_steps if self._waste_steps else 0.0,
            num_kv_blocks=self.num_kv_blocks,
            num_free_blocks=s.pool.num_free_blocks,
            num_preemptions=st.num_preemptions,
            prefix_cache_queries=st.prefix_cache_queries,
            prefix_cache_hits=st.prefix_cache_hits,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            num_steps=st.num_steps,
            num_compilations=compiles,
            num_compilations_after_warmup=compiles - self._compilations_at_warmup,
            spec_decode_num_drafts=st.spec_num_drafts,
            spec_decode_num_draft_tokens=st.spec_num_draft_tokens,
            spec_decode_num_accepted_tokens=st.spec_num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=tuple(st.spec_accepted_per_pos),
            running_lora_adapters=_adapter_names(s.running),
            waiting_lora_adapters=_adapter_names([*s.waiting, *s.swapped]),
            max_loras=0 if s.lora_slots is None else s.lora_slots.max_loras,
            kv_offload_hits=st.kv_offload_hits,
            kv_offload_blocks_stored=st.kv_offload_blocks_stored,
            kv_offload_blocks_loaded=st.kv_offload_blocks_loaded,
            kv_offload_bytes_stored=st.kv_offload_blocks_stored * s.bytes_per_block,
            kv_offload_bytes_loaded=st.kv_offload_blocks_loaded * s.bytes_per_block,
            kv_offload_num_blocks=0 if tier is None else len(tier),
            kv_offload_capacity_blocks=0 if tier is None else tier.num_slots,
            kv_offload_disk_blocks_stored=st.kv_offload_disk_blocks_stored,
            kv_offload_disk_blocks_loaded=st.kv_offload_disk_blocks_loaded,
            **_image_stats(self.runner),
        )


def _image_stats(runner: object) -> dict[str, float | int]:
    """A vision model's encoder-cache counters (jaxpaged.worker.images), else none."""
    images = getattr(runner, "images", None)
    return {} if images is None else images.stats()


def _adapter_names(requests: Iterable[Request]) -> tuple[str, ...]:
    """The distinct LoRA adapter names of ``requests``, sorted."""
    return tuple(sorted({r.lora_name for r in requests if r.lora_name is not None}))


def asleep_message(level: int) -> str:
    """What a request that reaches a sleeping engine is told (EngineAsleepError's text)."""
    return (
        f"the engine is asleep (sleep level {level}): its KV cache is freed; call wake_up() "
        "before sending requests"
    )


class EngineStepError(RuntimeError):
    """A step failed on the device; ``outputs`` are the final (error) outputs of every
    request that was in flight."""

    def __init__(self, outputs: list[RequestOutput]) -> None:
        super().__init__("engine step failed")
        self.outputs = outputs


def _grammar_end(grammars: GrammarMatchers, u: RequestUpdate) -> int | None:
    """How many of the update's tokens stand when its request's grammar ends (or breaks)
    at one of them (that token included), else None (the matcher has seen them all)."""
    for n, t in enumerate(u.new_token_ids, 1):
        if not grammars.accept(u.request_id, t):
            return n
    return None
