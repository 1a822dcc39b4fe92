"""LLMEngine: builds an engine (model, KV pool, runner, scheduler) and drives its
:class:`~jaxpaged.engine.core.EngineCore` from the calling thread.

``add_request`` validates in the caller's thread (:mod:`jaxpaged.engine.input_processor`) and
puts the request on the core's inbox; each ``step`` runs one overlapped iteration of the core
(plan and dispatch step k, finish step k-1) and returns the outputs it produced: deltas, or
final outputs, as each request asked. ``LLM`` uses it this way; ``AsyncEngine`` runs the same
core on a thread of its own.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxpaged.args import EngineArgs
from jaxpaged.config import (
    CacheConfig,
    LoraConfig,
    MultiModalConfig,
    ParallelConfig,
    ProcessConfig,
    SchedulerConfig,
)
from jaxpaged.engine.core import EngineCore, EngineStepError, asleep_message
from jaxpaged.engine.engine_setup import (
    check_one_replica,
    check_processors,
    dtype_of,
    eos_ids,
    image_setup,
    load_model,
    load_speculative_models,
    model_for_engine,
    shard_for_tp,
    spec_defaults,
)
from jaxpaged.engine.input_processor import InputProcessor
from jaxpaged.engine.kv_plan import KVPlan
from jaxpaged.engine.lora import LoRARequest, build_adapters, read_adapter
from jaxpaged.engine.platform_choice import engine_platform
from jaxpaged.engine.pooled_requests import PooledOutput, PooledResults, pooling_request
from jaxpaged.engine.process import apply_process_config, program_store
from jaxpaged.engine.protocol import EngineAsleepError, EngineDeadError, EngineStats, Prompt
from jaxpaged.engine.spec_builder import (
    check_eagle,
    check_spec_inputs,
    draft_beside,
    head_params_in,
)
from jaxpaged.engine.warm_start import warm_start
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.eagle3 import Eagle3Config
from jaxpaged.models.llama import Params
from jaxpaged.outputs import RequestOutput, RequestOutputKind
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.sched.scheduler import Scheduler
from jaxpaged.spec import SpeculativeConfig
from jaxpaged.worker.compile_counter import CompileCounter
from jaxpaged.worker.grammar import GrammarCompiler, GrammarMatchers
from jaxpaged.worker.kv_cache import KVLayout, kv_storage_dtype
from jaxpaged.worker.logits_processors import LogitsProcessor
from jaxpaged.worker.runner import Runner
from jaxpaged.worker.weights import ParamsSpec

logger = logging.getLogger(__name__)

__all__ = ["EngineDeadError", "EngineStats", "LLMEngine", "Prompt"]


class LLMEngine:
    """Synchronous engine: one thread (the caller's) drives it. ``add_request`` and
    ``abort`` may also come from other threads: they only queue."""

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
        process_config: ProcessConfig | None = None,
        logits_processors: Sequence[LogitsProcessor] = (),
        graphdef: Any = None,
        lora_config: LoraConfig | None = None,
        speculative_config: SpeculativeConfig | None = None,
        draft: tuple[ModelConfig, Params] | None = None,
        eagle: tuple[Eagle3Config, dict[str, Any]] | None = None,
        mm_config: MultiModalConfig | None = None,
    ) -> None:
        """``params`` is the model's state; ``graphdef`` the NNX graph definition of a model
        of the paged-model protocol (docs/models.md; None: the Llama family of
        ``model_config``); ``speculative_config``: speculative decoding (None: off);
        ``draft``: the draft model's (config, params) for its method ``draft_model``;
        ``eagle``: the EAGLE-3 head's (config, params) for method ``eagle3``;
        ``mm_config``: a vision-language model's image limits (its config has an ``image``
        ImageSpec, models/gemma3_vl.py)."""
        cache_config = cache_config or CacheConfig()
        logits_processors = check_processors(logits_processors)
        check_spec_inputs(speculative_config, draft=draft, eagle=eagle)
        # only what was asked for; again for engines built on params in hand (JAX started:
        # the malloc thresholds still take)
        process_config = process_config or ProcessConfig()
        self.compile_cache_dir = apply_process_config(
            process_config, gpu_memory_utilization=cache_config.gpu_memory_utilization
        )
        scheduler_config = scheduler_config or SchedulerConfig()
        parallel_config = parallel_config or ParallelConfig()
        check_one_replica(parallel_config)
        # what update_weights takes: the params as given, before sharding / KV replication
        self._given_config = model_config
        self._given_spec = ParamsSpec.of(params)
        self.mesh, model_config, params = shard_for_tp(
            parallel_config, model_config, params, own_model=graphdef is not None
        )
        self.parallel_config = parallel_config
        self.model_config = model_config
        self.cache_config = cache_config
        self.tokenizer = tokenizer
        self._compiles = CompileCounter().open()
        # JAX's listeners are process-wide: an engine dropped unclosed stops counting too
        weakref.finalize(self, self._compiles.close)
        self.lora = build_adapters(
            lora_config or LoraConfig(),
            model_config,
            dtype_of(params),
            own_model=graphdef is not None,
            tensor_parallel_size=parallel_config.tensor_parallel_size,
            num_hosts=jax.process_count(),
        )

        params_dtype = dtype or str(dtype_of(params))
        kv_dtype = kv_storage_dtype(cache_config.kv_cache_dtype, params_dtype)
        # chosen once, here; the KV plan, the runner and the step only read it
        self.platform = engine_platform(
            model_config,
            params,
            graphdef=graphdef,
            params_dtype=params_dtype,
            kv_dtype=kv_dtype,
            block_size=cache_config.block_size,
            attention_backend=attention_backend,
            mesh=self.mesh,
        )
        speculative_config = spec_defaults(speculative_config, self.platform.device)
        pool_config = model_config  # what the KV pool holds: an EAGLE-3 head adds a layer
        if eagle is not None:
            pool_config = check_eagle(
                eagle[0],
                model_config,
                tensor_parallel_size=parallel_config.tensor_parallel_size,
                own_model=graphdef is not None,
            )
            eagle = (eagle[0], head_params_in(eagle[1], params_dtype))
        kv = KVPlan(
            model_config=pool_config,
            block_size=cache_config.block_size,
            dtype=kv_dtype,
            platform=self.platform,
        )

        mm = mm_config or MultiModalConfig()
        image_prompts, image_slots = image_setup(
            model_config, mm, scheduler_config, speculative_config, parallel_config
        )

        def runner_for(layout: KVLayout) -> Runner:
            return Runner(
                model_config=model_config,
                params=params,
                layout=layout,
                max_num_seqs=scheduler_config.max_num_seqs,
                max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
                max_model_len=scheduler_config.max_model_len,
                platform=self.platform,
                seed=seed,
                mesh=self.mesh,
                logits_processors=logits_processors,
                graphdef=graphdef,
                lora=self.lora,
                num_speculative_tokens=0
                if speculative_config is None
                else speculative_config.num_speculative_tokens,
                draft_slots=draft is not None,
                eagle=eagle,
                image_slots=image_slots,
                program_store=program_store(process_config.program_cache_dir, self.mesh),
                huge_pages=process_config.huge_pages,
            )

        eos = eos_ids(model_config, tokenizer, eos_token_ids)
        num_blocks = kv.num_blocks(
            cache_config,
            scheduler_config,
            activation_bytes=lambda layout: runner_for(layout).activation_bytes(),
            num_devices=1 if self.mesh is None else self.mesh.size,
        )
        bytes_per_block = kv.layout(1).bytes_per_block
        drafter = None
        if draft is not None:  # its pool shares the target's budget
            num_blocks, bytes_per_block, drafter = draft_beside(
                draft,
                model_config,
                speculative_config,
                scheduler_config,
                cache_config,
                num_blocks=num_blocks,
                bytes_per_block=bytes_per_block,
                attention_backend=attention_backend,
                mesh=self.mesh,
                seed=seed,
            )
        self.layout = kv.layout(num_blocks)
        self.runner = runner_for(self.layout)
        self.runner.drafter = drafter
        disk_dir = cache_config.kv_offloading_disk_dir
        if disk_dir is not None:  # the disk tier's files: the target's blocks (not a draft's)
            if drafter is not None:
                raise ValueError("kv_offloading_disk_dir is not supported with a draft model")
            os.makedirs(disk_dir, exist_ok=True)
            self.runner.moves.disk_dir = disk_dir
        self.scheduler = Scheduler(
            scheduler_config,
            cache_config,
            num_blocks=num_blocks,
            bytes_per_block=bytes_per_block,
            max_loras=0 if self.lora is None else self.lora.max_loras,
            step_sizes=self.runner.buckets.mixed_tokens,
            speculative_config=speculative_config,
        )
        self.speculative_config = speculative_config
        self.eos_token_ids = eos
        grammars = None  # structured output needs the tokenizer's token strings
        if tokenizer is not None:
            grammars = GrammarCompiler(tokenizer, model_config.vocab_size, eos_token_ids=eos)
        # EAGLE-3 with structured output: propose-only programs (jaxpaged.worker.spec_grammar)
        self.runner.eagle_grammar_drafts = grammars is not None and eagle is not None
        self.inputs = InputProcessor(
            grammars=grammars,
            tokenizer=tokenizer,
            vocab_size=model_config.vocab_size,
            max_model_len=scheduler_config.max_model_len,
            block_size=cache_config.block_size,
            num_kv_blocks=num_blocks,
            eos_token_ids=eos,
            logits_processors=[p.name for p in logits_processors],
            lora=self.lora,
            scheduling_policy=scheduler_config.scheduling_policy,
            images=image_prompts,
        )
        self.core = EngineCore(
            scheduler=self.scheduler,
            runner=self.runner,
            tokenizer=tokenizer,
            eos_token_ids=eos,
            num_kv_blocks=num_blocks,
            compilations=lambda: self._compiles.count,
            grammars=None if grammars is None else GrammarMatchers(grammars),
            lora=self.lora,
        )
        self._live: set[str] = set()  # user request ids added and not yet finished
        self._ready: list[RequestOutput] = []  # outputs produced outside step() (aborts)
        self.pooled = PooledResults()  # pooling requests (engine/paged_pooling.py)
        self.dead_error: BaseException | None = None
        # wake_up's reload after sleep(level=2), set by from_engine_args when it loaded them
        self._reload: Callable[[], Params] | None = None
        # params of a checkpoint folder / hub id / .gguf, loaded the way this engine's were
        self.weights_from: Callable[[str], Params] | None = None
        ready = warm_start(
            self.runner,
            self.scheduler,
            num_blocks=num_blocks,
            enforce_eager=enforce_eager,
            show_progress=show_progress,
            mark_compiled=self.core.mark_compiled,
        )
        self.warmup_programs, self.warmup_seconds = ready.programs, ready.seconds
        self.step_costs = ready.step_costs  # measured after warm-up; None where given

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
        graphdef: Any = None,
    ) -> LLMEngine:
        """The one construction path: an engine over ``params`` already in memory (with their
        ``model_config``, a tokenizer for text prompts, extra EOS ids), or, without params,
        over ``args.model`` loaded. The settings the model does not decide are checked before
        any weight is read."""
        cache_config, parallel_config = args.cache_config(), args.parallel_config()
        check_one_replica(parallel_config)  # before any weight is read
        lora_config = args.lora_config()
        process_config = args.process_config()
        loaded = params is None
        model_config, params, tokenizer, eos_token_ids = model_for_engine(
            args,
            parallel_config,
            model_config=model_config,
            params=params,
            tokenizer=tokenizer,
            eos_token_ids=eos_token_ids,
            own_model=graphdef is not None,
        )
        draft, eagle = load_speculative_models(args, parallel_config)
        engine = cls(
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
            process_config=process_config,
            logits_processors=args.logits_processors,
            graphdef=graphdef,
            lora_config=lora_config,
            speculative_config=args.speculative_config,
            draft=draft,
            eagle=eagle,
            mm_config=args.mm_config(),
        )
        # weights from a checkpoint later (the admin call, sleep level 2): loaded as the
        # engine's were, without touching the process again
        load_args = dataclasses.replace(args, configure_process=False, show_progress=False)
        engine.weights_from = lambda path: load_model(
            dataclasses.replace(load_args, model=path), parallel_config
        )[1]
        if loaded:
            engine._reload = lambda: engine.weights_from(args.model)
        return engine

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
    def scheduler_config(self) -> SchedulerConfig:
        """The scheduler's limits (with the prefill cap measured at start-up)."""
        return self.scheduler.config

    @property
    def max_model_len(self) -> int:
        return self.scheduler_config.max_model_len

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt given as text or ids."""
        return self.inputs.tokenize(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.DELTA,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validates (ValueError naming the problem) and queues one request of params.n
        samples; its outputs come from :meth:`step`, as deltas or as one final output.
        ``lora_request``: the LoRA adapter it runs with (registered first if new)."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine has failed: {self.dead_error}")
        if self.core.sleep_level:
            raise EngineAsleepError(asleep_message(self.core.sleep_level))
        request = self.inputs.process(
            request_id,
            prompt,
            params,
            arrival_time=arrival_time,
            output_kind=output_kind,
            in_use=self._live,
        )
        if lora_request is not None:
            self.add_lora(lora_request)
            request = dataclasses.replace(request, lora_name=lora_request.lora_name)
        self._live.add(request_id)
        self.core.add_request(request)

    def add_pooling_request(self, request_id: str, prompt: Prompt) -> None:
        """Queues a pooling request: a prefill, batched with the generation requests, whose
        final hidden state at the last prompt token :meth:`take_pooled` returns once a
        :meth:`step` finished it (its blocks freed then); it has no step output."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine has failed: {self.dead_error}")
        if self.core.sleep_level:
            raise EngineAsleepError(asleep_message(self.core.sleep_level))
        request = pooling_request(self.inputs, request_id, prompt, self._live)
        self._live.add(request_id)
        self.pooled.add(request_id)
        self.core.add_request(request)

    def take_pooled(self, request_id: str) -> PooledOutput | None:
        """A finished pooling request's hidden state (or error), once; None until then."""
        return self.pooled.take(request_id)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Ends a request in any state, freeing its blocks; returns its final output
        (finish_reason "abort"), or None if the id is unknown or already finished."""
        if request_id not in self._live:
            return None
        self.core.abort(request_id)
        mine = None
        for out in self.core.step_inbox():
            if out.request_id == request_id:
                mine = out
            else:
                self._ready.append(out)
        self._live.discard(request_id)
        self.pooled.forget(request_id, self.core.pooled_hidden)
        return mine

    # ----------------------------------------------------------------- LoRA
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Registers an adapter (read from ``lora_request.lora_path``; ValueError if LoRA is
        off, the name is taken by another path, or the adapter does not fit); False if it
        was registered already."""
        known = self.list_loras().get(getattr(lora_request, "lora_name", None))
        if known is not None and lora_request.lora_path in ("", known):
            return False
        weights = read_adapter(self.lora, lora_request)
        name, path = lora_request.lora_name, lora_request.lora_path
        return self._admin(lambda: self.core.add_lora(name, weights, path))

    def remove_lora(self, name: str) -> None:
        """Unregisters an adapter (ValueError if unknown or a request still uses it)."""
        self._admin(lambda: self.core.remove_lora(name))

    def list_loras(self) -> dict[str, str]:
        """Registered adapter name -> its folder."""
        # a copy first: the engine thread may register one meanwhile (dict copies are atomic)
        registered = {} if self.lora is None else dict(self.lora.registered)
        return {name: path for name, (_, path) in registered.items()}

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix, so the next prompts are computed in full (benchmark
        rounds that repeat a workload). Blocks in use keep their contents."""
        self.core.reset_prefix_cache()

    # ------------------------------------------------ weights and memory (admin)
    def prepare_weights(self, params: Params) -> Params:
        """New params checked against the engine's (ValueError naming the first leaf whose
        tree, shape or dtype differs) and, on a mesh, placed on it with the engine's
        shardings (arrays already there stay; others are resharded on the device). Any
        thread; no engine state is touched."""
        if jax.process_count() > 1:
            raise ValueError("update_weights: not supported on a multi-host engine")
        self._given_spec.check(params)
        if self.mesh is not None:
            from jaxpaged.distributed.parallel import shard_params

            _, params = shard_params(self._given_config, params, self.mesh)
        return params

    def update_weights(self, params: Params) -> None:
        """Swaps in new weights (same tree, shapes and dtypes) between steps, without
        recompiling or touching the KV pool; the prefix cache is reset. Params already on the
        device (or on the engine's mesh) are used as they are, and the engine keeps
        references to them: do not donate or delete them while it serves."""
        params = self.prepare_weights(params)
        self._admin(lambda: self.core.update_weights(params))

    def sleep(self, level: int = 1) -> int:
        """Frees the KV pool (level 1), and drops the engine's weights too (level 2), for a
        trainer to use the memory; until :meth:`wake_up`, ``add_request`` raises
        EngineAsleepError. Needs every request finished or aborted. Returns the KV bytes
        freed."""
        return self._admin(lambda: self.core.sleep(level))

    def wake_up(self, params: Params | None = None) -> None:
        """Restores the KV pool (empty: no prefix is cached); after ``sleep(level=2)`` the
        weights must be given (``params``) or reloaded (``reload_weights``). With params at
        any level, they replace the current weights as :meth:`update_weights` does."""
        if params is None and self.core.sleep_level == 2 and self._reload is not None:
            params = self._reload()
        if params is not None:
            self.update_weights(params)
        self._admin(self.core.wake_up)

    @property
    def reload_weights(self) -> Callable[[], Params] | None:
        """How the engine loads its weights again (None for an engine built on params)."""
        return self._reload

    @property
    def is_sleeping(self) -> bool:
        return self.core.sleep_level > 0

    def _admin(self, fn: Any) -> Any:  # noqa: ANN401
        """Runs ``fn`` through the core's inbox, then applies the inbox now: the caller's
        thread drives this engine, so it is the engine thread."""
        future = self.core.call(fn)
        self._ready += self.core.step_inbox()
        return future.result()

    def has_unfinished_requests(self) -> bool:
        return bool(self._live)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._live)

    # -------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """One overlapped iteration (see :class:`EngineCore`). If the device step raises,
        every request ends with finish_reason "error" (blocks freed), the engine is dead and
        the error propagates; the error outputs are in ``EngineStepError.outputs``."""
        outputs, self._ready = self._ready, []
        try:
            outputs += self.core.step()
        except EngineStepError as e:
            self.dead_error = e.__cause__
            self._live.clear()
            e.outputs[:0] = outputs
            raise
        for out in outputs:
            if out.finished:
                self._live.discard(out.request_id)
        return self.pooled.split(outputs, self.core.pooled_hidden)

    # ----------------------------------------------------------------- metrics
    def get_stats(self) -> EngineStats:
        """The snapshot taken after the latest step (never waits for the device)."""
        return self.core.stats

    @property
    def engine_config(self) -> dict[str, object]:
        """A flat summary of how the engine was configured (for server info endpoints)."""
        out: dict[str, object] = {
            "model_type": self.model_config.model_type,
            "dtype": self.layout.dtype,
            "attention_backend": self.platform.attention_backend,
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
        """Releases what the engine holds: its compiled programs, KV pool and weights (their
        device memory goes unless the caller holds the weights too), the compile counter and
        the step log. The engine cannot step afterwards; its metrics stay readable. Closing
        twice is harmless; an engine dropped without closing releases the same when it is
        collected."""
        self._compiles.close()
        if self.core.step_log is not None:
            self.core.step_log.close()
        self.runner.close()
