"""Fake engines whose outputs are computable by hand, for serving tests (fault injection,
overload, cancel) without a model. ``FakeAsyncEngine`` implements ``EngineClient`` (checked
member by member in test_engine_client.py); ``FakeLLMEngine`` (fake_llm_engine.py) is what the
real ``AsyncEngine`` drives.

Tokenizer: one token per character, id = ord(char) (ASCII), EOS = 3. Generation: sample j
of a request whose prompt ids sum to S emits, at output position i, the letter
``chr(ord('a') + (S + i + j) % 26)`` with logprob ``-0.5 * (1 + i % 3)``. Scheduling: FCFS,
at most `max_num_seqs` running; each step gives every unfinished sample of every running
request `tokens_per_step` tokens (with `interleave`, only the sample of each request that
has the fewest, so samples take turns); a request holds n * ceil((prompt + longest sample +
1) / block_size) blocks from a pool of `num_kv_blocks`. Outputs follow the contract of
``jaxpaged.outputs``: DELTA (only what is new, per changed sample) or FINAL_ONLY (one
complete output at the end).

Admin, as the real engine behaves: LoRA adapters are registered by name (any non-empty
path; a request names one with ``lora_name``, recorded in ``lora_names``), ``sleep`` is
refused while requests are unfinished and frees one byte per KV slot, requests are refused
while asleep, and ``update_weights_from`` takes any existing path (FileNotFoundError for
another) and records it in ``weight_paths``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Container, Mapping

from jaxpaged.engine.core import asleep_message
from jaxpaged.engine.input_processor import check_request_id
from jaxpaged.engine.protocol import EngineAsleepError, EngineDeadError, EngineStats, Prompt
from jaxpaged.lora_request import LoRARequest
from jaxpaged.models.config import ModelConfig
from jaxpaged.outputs import (
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
    RequestOutputKind,
)
from jaxpaged.sampling_params import SamplingParams, validate_prompt

VOCAB = 128
EOS = 3


def expected_text(prompt_ids: list[int], num_tokens: int, index: int = 0) -> str:
    s = sum(prompt_ids)
    return "".join(chr(ord("a") + (s + i + index) % 26) for i in range(num_tokens))


def expected_logprob(position: int) -> float:
    """The logprob the fakes give the token at `position` of any sample."""
    return -0.5 * (1 + position % 3)


class FakeTokenizer:
    eos_token_id = EOS
    eos_token = "<eos>"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [ord(c) for c in text]
        if any(not 0 < i < VOCAB for i in ids):
            raise ValueError("prompt: non-ASCII text")
        return ids

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self.encode(text, add_special_tokens)}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i >= 32)

    def convert_ids_to_tokens(self, ids) -> list[str]:
        return [chr(i) for i in ids]

    def apply_chat_template(
        self, messages, add_generation_prompt=True, tokenize=False, chat_template=None, **extra
    ):
        parts = [f"<{k}={v}>" for k, v in sorted(extra.items())]  # template variables
        for m in messages:
            if m["role"] not in ("system", "user", "assistant"):
                raise ValueError(f"unknown role {m['role']}")
            parts.append(f"<{m['role']}>{m['content']}\n")
        if add_generation_prompt:
            parts.append("<assistant>")
        text = "".join(parts)
        return {"input_ids": self.encode(text)} if tokenize else text


def _model_config() -> ModelConfig:
    return ModelConfig(
        model_type="llama",
        vocab_size=VOCAB,
        hidden_size=8,
        intermediate_size=16,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        eos_token_ids=(EOS,),
    )


class _Stream:
    """One request's outputs as an async iterator; None ends it, an exception is raised."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> RequestOutput:
        item = await self.queue.get()
        if item is None:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item


@dataclasses.dataclass(kw_only=True, eq=False)
class _Req:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    output_kind: RequestOutputKind
    arrival: float
    generated: list[list[int]]  # per sample: every token id so far
    finish: list[str | None]  # per sample
    sent: list[int]  # per sample: tokens already in an output (DELTA)
    reported: list[bool]  # per sample: its finish_reason is already in an output (DELTA)
    stream: _Stream | None = None  # FakeAsyncEngine only
    blocks: int = 0
    first_scheduled: float | None = None
    first_token: float | None = None

    @property
    def done(self) -> bool:
        return all(f is not None for f in self.finish)


def _new_req(
    request_id: str,
    prompt: Prompt,
    params: SamplingParams,
    output_kind: RequestOutputKind,
    *,
    tokenizer: FakeTokenizer,
    max_model_len: int,
    arrival: float | None = None,
    in_use: Container[str] = (),
) -> _Req:
    """Validates like the real engine (ValueError naming the problem; its own checks where
    they need no model) and builds a request."""
    if not isinstance(params, SamplingParams):
        raise ValueError("params must be a SamplingParams")
    check_request_id(request_id, in_use)
    if not isinstance(output_kind, RequestOutputKind):
        raise ValueError(f"output_kind must be a RequestOutputKind, got {output_kind!r}")
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        ids = tokenizer.encode(prompt)
    else:
        ids = list(prompt)
    validate_prompt(ids, max_model_len, VOCAB, params)
    n = params.n
    return _Req(
        request_id=request_id,
        prompt=prompt if isinstance(prompt, str) else None,
        prompt_ids=ids,
        params=params,
        output_kind=output_kind,
        arrival=time.time() if arrival is None else arrival,
        generated=[[] for _ in range(n)],
        finish=[None] * n,
        sent=[0] * n,
        reported=[False] * n,
    )


class _FakeCore:
    """The fakes' scheduler and generator (no asyncio, no locking): steps requests and
    builds their outputs in each request's output kind."""

    def __init__(
        self,
        *,
        max_model_len: int,
        max_num_seqs: int,
        num_kv_blocks: int,
        block_size: int,
        tokens_per_step: int = 1,
        interleave: bool = False,
    ) -> None:
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.tokens_per_step = tokens_per_step
        self.interleave = interleave
        self.tokenizer = FakeTokenizer()
        self.model_config = _model_config()
        self.engine_config: dict[str, object] = {
            "block_size": block_size,
            "max_num_seqs": max_num_seqs,
            "max_model_len": max_model_len,
            "dtype": "float32",
        }
        self.aborted: list[str] = []  # ids whose abort the engine has processed
        self.steps = 0
        self.waiting: deque[_Req] = deque()
        self.running: list[_Req] = []
        self.free = num_kv_blocks
        self.prompt_total = 0
        self.gen_total = 0
        self._hold_at: int | None = None  # see hold_after
        self._waste_sum = 0.0
        self._waste_steps = 0

    # ---- requests ---------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, request_id: str) -> _Req | None:
        return next((r for r in (*self.waiting, *self.running) if r.request_id == request_id), None)

    def hold_after(self, num_tokens: int) -> None:
        """Stops generating once `num_tokens` more tokens exist, until the next abort: a
        cancel test then looks at a request that is certainly still running, however slow
        the machine."""
        self._hold_at = self.gen_total + num_tokens

    def held(self) -> bool:
        return self._hold_at is not None and self.gen_total >= self._hold_at

    def abort(self, request_id: str) -> tuple[_Req, RequestOutput] | None:
        """Records the abort, ends any hold, and, if the request is still there, frees it;
        returns it with its final output (its unfinished samples end with "abort")."""
        self.aborted.append(request_id)
        self._hold_at = None
        r = self.find(request_id)
        if r is None:
            return None
        (self.waiting if r in self.waiting else self.running).remove(r)
        r.finish = [f or "abort" for f in r.finish]
        self._release(r)
        return r, self._output(r)

    def drop_all(self) -> list[_Req]:
        """Forgets every request (the engine died); returns them."""
        dropped = [*self.waiting, *self.running]
        self.waiting.clear()
        self.running.clear()
        return dropped

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[tuple[_Req, RequestOutput]]:
        """Schedules, generates, and returns each touched request with its output (none for
        a FINAL_ONLY request that has not finished); finished requests are freed."""
        if self.held():
            return []
        self.steps += 1
        self._schedule()
        now = time.time()
        outs = []
        for r in list(self.running):
            self._grow(r)
            self._generate(r)
            if r.first_token is None:
                r.first_token = now
            out = self._output(r)
            if out is not None:
                outs.append((r, out))
            if r.done:
                self.running.remove(r)
                self._release(r)
        self._account_waste()
        return outs

    def _schedule(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            r = self.waiting[0]
            if self._blocks_needed(r) > self.free:
                break
            self.waiting.popleft()
            r.first_scheduled = time.time()
            self.prompt_total += len(r.prompt_ids)
            self.running.append(r)

    def _grow(self, r: _Req) -> None:
        need = self._blocks_needed(r)
        if need > r.blocks:
            take = min(need - r.blocks, self.free)
            self.free -= take
            r.blocks += take

    def _generate(self, r: _Req) -> None:
        s = sum(r.prompt_ids)
        limit = r.params.effective_max_tokens(len(r.prompt_ids), self.max_model_len)
        live = [j for j, f in enumerate(r.finish) if f is None]
        if self.interleave and live:
            live = [min(live, key=lambda j: len(r.generated[j]))]
        for j in live:
            toks = r.generated[j]
            for _ in range(self.tokens_per_step):
                toks.append(ord("a") + (s + len(toks) + j) % 26)
                self.gen_total += 1
                if len(toks) >= limit:
                    r.finish[j] = "length"
                    break

    def _account_waste(self) -> None:
        slots = sum(r.blocks for r in self.running) * self.block_size
        if not slots:
            return
        stored = sum(len(r.prompt_ids) + len(g) for r in self.running for g in r.generated)
        self._waste_sum += max(0.0, 1 - stored / slots)
        self._waste_steps += 1

    def _blocks_needed(self, r: _Req) -> int:
        longest = max(len(g) for g in r.generated)
        return r.params.n * math.ceil((len(r.prompt_ids) + longest + 1) / self.block_size)

    def _release(self, r: _Req) -> None:
        self.free += r.blocks
        r.blocks = 0

    # ---- outputs ----------------------------------------------------------------------------
    def _output(self, r: _Req) -> RequestOutput | None:
        if r.output_kind is RequestOutputKind.FINAL_ONLY:
            return self._request_output(r, self._whole(r)) if r.done else None
        samples = self._news(r)
        return self._request_output(r, samples) if samples else None

    def _whole(self, r: _Req) -> list[CompletionOutput]:
        return [self._sample(r, j, 0) for j in range(len(r.generated))]

    def _news(self, r: _Req) -> list[CompletionOutput]:
        """The samples that changed since the last output, each with only what is new."""
        samples = []
        for j, toks in enumerate(r.generated):
            newly_finished = r.finish[j] is not None and not r.reported[j]
            if len(toks) == r.sent[j] and not newly_finished:
                continue
            samples.append(self._sample(r, j, r.sent[j]))
            r.sent[j] = len(toks)
            r.reported[j] = r.finish[j] is not None
        return samples

    def _sample(self, r: _Req, j: int, start: int) -> CompletionOutput:
        """Sample j from token position `start` on."""
        toks = r.generated[j][start:]
        lps = None
        if r.params.logprobs is not None:
            lps = tuple(
                Logprob(
                    token_id=t,
                    logprob=expected_logprob(start + i),
                    top={t: expected_logprob(start + i), (t + 1) % VOCAB: -2.0}
                    if r.params.logprobs
                    else {},
                )
                for i, t in enumerate(toks)
            )
        return CompletionOutput(
            index=j,
            text=self.tokenizer.decode(toks),
            token_ids=tuple(toks),
            logprobs=lps,
            finish_reason=r.finish[j],
        )

    def _request_output(self, r: _Req, samples: list[CompletionOutput]) -> RequestOutput:
        done = r.done
        return RequestOutput(
            request_id=r.request_id,
            prompt=r.prompt,
            prompt_token_ids=tuple(r.prompt_ids),
            outputs=tuple(samples),
            finished=done,
            metrics=RequestMetrics(
                arrival_time=r.arrival,
                first_scheduled_time=r.first_scheduled,
                first_token_time=r.first_token,
                finished_time=time.time() if done else None,
            ),
        )

    # ---- stats ------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        used = self.num_kv_blocks - self.free
        return EngineStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_swapped=0,
            kv_cache_usage=used / self.num_kv_blocks,
            kv_cache_waste=self._waste_sum / self._waste_steps if self._waste_steps else 0.0,
            num_kv_blocks=self.num_kv_blocks,
            num_free_blocks=self.free,
            num_preemptions=0,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            prompt_tokens_total=self.prompt_total,
            generation_tokens_total=self.gen_total,
            num_steps=self.steps,
            num_compilations=0,
            num_compilations_after_warmup=0,
        )


class FakeAsyncEngine:
    """An ``EngineClient`` over _FakeCore, stepped by an asyncio task every `step_delay`
    seconds. Aborts are queued and processed by that task before its next step, as the real
    engine thread does."""

    def __init__(
        self,
        *,
        max_model_len: int = 256,
        max_num_seqs: int = 4,
        num_kv_blocks: int = 256,
        block_size: int = 4,
        step_delay: float = 0.005,
        fail_at_step: int | None = None,
        tokens_per_step: int = 1,
        interleave: bool = False,
    ) -> None:
        self._core = _FakeCore(
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            num_kv_blocks=num_kv_blocks,
            block_size=block_size,
            tokens_per_step=tokens_per_step,
            interleave=interleave,
        )
        self.step_delay = step_delay
        self.fail_at_step = fail_at_step
        self.added: list[tuple[str, list[int], SamplingParams, RequestOutputKind]] = []
        self.lora_names: dict[str, str | None] = {}  # request id -> the adapter it named
        self.weight_paths: list[str] = []  # checkpoints update_weights_from took
        self._loras: dict[str, str] = {}  # registered adapter name -> path
        self._live: set[str] = set()  # ids added whose final output is not out yet
        self._sleep_level = 0
        self.outputs: list[RequestOutput] = []  # every output sent, in order
        self.started = False
        self.shut_down = False
        self._dead: BaseException | None = None
        self._pending_aborts: list[str] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None

    # ---- EngineClient -----------------------------------------------------------------------
    @property
    def tokenizer(self) -> FakeTokenizer:
        return self._core.tokenizer

    @property
    def model_config(self) -> ModelConfig:
        return self._core.model_config

    @property
    def max_model_len(self) -> int:
        return self._core.max_model_len

    @property
    def engine_config(self) -> Mapping[str, object]:
        return self._core.engine_config

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    @property
    def errored(self) -> bool:
        return self._dead is not None

    def start(self) -> None:
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._run())
        self.started = True

    async def shutdown(self) -> None:
        self.shut_down = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        *,
        output_kind: RequestOutputKind = RequestOutputKind.DELTA,
        lora_name: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        if self._sleep_level:
            raise EngineAsleepError(asleep_message(self._sleep_level))
        if self._dead is not None:
            raise EngineDeadError(f"engine is dead: {self._dead!r}")
        if self._loop is None:
            raise RuntimeError("start() has not been called")
        if lora_name is not None and lora_name not in self._loras:
            raise ValueError(f"lora: adapter {lora_name!r} is not loaded")
        req = _new_req(
            request_id,
            prompt,
            params,
            output_kind,
            tokenizer=self._core.tokenizer,
            max_model_len=self._core.max_model_len,
            in_use=self._live,
        )
        self._live.add(request_id)
        req.stream = _Stream()
        self.added.append((request_id, req.prompt_ids, params, output_kind))
        self.lora_names[request_id] = lora_name
        # queued through the loop, so admission also works when called from another thread
        self._loop.call_soon_threadsafe(self._admit, req)
        return req.stream

    async def abort(self, request_id: str) -> None:
        """Fire-and-forget: the step task processes it before its next step."""
        if self._loop is None or self._dead is not None:
            return
        self._loop.call_soon_threadsafe(self._queue_abort, request_id)

    def get_stats(self) -> EngineStats:
        return self._core.stats()

    def list_loras(self) -> dict[str, str]:
        return dict(self._loras)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        name, path = lora_request.lora_name, lora_request.lora_path
        known = self._loras.get(name)
        if known is not None and path in ("", known):
            return False
        if known is not None:
            raise ValueError(f"LoRA adapter {name!r} is already loaded (unload it first)")
        if not path:
            raise ValueError(f"LoRA adapter {name!r}: lora_path is required")
        self._loras[name] = path
        return True

    async def remove_lora(self, name: str) -> None:
        if name not in self._loras:
            raise ValueError(f"LoRA adapter {name!r} is not loaded")
        users = sum(
            self.lora_names.get(r.request_id) == name
            for r in (*self._core.waiting, *self._core.running)
        )
        if users:
            raise ValueError(f"LoRA adapter {name!r} is in use by {users} unfinished requests")
        del self._loras[name]

    @property
    def is_sleeping(self) -> bool:
        return self._sleep_level > 0

    async def sleep(self, level: int = 1) -> int:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        unfinished = len(self._core.waiting) + len(self._core.running)
        if unfinished:
            raise RuntimeError(
                f"sleep: {unfinished} requests are unfinished (let them finish or abort them)"
            )
        freed = 0 if self._sleep_level else self._core.num_kv_blocks * self._core.block_size
        self._sleep_level = max(self._sleep_level, level)
        return freed

    async def wake_up(self) -> None:
        self._sleep_level = 0  # level 2: the weights "reload" from where they came

    async def update_weights_from(self, path: str) -> float:
        if not os.path.exists(path):
            raise FileNotFoundError(f"no checkpoint at {path!r}")
        self.weight_paths.append(path)
        return 0.0

    # ---- test controls ----------------------------------------------------------------------
    @property
    def aborted(self) -> list[str]:
        """Ids whose abort the engine has processed."""
        return self._core.aborted

    @property
    def steps(self) -> int:
        return self._core.steps

    def hold_after(self, num_tokens: int) -> None:
        self._core.hold_after(num_tokens)

    def kill(self, error: BaseException | None = None) -> None:
        """The engine step raised: every open stream fails, later add_request too."""
        self._dead = error or RuntimeError("injected engine failure")
        self._live.clear()
        for r in self._core.drop_all():
            r.stream.queue.put_nowait(EngineDeadError(f"engine step failed: {self._dead!r}"))

    # ---- the step task ----------------------------------------------------------------------
    def _admit(self, req: _Req) -> None:
        self._core.waiting.append(req)
        self._wake.set()

    def _queue_abort(self, request_id: str) -> None:
        self._pending_aborts.append(request_id)
        self._wake.set()

    async def _run(self) -> None:
        while self._dead is None:
            if not self._core.has_work() and not self._pending_aborts:
                self._wake.clear()
                await self._wake.wait()
            await asyncio.sleep(self.step_delay)
            self._process_aborts()
            self._step()

    def _process_aborts(self) -> None:
        aborts, self._pending_aborts = self._pending_aborts, []
        for request_id in aborts:
            ended = self._core.abort(request_id)
            if ended is not None:
                self._send(*ended)

    def _step(self) -> None:
        if self._dead is not None or self._core.held():
            return
        if self.fail_at_step is not None and self._core.steps + 1 >= self.fail_at_step:
            self.kill()
            return
        for r, out in self._core.step():
            self._send(r, out)

    def _send(self, r: _Req, out: RequestOutput) -> None:
        self.outputs.append(out)
        r.stream.queue.put_nowait(out)
        if out.finished:
            self._live.discard(r.request_id)
            r.stream.queue.put_nowait(None)


def wait_until(cond, timeout: float = 10.0, interval: float = 0.01) -> bool:
    """Polls cond() until it is true or `timeout` seconds pass; returns its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(interval)
    return bool(cond())
