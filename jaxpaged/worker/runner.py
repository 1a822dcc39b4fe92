"""Runner: owns the device state (params, KV pool, per-sequence sampler state, the last step's
sampled tokens) and the persistent batch (:mod:`jaxpaged.worker.input_batch`: each running
request's block table and sampling settings, kept on the host between steps), pads each
scheduled step into a shape bucket (:mod:`jaxpaged.worker.buckets`) and dispatches the jitted
step without waiting for it.

``dispatch(plan)`` applies the plan's block swaps and copies and its sampler-state row fills,
applies its changes to the persistent batch, builds the padded batch and launches the step; it returns a :class:`PendingStep` at once, while the
device works. ``collect(pending)`` waits for that step and returns what it sampled. The engine
dispatches step N+1 before it collects step N, so the device never waits for the host: a
decode whose token the host has not seen yet reads it from the previous step's output on the
device (``StepBatch.prev_rows``).

Block moves (copy-on-write copies, swap, the prefix cache's host and disk tiers) are
:mod:`jaxpaged.worker.block_moves`'s: the runner hands each plan's pool to its BlockMover.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxpaged.distributed.parallel import kv_pool_sharding, replicated
from jaxpaged.kernels.platform import Platform
from jaxpaged.kernels.step_kernels import StepKernels
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.eagle3 import Eagle3Config
from jaxpaged.models.llama import Params
from jaxpaged.sampling_params import MAX_BANNED_IDS, MAX_LOGIT_BIAS, MAX_LOGPROBS
from jaxpaged.sched.output import RunnerOutput, ScheduledSeq, SchedulerOutput, StateRowInit
from jaxpaged.worker import sampler, spec_eagle, spec_grammar
from jaxpaged.worker.block_moves import BlockMover
from jaxpaged.worker.buckets import Bucket, BucketSet
from jaxpaged.worker.input_batch import InputBatch
from jaxpaged.worker.kv_cache import KVLayout
from jaxpaged.worker.logits_processors import LogitsProcessor
from jaxpaged.worker.logprob_rows import logprob_at, prompt_logprob_rows, prompt_logprobs_at
from jaxpaged.worker.lora import LoraAdapters
from jaxpaged.worker.model_hooks import ModelHooks
from jaxpaged.worker.patch_images import PatchImageEncoder, image_encoder
from jaxpaged.worker.pooled_rows import pooled_hidden, pooled_seqs
from jaxpaged.worker.program_store import ProgramStore
from jaxpaged.worker.programs import EnginePrograms
from jaxpaged.worker.step import StaticGraph, StepBatch, StepOutput
from jaxpaged.worker.weights import ParamsSpec

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, eq=False)
class PendingStep:
    """A dispatched step: its outputs are device arrays that may not be computed yet."""

    out: StepOutput
    num_seqs: int
    logprobs_wanted: tuple[int | None, ...]  # per sequence: top-k asked for, None = none
    # per sequence: (first row, its prompt targets, top-k asked for), None = none
    prompt_wanted: tuple[tuple[int, tuple[int, ...], int] | None, ...]
    failed: dict[str, str]  # sequences left out of the batch: request id -> reason
    # speculative decoding: verification rows per sequence (1: off), and which sequences
    # verified drafts (their emitted tokens are read back)
    rows_per_seq: int = 1
    verified: tuple[bool, ...] = ()
    pooled: tuple[tuple[int, str], ...] = ()  # (sequence index, request id) of pooling requests


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
        platform: Platform,
        seed: int = 0,
        mesh: jax.sharding.Mesh | None = None,
        logits_processors: tuple[LogitsProcessor, ...] = (),
        graphdef: nnx.GraphDef | None = None,
        lora: LoraAdapters | None = None,
        num_speculative_tokens: int = 0,
        draft_slots: bool = False,
        sampled_rows: int | None = None,
        eagle: tuple[Eagle3Config, dict[str, np.ndarray]] | None = None,
        image_slots: int = 0,
        program_store: ProgramStore | None = None,
        huge_pages: bool = True,
    ) -> None:
        """``params`` is the model's state as a pytree and ``graphdef`` its NNX graph
        definition (None: the Llama family over ``model_config``); ``platform``: the engine's,
        chosen by its builder (attention backend, layer kernels, weight packing); ``lora``:
        the LoRA adapters and their device slots (None: LoRA off);
        ``num_speculative_tokens``: the most drafts a sequence verifies in one step (0:
        speculative decoding off), compiled into every step shape; ``draft_slots``: the
        drafts are a draft model's, made on the device (:attr:`drafter` fills them into the
        tail of the previous-token array, R * (K + 1) entries, which draft rows read);
        ``eagle``: an EAGLE-3 head's (config, params), drafting inside the step
        (:mod:`jaxpaged.worker.spec_eagle`; ``layout`` has one layer more than the model,
        the head's); ``program_store``: where its compiled programs are kept whole (None:
        jit's tracing at every start);
        ``image_slots``: a vision-language model's encoder cache, in images (0: the model
        takes no images; jaxpaged.worker.images); ``huge_pages``: the streamed weights moved
        onto 2 MiB pages at load (kernels/cpu/huge_pages.py)."""
        self.num_speculative_tokens = num_speculative_tokens
        self.draft_slots = draft_slots
        self.drafter = None  # spec_draft.DraftModelProposer, set by the engine builder
        # EAGLE-3 with structured output: warm-up compiles the propose-only step programs
        # (set by the engine builder; jaxpaged.worker.spec_grammar)
        self.eagle_grammar_drafts = False
        # entries of the previous-token array (a draft model's runner: its target's size)
        self._sampled_rows = sampled_rows or max_num_seqs * (
            1 + num_speculative_tokens * draft_slots
        )
        self.lora = lora
        self.model_config = model_config
        self.eagle_config = None if eagle is None else eagle[0]
        if eagle is not None and layout.num_layers != model_config.num_layers + 1:
            raise ValueError("an EAGLE-3 head's K/V needs one pool layer after the model's")
        # traced into the step (static); their names index them in SamplingTensors.processor
        self.logits_processors = tuple(logits_processors)
        self.processor_names = tuple(p.name for p in self.logits_processors)
        self.mesh = mesh  # tensor parallelism: params already on it; the pool is split on it
        # on every device of a mesh (replicated: one small layer)
        self.eagle_params = None if eagle is None else self._on_mesh(jax.device_put(eagle[1]))
        # multi-host: rank 0's hook that announces each device call to the followers
        # (see jaxpaged.distributed.multihost); None on one host
        self.leader = None
        self.layout = layout
        self.max_model_len = max_model_len
        if platform.pool_format != layout.format:
            raise ValueError(
                f"the KV layout's format {layout.format} is not the one the platform's "
                f"{platform.attention_backend!r} attention reads ({platform.pool_format})"
            )
        # on CPU the native kernels over weights packed into their layout and the streamed
        # weights on 2 MiB pages; elsewhere XLA's
        self.platform = platform
        # jitted for this runner alone: its compiled programs go when it closes or is dropped
        self.programs = EnginePrograms(program_store)
        # the model class's hooks: which weights a native matmul may repack, which a step
        # streams
        self._hooks = ModelHooks.of(model_config, params, graphdef)
        # what replacement weights must match (update_params), as given: before packing
        self.params_spec = ParamsSpec.of(params)
        self.params: Params | None = None
        self.huge_page_bytes = 0
        # host (numpy) leaves go to the default device once, not with every step
        self._install_params(self.params_spec.place(params), huge_pages=huge_pages)
        # packing may add a leaf (the tied vocabulary projection's own packed copy); a swap
        # packs the same way, so the graph definition stays valid across update_params
        self.graphdef = StaticGraph(self._hooks.graphdef_for(self.params, graphdef))
        self.buckets = BucketSet(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            block_size=layout.block_size,
            num_speculative_tokens=num_speculative_tokens,
        )
        self.engine_key_data = sampler.seed_to_key_data(seed)
        # the running requests' block tables and sampling settings, updated from each plan
        self.input_batch = InputBatch(
            max_rows=max_num_seqs,
            max_blocks=self.buckets.full_blocks,
            block_size=layout.block_size,
            vocab_size=model_config.vocab_size,
            engine_key_data=self.engine_key_data,
            processor_names=self.processor_names,
            lora=lora is not None,
            num_speculative_tokens=num_speculative_tokens,
            draft_slots_base=max_num_seqs if draft_slots else None,
            seq_rows=eagle is not None,
        )
        self.images = None
        if image_slots:
            self.images = image_encoder(
                model_config,
                graphdef=self.graphdef,
                dtype=jax.tree.leaves(self.params["embed"])[0].dtype,
                slots=image_slots,
                bidirectional=model_config.image.bidirectional,
                attention_backend=platform.attention_backend,
            )
        self._create_kv_state()
        # one sequence's blocks per move call: a handful of compiled sizes covers every plan
        max_move = 1 << (self.buckets.full_blocks - 1).bit_length()
        self.moves = BlockMover(self.programs, self.layout, max_move)
        self.warmed_up = False

    @property
    def backend(self) -> str:
        """The attention backend the steps run (the platform's; never None)."""
        return self.platform.attention_backend

    @property
    def kernels(self) -> StepKernels:
        """The matmul and argmax kernels the steps run (the platform's)."""
        return self.platform.kernels

    def _install_params(self, params: Params, *, huge_pages: bool = True) -> None:
        # packed before the old weights are let go: if packing fails, the engine keeps its
        # weights (at the cost of two packed copies for a moment where the platform packs)
        packed = self.platform.pack_weights(params, self._hooks.weight_map)
        if huge_pages:
            self.huge_page_bytes = self.platform.back_with_huge_pages(self._hooks.streamed(packed))
        else:
            self.huge_page_bytes = 0
        self.params = packed

    def _create_kv_state(self) -> None:
        """The KV pool, the sampler state rows and the last sampled tokens, all zero."""
        layout, mesh = self.layout, self.mesh
        self.pool = self.programs.create_pool(
            layout=layout, sharding=None if mesh is None else kv_pool_sharding(mesh)
        )
        # one sampler-state row per running request at most; the scheduler hands them out
        self.seq_state = self._on_mesh(
            sampler.create_seq_state(
                self.buckets.max_num_seqs,
                self.model_config.vocab_size,
                MAX_BANNED_IDS,
                MAX_LOGIT_BIAS,
                # each row's token history, for the processors only
                history_len=self.max_model_len if self.logits_processors else 1,
            )
        )
        # the last step's sampled tokens (StepOutput.token_ids), read by the next step
        # (with draft-model drafts, R * (K + 1): the drafts after the R sampled tokens)
        rows = self._sampled_rows
        self.sampled = self._on_mesh(jax.device_put(np.zeros((rows,), np.int32), may_alias=False))
        self.eagle_state = None
        if self.eagle_config is not None:  # each batch row's next draft 1 and hidden state
            dtype = self.eagle_params["norm"].dtype
            self.eagle_state = spec_eagle.create_state(
                self.buckets.max_num_seqs, self.eagle_config.layer.hidden_size, dtype
            )

    # ------------------------------------------------- weights and memory (admin)
    def update_params(self, params: Params) -> None:
        """Swaps in new weights of the same tree, shapes and dtypes (ValueError otherwise).
        The compiled programs and the KV pool stay; a step already dispatched finishes on
        the old weights. Arrays already where the engine's are stay there (no copy unless
        the platform packs weights into its own layout)."""
        self.params_spec.check(params)
        if self.images is not None:  # features of the old weights
            self.images.clear()
        # no huge-page collapse: it costs 1.3-1.8 s per SmolLM2 copy on the dev VM (see
        # kernels/cpu/huge_pages.py) for ~1.8 ms per decode step, a loss for a training loop
        # that swaps weights every few hundred steps
        self._install_params(self.params_spec.place(params), huge_pages=False)

    def release_params(self) -> None:
        """Drops the engine's reference to its weights (sleep level 2); their memory goes
        when no one else holds them. Steps need :meth:`update_params` first."""
        self.params = None
        self.huge_page_bytes = 0

    def release_kv(self) -> int:
        """Frees the KV pool, the sampler state and swapped-out blocks (sleep); returns the
        device bytes freed. Nothing may be running."""
        arrays = [
            a
            for a in jax.tree.leaves((self.pool, self.seq_state, self.sampled, self.eagle_state))
            if a is not None
        ]
        freed = sum(a.nbytes for a in arrays)
        for a in arrays:
            a.delete()
        if self.drafter is not None:
            freed += self.drafter.runner.release_kv()
        self.pool = self.seq_state = self.sampled = self.eagle_state = None
        self.moves.clear()
        return freed

    def restore_kv(self) -> None:
        """A fresh (zeroed) KV pool and sampler state after :meth:`release_kv`: the same
        shapes, so the compiled programs still apply."""
        self._create_kv_state()
        if self.drafter is not None:
            self.drafter.runner.restore_kv()

    def close(self) -> None:
        """Frees the KV pool and sampler state and drops the weights and the compiled
        programs; the runner cannot step afterwards. Nothing may be running."""
        if self.pool is not None:
            self.release_kv()
        self.release_params()
        self.programs.close()
        self.images = None  # the encoder cache and its program
        if self.drafter is not None:
            self.drafter.runner.close()

    @property
    def kv_released(self) -> bool:
        return self.pool is None

    def _on_mesh(self, tree):
        return tree if self.mesh is None else jax.device_put(tree, replicated(self.mesh))

    # ------------------------------------------------------------------ step
    def _step_kwargs(self) -> dict[str, object]:
        return dict(
            graphdef=self.graphdef,
            num_blocks=self.layout.num_blocks,
            block_size=self.layout.block_size,
            pool_format=self.platform.pool_format,
            num_logprobs=MAX_LOGPROBS,
            backend=self.platform.attention_backend,
            interpret=self.platform.interpret,
            mesh=self.mesh,
            kernels=self.kernels,
            logits_processors=self.logits_processors,
        )

    def activation_bytes(self) -> int:
        """Scratch memory XLA plans for the largest step program: what the KV pool must leave
        free on the device (the "profiling step" of KV sizing, without running it)."""
        bucket = max(self.buckets.all(), key=lambda b: (b.num_tokens, b.max_blocks))
        batch, _ = self.build_batch([], bucket)
        lowered = self.programs.step.lower(
            self.params, self.pool, self.seq_state, self.sampled, batch, **self._array_kwargs(),
            **self._step_kwargs(),
        )  # fmt: skip
        analysis = lowered.compile().memory_analysis()
        return int(getattr(analysis, "temp_size_in_bytes", 0) or 0)

    def build_batch(
        self,
        seqs: Sequence[ScheduledSeq],
        bucket: Bucket,
        allowed: Mapping[int, np.ndarray] | None = None,
    ) -> tuple[StepBatch, dict[int, str]]:
        """Host-side padding of one step into ``bucket`` from the persistent batch (numpy;
        one transfer per array), and the sequences whose sampling settings could not be
        filled (index -> reason: they ride as padding rows and their requests fail; the
        others are unaffected). ``allowed``: sequence index -> its structured-output mask
        (int32 [ceil(V / 32)]). The sequences' requests must be in the batch."""
        batch, failed = self.input_batch.prepare(seqs, bucket, allowed)
        if self.images is not None:
            rows = self.images.rows(self.params, seqs, bucket.num_tokens)
            limits = None
            if self.images.bidirectional:  # an image's tokens see each other (Gemma 3)
                limits = self.images.causal_limits(seqs, bucket.num_tokens)
            batch = batch._replace(image_rows=rows, causal_limits=limits)
            if isinstance(self.images, PatchImageEncoder):  # M-RoPE: [3, T] positions
                mrope = self.images.mrope_positions(seqs, bucket.num_tokens)
                batch = batch._replace(mrope_positions=mrope)
        return batch, failed

    def _array_kwargs(self) -> dict[str, object]:
        kw: dict[str, object] = {}
        if self.lora is not None:
            kw["lora_weights"] = self.lora.slots
        if self.images is not None:
            kw["image_cache"] = self.images.cache
        if self.eagle_config is not None:
            kw.update(
                eagle_config=self.eagle_config,
                eagle_params=self.eagle_params,
                eagle_state=self.eagle_state,
            )
        return kw

    def _bucket_kwargs(self, bucket: Bucket) -> dict[str, object]:
        kwargs = self._step_kwargs()
        if bucket.decode_only:
            kwargs.update(max_q_len=1)
        elif bucket.max_q_len is not None:
            kwargs.update(max_q_len=bucket.max_q_len)
        return kwargs

    def propose(self, batch: StepBatch, bucket: Bucket) -> jax.Array:  # int32 [S, K]
        """The EAGLE-3 head's drafts for ``batch`` (the step's own passes, stopped there),
        for grammar requests' masks (jaxpaged.worker.spec_grammar); single host only."""
        if self.leader is not None:
            raise RuntimeError("propose-only steps are not announced to other hosts")
        drafts, self.pool, self.seq_state, self.eagle_state = self.programs.step(
            self.params, self.pool, self.seq_state, self.sampled, batch, **self._array_kwargs(),
            **self._bucket_kwargs(bucket), propose_only=True,
        )  # fmt: skip
        return drafts

    def _run(self, batch: StepBatch, bucket: Bucket) -> StepOutput:
        kwargs = self._bucket_kwargs(bucket)
        if self.leader is not None:
            self.leader.announce_step(batch, bucket)
        out, self.pool, self.seq_state, self.eagle_state = self.programs.step(
            self.params, self.pool, self.seq_state, self.sampled, batch, **self._array_kwargs(),
            **kwargs,
        )  # fmt: skip
        self.sampled = out.token_ids
        return out

    def dispatch(
        self, plan: SchedulerOutput, allowed: Mapping[int, np.ndarray] | None = None
    ) -> PendingStep | None:
        """Applies the plan's swaps, copies and sampler-state row fills, then launches its step
        without waiting for it (None when the plan has no sequences). ``allowed``: sequence
        index -> its structured-output mask."""
        announce = None if self.leader is None else self.leader.announce_copy
        self.pool = self.moves.apply(self.pool, plan, announce)
        for init in plan.state_rows_to_init:
            self._init_state_row(init)
        for slot, name in plan.lora_loads:
            self.lora.write_slot(slot, name)
        self.input_batch.update(plan)
        if self.images is not None:
            self.images.update(plan)
        if self.drafter is not None:  # the draft model's passes (its pool's moves too)
            self.sampled = self.drafter.propose(plan, self.sampled)
        if not plan.seqs:
            return None
        bucket = self.buckets.pick(plan.seqs)
        batch, failed_rows = self.build_batch(plan.seqs, bucket, allowed)
        if isinstance(allowed, spec_grammar.DraftMasks) and allowed.pending:  # the one wait
            batch = spec_grammar.batch_after_drafts(self, plan, bucket, batch, allowed)
        out = self._run(batch, bucket)
        wanted = self.input_batch.logprobs_wanted(plan.seqs)
        prompt_wanted = prompt_logprob_rows(plan.seqs)
        # start the device->host copies now: they run as soon as the step is done
        verified = tuple(s.num_draft_tokens > 0 for s in plan.seqs)
        some = any(w is not None for w in wanted) or any(prompt_wanted)
        needed = list(out._replace(pooled=None)) if some else [out.token_ids]
        pooled = pooled_seqs(plan.seqs, self.input_batch.requests)
        if pooled:
            needed.append(out.pooled)
        if any(verified):
            needed += [out.spec_token_ids, out.num_emitted]
        for x in needed:
            if x is not None:
                x.copy_to_host_async()
        failed = {plan.seqs[i].request_id: why for i, why in failed_rows.items()}
        return PendingStep(
            out=out,
            num_seqs=len(plan.seqs),
            logprobs_wanted=wanted,
            prompt_wanted=prompt_wanted,
            failed=failed,
            rows_per_seq=1 if batch.verify_rows is None else batch.verify_rows.shape[1],
            verified=verified if any(verified) else (),
            pooled=pooled,
        )

    def collect(self, pending: PendingStep | None) -> RunnerOutput:
        """Waits for a dispatched step and returns its sampled tokens (and logprobs)."""
        if pending is None:
            return RunnerOutput(sampled_token_ids=())
        if self.moves.unfetched:  # gathered before this step: done once it is
            jax.block_until_ready(pending.out.token_ids)
            self.moves.fetch()
        n = pending.num_seqs
        want = pending.logprobs_wanted
        plain = all(w is None for w in want) and not any(pending.prompt_wanted)
        hidden = pooled_hidden(pending.out.pooled, pending.pooled)
        if plain and not pending.verified:  # the usual case
            token_ids = np.asarray(pending.out.token_ids)
            return RunnerOutput(
                sampled_token_ids=token_ids[:n].tolist(),
                failed=pending.failed,
                pooled_hidden=hidden,
            )
        out = jax.device_get(pending.out._replace(pooled=None))
        k1 = pending.rows_per_seq
        spec_ids = spec_lps = None
        if pending.verified:
            spec_ids = [
                out.spec_token_ids[i, : out.num_emitted[i]].tolist() if v else None
                for i, v in enumerate(pending.verified)
            ]
            spec_lps = [
                None
                if ids is None or want[i] is None
                else [logprob_at(out, i * k1 + j, t, want[i]) for j, t in enumerate(ids)]
                for i, ids in enumerate(spec_ids)
            ]
        logprobs = [
            None if w is None else logprob_at(out, i * k1, int(out.token_ids[i]), w)
            for i, w in enumerate(want)
        ]
        prompt = [None if p is None else prompt_logprobs_at(out, *p) for p in pending.prompt_wanted]
        return RunnerOutput(
            sampled_token_ids=out.token_ids[:n].tolist(),
            logprobs=None if plain else logprobs,
            prompt_logprobs=None if plain else prompt,
            failed=pending.failed,
            spec_token_ids=spec_ids,
            spec_logprobs=spec_lps,
            pooled_hidden=hidden,
        )

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        """dispatch + collect: one step, waiting for it (callers that do not overlap)."""
        return self.collect(self.dispatch(plan))

    # ------------------------------------------------------- sampler state rows
    def state_row_arrays(self, init: StateRowInit) -> tuple[np.ndarray, ...]:
        """The inputs of ``init_state_row``: row [], prompt [H], output [H] (H =
        max_model_len), min_tokens [], banned ids [MAX_BANNED_IDS], logit-bias ids and
        float32 biases [MAX_LOGIT_BIAS], -1 / 0 padded: one shape, one compiled program."""
        h = self.max_model_len
        prompt = np.full(h, -1, np.int32)
        output = np.full(h, -1, np.int32)
        banned = np.full(MAX_BANNED_IDS, -1, np.int32)
        prompt[: len(init.prompt_token_ids)] = init.prompt_token_ids
        output[: len(init.output_token_ids)] = init.output_token_ids
        banned[: len(init.banned_ids)] = init.banned_ids  # admission bounds its length
        bias_ids = np.full(MAX_LOGIT_BIAS, -1, np.int32)
        bias_values = np.zeros(MAX_LOGIT_BIAS, np.float32)
        for i, (token, bias) in enumerate(init.logit_bias):  # SamplingParams bounds its length
            bias_ids[i], bias_values[i] = token, bias
        row, min_tokens = np.array(init.row, np.int32), np.array(init.min_tokens, np.int32)
        return row, prompt, output, min_tokens, banned, bias_ids, bias_values

    def _init_state_row(self, init: StateRowInit) -> None:
        arrays = self.state_row_arrays(init)
        if self.leader is not None:
            self.leader.announce_state_row(arrays)
        self.fill_state_row(arrays)

    def fill_state_row(self, arrays: tuple[np.ndarray, ...]) -> None:
        """The device call of a state-row fill (followers of a multi-host run too);
        ``arrays`` as :meth:`state_row_arrays` makes them."""
        self.seq_state = self.programs.init_state_row(self.seq_state, *arrays)

    # ------------------------------------------------------------ block moves
    def apply_copy(
        self,
        src: np.ndarray,  # int32 [N] source block ids, -1 = padding
        dst: np.ndarray,  # int32 [N] destination block ids
    ) -> None:
        """The device call of a block copy (followers of a multi-host run too)."""
        self.pool = self.moves.copy(self.pool, src, dst)

    @property
    def num_host_blocks_in_use(self) -> int:
        return len(self.moves.host_blocks)

    @property
    def num_tier_blocks_in_use(self) -> int:
        """Host tier slots holding a copy (at most the tier's size)."""
        return len(self.moves.tier_blocks)

    # ---------------------------------------------------------------- warm-up
    def _compile_buckets(self, buckets: Sequence[Bucket], bar: tqdm) -> None:
        for bucket in buckets:
            batch, _ = self.build_batch([], bucket)
            jax.block_until_ready(self._run(batch, bucket))
            if self.eagle_grammar_drafts and batch.verify_rows is not None:
                jax.block_until_ready(self.propose(batch, bucket))
                bar.update()
            bar.update()

    def warm_up(self, *, swap: bool = False, show_progress: bool = True) -> tuple[int, float]:
        """Compiles every step bucket, the sampler-state row fill and the block-move sizes now, so
        serving never compiles. Returns (programs, seconds)."""
        start = time.perf_counter()
        buckets = self.buckets.all()
        total = len(buckets) + 1 + self.moves.num_programs(swap=swap)
        if self.eagle_grammar_drafts:  # the propose-only programs (jaxpaged.worker.spec_grammar)
            total += sum(not b.decode_only for b in buckets)
        bar = tqdm(total=total, desc="warm-up (compiling)", disable=not show_progress, unit="prog")
        # the platform's attention compiled once already (its probe, for Pallas): a failure
        # here stops the start-up
        if self.images is not None:
            total += self.images.warm_up(self.params)
        self._compile_buckets(buckets, bar)
        if self.lora is not None:
            self.lora.warm_up()
        # row 0 is free while nothing runs: filling it with nothing leaves it as it was
        self._init_state_row(StateRowInit(row=0, prompt_token_ids=(), output_token_ids=()))
        bar.update()
        self.pool = self.moves.warm_up(self.pool, swap=swap, done=bar.update)
        jax.block_until_ready((self.pool, self.seq_state))
        bar.close()
        if self.drafter is not None:
            total += self.drafter.warm_up(swap=swap, show_progress=show_progress)[0]
        self.warmed_up = True
        return total, time.perf_counter() - start
