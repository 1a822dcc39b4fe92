"""A fake AsyncEngine with the real one's interface, whose outputs are computable by hand, for
serving tests (fault injection, overload, cancel) without a model.

Tokenizer: one token per character, id = ord(char) (ASCII), EOS = 3. Generation: sample j
of a request whose prompt ids sum to S emits, at output position i, the letter
``chr(ord('a') + (S + i + j) % 26)``. Scheduling: FCFS, at most `max_num_seqs` running, one
token per running sample per step of `step_delay` seconds; a request holds
ceil((prompt + generated) / block_size) blocks (per sample) from a pool of `num_kv_blocks`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import threading
import time
from collections import deque

from jaxpaged.engine import EngineDeadError
from jaxpaged.models.config import ModelConfig
from jaxpaged.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxpaged.sampling_params import SamplingParams, validate_prompt

VOCAB = 128
EOS = 3


def expected_text(prompt_ids: list[int], num_tokens: int, index: int = 0) -> str:
    s = sum(prompt_ids)
    return "".join(chr(ord("a") + (s + i + index) % 26) for i in range(num_tokens))


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

    def apply_chat_template(
        self, messages, add_generation_prompt=True, tokenize=False, chat_template=None
    ):
        parts = []
        for m in messages:
            if m["role"] not in ("system", "user", "assistant"):
                raise ValueError(f"unknown role {m['role']}")
            parts.append(f"<{m['role']}>{m['content']}\n")
        if add_generation_prompt:
            parts.append("<assistant>")
        text = "".join(parts)
        return {"input_ids": self.encode(text)} if tokenize else text


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_cache_usage: float
    num_kv_blocks: int
    num_free_blocks: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_compilations: int


class _Stream:
    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        item = await self.queue.get()
        if item is None:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item


@dataclasses.dataclass(kw_only=True)
class _Req:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    stream: _Stream
    arrival: float
    generated: list[list[int]]
    finish: list[str | None]
    blocks: int = 0
    first_scheduled: float | None = None
    first_token: float | None = None


class FakeAsyncEngine:
    def __init__(
        self,
        *,
        max_model_len: int = 256,
        max_num_seqs: int = 4,
        num_kv_blocks: int = 256,
        block_size: int = 4,
        step_delay: float = 0.005,
        fail_at_step: int | None = None,
    ) -> None:
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.step_delay = step_delay
        self.fail_at_step = fail_at_step
        self._hold_at: int | None = None  # see hold_after
        self.tokenizer = FakeTokenizer()
        self.model_config = ModelConfig(
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
        self.engine_config = {
            "block_size": block_size,
            "max_num_seqs": max_num_seqs,
            "max_model_len": max_model_len,
            "dtype": "float32",
        }
        self.added: list[tuple[str, list[int], SamplingParams]] = []
        self.aborted: list[str] = []
        self.steps = 0
        self.started = False
        self.shut_down = False
        self._dead: BaseException | None = None
        self._waiting: deque[_Req] = deque()
        self._running: list[_Req] = []
        self._free = num_kv_blocks
        self._prompt_total = 0
        self._gen_total = 0
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None

    # ---- the AsyncEngine interface -------------------------------------------------------------
    def start(self) -> None:
        self._wake = asyncio.Event()
        self._main_loop = asyncio.get_running_loop()
        self._task = self._main_loop.create_task(self._loop())
        self.started = True

    @property
    def errored(self) -> bool:
        return self._dead is not None

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    async def add_request(self, request_id: str, prompt, params: SamplingParams) -> _Stream:
        if self._dead is not None:
            raise EngineDeadError(f"engine is dead: {self._dead!r}")
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        validate_prompt(ids, self.max_model_len, VOCAB, params)
        if any(r.request_id == request_id for r in (*self._waiting, *self._running)):
            raise ValueError(f"request_id {request_id!r} already exists")
        req = _Req(
            request_id=request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_ids=ids,
            params=params,
            stream=_Stream(),
            arrival=time.time(),
            generated=[[] for _ in range(params.n)],
            finish=[None] * params.n,
        )
        self.added.append((request_id, ids, params))
        # queued through the loop, so admission also works when called from another thread
        self._main_loop.call_soon_threadsafe(self._admit, req)
        return req.stream

    def _admit(self, req: _Req) -> None:
        self._waiting.append(req)
        self._wake.set()

    def hold_after(self, num_tokens: int) -> None:
        """Stops generating once `num_tokens` more tokens exist, until the next abort: a
        cancel test then looks at a request that is certainly still running, however slow
        the machine."""
        self._hold_at = self._gen_total + num_tokens

    def _held(self) -> bool:
        return self._hold_at is not None and self._gen_total >= self._hold_at

    async def abort(self, request_id: str) -> None:
        r = self._abort(request_id)
        if r is not None:
            r.stream.queue.put_nowait(self._snapshot(r))
            r.stream.queue.put_nowait(None)

    def _abort(self, request_id: str) -> _Req | None:
        """Records the abort, ends any hold, and frees the request if it is still there."""
        self.aborted.append(request_id)
        self._hold_at = None
        for q in (self._waiting, self._running):
            for r in list(q):
                if r.request_id == request_id:
                    q.remove(r)
                    r.finish = [f or "abort" for f in r.finish]
                    self._release(r)
                    return r
        return None

    def get_stats(self) -> EngineStats:
        used = self.num_kv_blocks - self._free
        return EngineStats(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            num_swapped=0,
            kv_cache_usage=used / self.num_kv_blocks,
            num_kv_blocks=self.num_kv_blocks,
            num_free_blocks=self._free,
            num_preemptions=0,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            prompt_tokens_total=self._prompt_total,
            generation_tokens_total=self._gen_total,
            num_compilations=0,
        )

    async def shutdown(self) -> None:
        self.shut_down = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    # ---- fault injection -----------------------------------------------------------------------
    def kill(self, error: BaseException | None = None) -> None:
        """The engine step raised: every open stream fails, later add_request too."""
        self._dead = error or RuntimeError("injected engine failure")
        for r in (*self._waiting, *self._running):
            r.stream.queue.put_nowait(EngineDeadError(f"engine step failed: {self._dead!r}"))
        self._waiting.clear()
        self._running.clear()

    # ---- internals ------------------------------------------------------------------------------
    def _blocks_needed(self, r: _Req) -> int:
        longest = max(len(g) for g in r.generated)
        return r.params.n * math.ceil((len(r.prompt_ids) + longest + 1) / self.block_size)

    def _release(self, r: _Req) -> None:
        self._free += r.blocks
        r.blocks = 0

    def _snapshot(self, r: _Req) -> RequestOutput:
        outs = []
        for j, toks in enumerate(r.generated):
            lps = None
            if r.params.logprobs is not None:
                lps = tuple(
                    Logprob(
                        token_id=t,
                        logprob=-0.5 * (1 + i % 3),
                        top={t: -0.5 * (1 + i % 3), (t + 1) % VOCAB: -2.0}
                        if r.params.logprobs
                        else {},
                    )
                    for i, t in enumerate(toks)
                )
            outs.append(
                CompletionOutput(
                    index=j,
                    text=self.tokenizer.decode(toks),
                    token_ids=tuple(toks),
                    logprobs=lps,
                    finish_reason=r.finish[j],
                )
            )
        done = all(f is not None for f in r.finish)
        return RequestOutput(
            request_id=r.request_id,
            prompt=r.prompt,
            prompt_token_ids=tuple(r.prompt_ids),
            outputs=tuple(outs),
            finished=done,
            metrics=RequestMetrics(
                arrival_time=r.arrival,
                first_scheduled_time=r.first_scheduled,
                first_token_time=r.first_token,
                finished_time=time.time() if done else None,
            ),
        )

    async def _loop(self) -> None:
        while True:
            if not self._waiting and not self._running:
                self._wake.clear()
                await self._wake.wait()
            await asyncio.sleep(self.step_delay)
            self._step()

    def _step(self) -> None:
        if self._held():
            return
        self.steps += 1
        if self.fail_at_step is not None and self.steps >= self.fail_at_step:
            self.kill()
            return
        while self._waiting and len(self._running) < self.max_num_seqs:
            r = self._waiting[0]
            if self._blocks_needed(r) > self._free:
                break
            self._waiting.popleft()
            r.first_scheduled = time.time()
            self._prompt_total += len(r.prompt_ids)
            self._running.append(r)
        now = time.time()
        for r in list(self._running):
            need = self._blocks_needed(r)
            if need > r.blocks:
                take = min(need - r.blocks, self._free)
                self._free -= take
                r.blocks += take
            s = sum(r.prompt_ids)
            limit = r.params.effective_max_tokens(len(r.prompt_ids), self.max_model_len)
            for j, toks in enumerate(r.generated):
                if r.finish[j] is not None:
                    continue
                toks.append(ord("a") + (s + len(toks) + j) % 26)
                self._gen_total += 1
                if len(toks) >= limit:
                    r.finish[j] = "length"
            if r.first_token is None:
                r.first_token = now
            snap = self._snapshot(r)
            r.stream.queue.put_nowait(snap)
            if snap.finished:
                self._running.remove(r)
                self._release(r)
                r.stream.queue.put_nowait(None)


def wait_until(cond, timeout: float = 10.0, interval: float = 0.01) -> bool:
    """Polls cond() until it is true or `timeout` seconds pass; returns its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(interval)
    return bool(cond())


class FakeLLMEngine:
    """The synchronous engine interface (add_request / step / abort) with the same hand-computable
    outputs as FakeAsyncEngine, for driving the real `jaxpaged.engine.async_engine.AsyncEngine`
    (its thread and asyncio bridge) without a model. `busy` seconds of pure-Python work per
    step hold the GIL like a real step's host side does."""

    def __init__(self, *, max_model_len: int = 256, max_num_seqs: int = 32, num_kv_blocks: int = 256,
                 block_size: int = 4, busy: float = 0.0) -> None:  # fmt: skip
        self._core = FakeAsyncEngine(
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            num_kv_blocks=num_kv_blocks,
            block_size=block_size,
        )
        self.busy = busy
        self.tokenizer = self._core.tokenizer
        self.model_config = self._core.model_config
        self.engine_config = self._core.engine_config
        self.max_model_len = max_model_len
        self.num_steps = 0
        self._lock = threading.Lock()
        self._out: list[RequestOutput] = []

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None) -> None:
        with self._lock:
            core = self._core
            ids = core.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            validate_prompt(ids, self.max_model_len, VOCAB, params)
            req = _Req(request_id=request_id, prompt=prompt if isinstance(prompt, str) else None,
                       prompt_ids=ids, params=params, stream=_SyncSink(self._out), arrival=time.time(),
                       generated=[[] for _ in range(params.n)], finish=[None] * params.n)  # fmt: skip
            core._waiting.append(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self._core._waiting or self._core._running)

    def step(self) -> list[RequestOutput]:
        end = time.monotonic() + self.busy
        while time.monotonic() < end:  # hold the GIL
            pass
        with self._lock:
            self.num_steps += 1
            self._core._step()
            out, self._out[:] = list(self._out), []
            return out

    def hold_after(self, num_tokens: int) -> None:
        with self._lock:
            self._core.hold_after(num_tokens)

    @property
    def aborted(self) -> list[str]:
        return self._core.aborted

    def abort(self, request_id: str) -> RequestOutput | None:
        with self._lock:
            r = self._core._abort(request_id)
            return None if r is None else self._core._snapshot(r)

    def fail_all(self, exc: BaseException) -> list[RequestOutput]:
        with self._lock:
            self._core._waiting.clear()
            self._core._running.clear()
        return []

    def get_stats(self) -> EngineStats:
        with self._lock:
            return self._core.get_stats()


class _SyncSink:
    """Stands in for a stream inside FakeLLMEngine: snapshots go to the step's output list."""

    def __init__(self, out: list) -> None:
        self.queue = self
        self._out = out

    def put_nowait(self, item) -> None:
        if isinstance(item, RequestOutput):
            self._out.append(item)
