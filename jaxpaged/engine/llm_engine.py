"""LLMEngine: the synchronous step loop that ties scheduler, runner and detokenizer together.

``add_request`` validates and queues; each ``step`` schedules (host), executes (device),
updates the scheduler with the sampled tokens, detokenizes them (stop strings end requests
here) and returns a RequestOutput for every user request that changed. ``n > 1`` becomes n
scheduler Requests of one group that share the prompt's blocks.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import jax

from jaxpaged.args import EngineArgs
from jaxpaged.config import CacheConfig, ParallelConfig, SchedulerConfig
from jaxpaged.engine.detokenizer import IncrementalDetokenizer
from jaxpaged.engine.fair_lock import FairLock
from jaxpaged.kernels.cpu.host_malloc import jax_will_run_on_cpu, keep_step_buffers
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.llama import Params
from jaxpaged.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxpaged.sampling_params import SamplingParams, validate_prompt
from jaxpaged.sched.request import Request, RequestStatus
from jaxpaged.sched.scheduler import Scheduler
from jaxpaged.worker.compile_counter import CompileCounter, enable_persistent_cache
from jaxpaged.worker.kv_cache import (
    KVLayout,
    configure_device_memory,
    device_kv_budget,
    num_blocks_for,
)
from jaxpaged.worker.runner import Runner

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int]


class EngineDeadError(RuntimeError):
    """The engine failed while serving; no request can be served any more."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineStats:
    """A snapshot of the engine's gauges and counters (for metrics endpoints and tests)."""

    num_running: int
    num_waiting: int
    num_swapped: int
    kv_cache_usage: float
    kv_cache_waste: float  # mean over steps of 1 - stored tokens / slots of held blocks
    num_kv_blocks: int
    num_free_blocks: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_steps: int
    num_compilations: int  # since the engine started, warm-up included
    num_compilations_after_warmup: int


@dataclasses.dataclass(eq=False)
class _Group:
    """One user request: its n samples and their detokenizers."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    samples: list[Request]
    detokenizers: list[IncrementalDetokenizer]
    texts: list[str]
    arrival_time: float
    first_scheduled_time: float | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return all(r.is_finished for r in self.samples)


class LLMEngine:
    """Synchronous engine. Thread-safe: every public method takes the engine lock."""

    def __init__(
        self,
        *,
        model_config: ModelConfig,
        params: Params,
        tokenizer: Any,
        cache_config: CacheConfig | None = None,
        scheduler_config: SchedulerConfig | None = None,
        parallel_config: ParallelConfig | None = None,
        dtype: str | None = None,
        seed: int = 0,
        enforce_eager: bool = False,
        attention_backend: str | None = None,
        show_progress: bool = True,
        eos_token_ids: Sequence[int] | None = None,
    ) -> None:
        cache_config = cache_config or CacheConfig()
        # again for engines built on params in hand (JAX started: the thresholds still take)
        configure_process(cache_config.gpu_memory_utilization)
        scheduler_config = scheduler_config or SchedulerConfig()
        parallel_config = parallel_config or ParallelConfig()
        self.mesh = None
        if parallel_config.tensor_parallel_size > 1:
            from jaxpaged.distributed.parallel import make_mesh, shard_params

            self.mesh = make_mesh(parallel_config.tensor_parallel_size)
            model_config, params = shard_params(model_config, params, self.mesh)
        self.parallel_config = parallel_config
        self.model_config = model_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.tokenizer = tokenizer
        self._lock = FairLock()  # a step cannot starve an abort or add_request
        self.compile_cache_dir = enable_persistent_cache()
        self._compiles = CompileCounter().open()

        kv_dtype = dtype or str(_params_dtype(params))

        def layout_of(num_blocks: int) -> KVLayout:
            return KVLayout(
                num_layers=model_config.num_layers,
                num_blocks=num_blocks,
                block_size=cache_config.block_size,
                num_kv_heads=model_config.num_kv_heads,
                head_dim=model_config.head_dim,
                dtype=kv_dtype,
            )

        def runner_for(layout: KVLayout) -> Runner:
            return Runner(
                model_config=model_config,
                params=params,
                layout=layout,
                max_num_seqs=scheduler_config.max_num_seqs,
                max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
                max_model_len=scheduler_config.max_model_len,
                seed=seed,
                attention_backend=attention_backend,
                mesh=self.mesh,
            )

        available = None
        if cache_config.num_kv_blocks is None and cache_config.kv_cache_memory is None:
            if jax.local_devices()[0].platform != "cpu":
                # profile: the largest step's scratch memory, with a one-sequence pool
                probe = runner_for(
                    layout_of(-(-scheduler_config.max_model_len // cache_config.block_size))
                )
                activations = probe.activation_bytes()
                del probe
                available = device_kv_budget(
                    gpu_memory_utilization=cache_config.gpu_memory_utilization,
                    activation_bytes=activations,
                )
                if available is not None and self.mesh is not None:
                    available *= self.mesh.size  # the pool is split over the mesh
                if available is not None and jax.process_count() > 1:
                    from jaxpaged.distributed.multihost import agree_min_bytes

                    available = agree_min_bytes(available)  # every host: the same pool
        num_blocks = num_blocks_for(
            model_config,
            block_size=cache_config.block_size,
            dtype=kv_dtype,
            max_model_len=scheduler_config.max_model_len,
            num_kv_blocks=cache_config.num_kv_blocks,
            kv_cache_memory=cache_config.kv_cache_memory,
            available_bytes=available,
        )
        self.layout = layout_of(num_blocks)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.3f GiB), %d tokens, %.1f sequences of "
            "max_model_len=%d",
            num_blocks,
            cache_config.block_size,
            num_blocks * self.layout.bytes_per_block / 2**30,
            num_blocks * cache_config.block_size,
            num_blocks * cache_config.block_size / scheduler_config.max_model_len,
            scheduler_config.max_model_len,
        )
        self.runner = runner_for(self.layout)
        self.scheduler = Scheduler(
            scheduler_config,
            cache_config,
            num_blocks=num_blocks,
            bytes_per_block=self.layout.bytes_per_block,
        )
        self.eos_token_ids = _eos_ids(model_config, tokenizer, eos_token_ids)
        self._groups: dict[str, _Group] = {}
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._waste_sum = 0.0
        self._waste_steps = 0
        self.warmup_programs = 0
        self.warmup_seconds = 0.0
        if not enforce_eager:
            swap = scheduler_config.preemption_mode == "swap"
            self.warmup_programs, self.warmup_seconds = self.runner.warm_up(
                swap=swap, show_progress=show_progress
            )
            logger.info(
                "warm-up compiled %d programs in %.1f s", self.warmup_programs, self.warmup_seconds
            )
        self._compiles_at_warmup = self._compiles.count

    # ------------------------------------------------------------ construction
    @classmethod
    def from_engine_args(
        cls,
        args: EngineArgs,
        *,
        model_config: ModelConfig | None = None,
        params: Params | None = None,
        tokenizer: Any = None,
        eos_token_ids: Sequence[int] | None = None,
    ) -> LLMEngine:
        """The one construction path: an engine over ``params`` already in memory (with their
        ``model_config``, a tokenizer for text prompts, extra EOS ids), or, without params,
        over ``args.model`` loaded. The settings the model does not decide are checked before
        any weight is read."""
        cache_config, parallel_config = args.cache_config(), args.parallel_config()
        if params is None:
            if model_config is not None or tokenizer is not None or eos_token_ids is not None:
                raise ValueError(
                    "model_config, tokenizer and eos_token_ids come with params "
                    "(without params, args.model is loaded with its own)"
                )
            model_config, params, tokenizer, eos_token_ids = cls._load(args, parallel_config)
        else:
            cls._check_in_memory(args, model_config, params)
        return cls(
            model_config=model_config,
            params=params,
            tokenizer=tokenizer,
            cache_config=cache_config,
            scheduler_config=args.scheduler_config(model_config),
            parallel_config=parallel_config,
            seed=args.seed,
            enforce_eager=args.enforce_eager,
            attention_backend=args.attention_backend,
            show_progress=args.show_progress,
            eos_token_ids=eos_token_ids,
        )

    @staticmethod
    def _load(
        args: EngineArgs, parallel_config: ParallelConfig
    ) -> tuple[ModelConfig, Params, Any, tuple[int, ...]]:
        """(config, params, tokenizer, EOS ids) of ``args.model`` (None = the bundled SmolLM2;
        a folder, hub id or .gguf file), the weights sent straight to their shards."""
        from jaxpaged.distributed.loading import load_params
        from jaxpaged.distributed.parallel import make_mesh
        from jaxpaged.models import load_tokenizer
        from jaxpaged.models.loader import load_eos_token_ids
        from jaxpaged.models.resolve import resolve_model_folder

        configure_process(args.gpu_memory_utilization)  # before the load starts JAX
        n = parallel_config.tensor_parallel_size
        mesh = make_mesh(n) if n > 1 else None
        folder = resolve_model_folder(args.model)
        # Orbax folders (jaxpaged.convert) are detected
        model_config, params = load_params(
            folder, mesh=mesh, dtype=args.load_dtype, progress=args.show_progress
        )
        eos = load_eos_token_ids(folder, model_config)
        return model_config, params, load_tokenizer(folder), eos

    @staticmethod
    def _check_in_memory(
        args: EngineArgs, model_config: ModelConfig | None, params: Params
    ) -> None:
        """ValueError for settings that contradict params already in memory."""
        if model_config is None:
            raise ValueError("params need their model_config")
        if args.model is not None:
            raise ValueError(f"give either model ({args.model!r}) or params, not both")
        have = str(_params_dtype(params))
        if args.load_dtype is not None and args.load_dtype != have:
            raise ValueError(
                f"dtype={args.dtype!r}, but the params given are {have}: dtype applies when "
                "loading a model (cast the params, or leave dtype unset)"
            )

    @classmethod
    def from_args(cls, model: str | os.PathLike | None = None, **kwargs: Any) -> LLMEngine:
        """Loads ``model`` (None = the bundled SmolLM2; a folder, hub id or .gguf file) and
        builds the engine around it; ``kwargs`` are :class:`EngineArgs` fields."""
        return cls.from_engine_args(EngineArgs.from_kwargs(model=model, **kwargs))

    @classmethod
    def from_params(
        cls,
        model_config: ModelConfig,
        params: Params,
        tokenizer: Any = None,
        *,
        eos_token_ids: Sequence[int] | None = None,
        **kwargs: Any,
    ) -> LLMEngine:
        """An engine over params already in memory; ``kwargs`` are :class:`EngineArgs`
        fields (vLLM's flat arguments; ``max_model_len`` defaults to the model's)."""
        return cls.from_engine_args(
            EngineArgs.from_kwargs(**kwargs),
            model_config=model_config,
            params=params,
            tokenizer=tokenizer,
            eos_token_ids=eos_token_ids,
        )

    # ---------------------------------------------------------------- requests
    @property
    def max_model_len(self) -> int:
        return self.scheduler_config.max_model_len

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt given as text or ids; text prompts get the tokenizer's
        special tokens (BOS where the model uses one)."""
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Sequence):
            raise ValueError(f"prompt must be a string or a list of token ids, got {prompt!r}")
        return None, list(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
    ) -> None:
        """Validates (ValueError naming the problem) and queues one request of params.n
        samples."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        text, ids = self.tokenize(prompt)
        validate_prompt(ids, self.max_model_len, self.model_config.vocab_size, params)
        arrival = time.time() if arrival_time is None else arrival_time
        with self._lock:
            if request_id in self._groups:
                raise ValueError(f"request_id {request_id!r} is already in use")
            samples = [
                Request(
                    request_id=request_id if params.n == 1 else f"{request_id}#{i}",
                    prompt_token_ids=ids,
                    sampling_params=params,
                    eos_token_ids=self.eos_token_ids,
                    prompt=text,
                    parent_id=None if params.n == 1 else request_id,
                    sample_index=i,
                    arrival_time=arrival,
                )
                for i in range(params.n)
            ]
            added: list[Request] = []
            try:
                for r in samples:
                    self.scheduler.add_request(r)
                    added.append(r)
            except Exception:
                for r in added:
                    self.scheduler.abort(r.request_id)
                raise
            self._groups[request_id] = _Group(
                request_id=request_id,
                prompt=text,
                prompt_token_ids=tuple(ids),
                samples=samples,
                detokenizers=[
                    IncrementalDetokenizer(
                        self.tokenizer,
                        ids,
                        skip_special_tokens=params.skip_special_tokens,
                        stop=params.stop,
                        include_stop_str_in_output=params.include_stop_str_in_output,
                    )
                    for _ in samples
                ],
                texts=["" for _ in samples],
                arrival_time=arrival,
            )
            self._prompt_tokens_total += len(ids)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Ends a request in any state, freeing its blocks; returns its final output
        (finish_reason "abort"), or None if the id is unknown or already finished."""
        with self._lock:
            group = self._groups.pop(request_id, None)
            if group is None:
                return None
            for r in group.samples:
                self.scheduler.abort(r.request_id)
            return self._output(group)

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix, so the next prompts are computed in full (benchmark
        rounds that repeat a workload). Blocks in use keep their contents."""
        with self._lock:
            self.scheduler.pool.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self._groups)

    @property
    def num_unfinished_requests(self) -> int:
        with self._lock:
            return len(self._groups)

    # -------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """One scheduling + execution round. If the device step raises, every in-flight
        request ends with finish_reason "error" (blocks freed) and the error propagates."""
        with self._lock:
            plan = self.scheduler.schedule()
            if not plan.has_work:
                return []
            now = time.time()
            touched: dict[str, _Group] = {}
            for seq in plan.seqs:
                group = self._groups[seq.request.group_id]
                if group.first_scheduled_time is None:
                    group.first_scheduled_time = now
            try:
                runner_out = self.runner.execute(plan, self.eos_token_ids)
            except Exception as exc:
                self._fail_all(exc)
                raise
            for update in self.scheduler.update(plan, runner_out):
                req = update.request
                group = self._groups[req.group_id]
                touched[group.request_id] = group
                i = req.sample_index
                self._generation_tokens_total += len(update.new_token_ids)
                delta, stopped = group.detokenizers[i].add_tokens(update.new_token_ids)
                group.texts[i] += delta
                if stopped and not req.is_finished:
                    self.scheduler.finish(
                        req.request_id,
                        RequestStatus.FINISHED_STOPPED,
                        stop_reason=group.detokenizers[i].stop_reason,
                    )
                if req.is_finished and not stopped:
                    group.texts[i] += group.detokenizers[i].flush()
            if plan.seqs:
                self._waste_sum += self.scheduler.kv_cache_waste()
                self._waste_steps += 1
            outputs = []
            for group in touched.values():
                outputs.append(self._output(group))
                if group.finished:
                    del self._groups[group.request_id]
            return outputs

    def _fail_all(self, exc: BaseException) -> None:
        logger.exception("engine step failed; ending %d requests", len(self._groups))
        for group in self._groups.values():
            group.error = f"{type(exc).__name__}: {exc}"
            for r in group.samples:
                if not r.is_finished:
                    self.scheduler.finish(r.request_id, RequestStatus.FINISHED_ERROR)

    def fail_all(self, exc: BaseException) -> list[RequestOutput]:
        """Ends every request with an error (used when the engine must stop serving)."""
        with self._lock:
            self._fail_all(exc)
            outs = [self._output(g) for g in self._groups.values()]
            self._groups.clear()
            return outs

    def _output(self, group: _Group) -> RequestOutput:
        completions = []
        for i, r in enumerate(group.samples):
            logprobs = None
            if r.sampling_params.logprobs is not None:
                logprobs = tuple(
                    Logprob(token_id=t, logprob=lp, top=top)
                    for t, (lp, top) in zip(r.output_token_ids, r.output_logprobs, strict=False)
                )
            completions.append(
                CompletionOutput(
                    index=i,
                    text=group.texts[i],
                    token_ids=tuple(r.output_token_ids),
                    logprobs=logprobs,
                    finish_reason=r.finish_reason,
                    stop_reason=r.stop_reason,
                )
            )
        first_tokens = [r.first_token_time for r in group.samples if r.first_token_time]
        finish_times = [r.finish_time for r in group.samples if r.finish_time]
        finished = group.finished
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=tuple(completions),
            finished=finished,
            metrics=RequestMetrics(
                arrival_time=group.arrival_time,
                first_scheduled_time=group.first_scheduled_time,
                first_token_time=min(first_tokens) if first_tokens else None,
                finished_time=max(finish_times) if finished and finish_times else None,
            ),
            num_cached_tokens=group.samples[0].num_cached_tokens,
            error=group.error,
        )

    # ----------------------------------------------------------------- metrics
    def get_stats(self) -> EngineStats:
        with self._lock:
            s = self.scheduler
            st = s.stats
            compiles = self._compiles.count
            return EngineStats(
                num_running=len(s.running),
                num_waiting=len(s.waiting),
                num_swapped=len(s.swapped),
                kv_cache_usage=s.kv_cache_usage(),
                kv_cache_waste=self._waste_sum / self._waste_steps if self._waste_steps else 0.0,
                num_kv_blocks=self.layout.num_blocks,
                num_free_blocks=s.pool.num_free_blocks,
                num_preemptions=st.num_preemptions,
                prefix_cache_queries=st.prefix_cache_queries,
                prefix_cache_hits=st.prefix_cache_hits,
                prompt_tokens_total=self._prompt_tokens_total,
                generation_tokens_total=self._generation_tokens_total,
                num_steps=st.num_steps,
                num_compilations=compiles,
                num_compilations_after_warmup=compiles - self._compiles_at_warmup,
            )

    @property
    def engine_config(self) -> dict[str, object]:
        """A flat summary of how the engine was configured (for server info endpoints)."""
        out: dict[str, object] = {
            "model_type": self.model_config.model_type,
            "dtype": self.layout.dtype,
            "tensor_parallel_size": self.parallel_config.tensor_parallel_size,
            "num_kv_blocks": self.layout.num_blocks,
            "kv_cache_bytes": self.layout.num_blocks * self.layout.bytes_per_block,
            "warmup_programs": self.warmup_programs,
            "warmup_seconds": round(self.warmup_seconds, 3),
        }
        out.update(dataclasses.asdict(self.cache_config))
        out.update(dataclasses.asdict(self.scheduler_config))
        return out

    def close(self) -> None:
        self._compiles.close()


def configure_process(gpu_memory_utilization: float) -> None:
    """Process settings that only take before JAX starts (later, only the malloc thresholds
    do): device memory for the KV pool (kv_cache.configure_device_memory) and, on a
    CPU-only JAX, the malloc tuning that lets XLA reuse each step's scratch (host_malloc).
    Idempotent: every engine applies it; from_args and serve before they start JAX."""
    configure_device_memory(gpu_memory_utilization)
    if jax_will_run_on_cpu():
        keep_step_buffers()


def _params_dtype(params: Params) -> Any:
    return params["embed"].dtype


def _eos_ids(config: ModelConfig, tokenizer: Any, extra: Sequence[int] | None) -> tuple[int, ...]:
    ids = list(dict.fromkeys([*config.eos_token_ids, *(extra or ())]))
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if tok_eos is not None and tok_eos not in ids:
        ids.append(tok_eos)
    return tuple(ids)
