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
import os
import time
from collections.abc import AsyncIterator, Mapping

from fake_core import (  # noqa: F401 (the fake model's names, for the tests)
    EOS,
    VOCAB,
    FakeCore,
    FakeRequest,
    FakeTokenizer,
    Stream,
    expected_logprob,
    expected_text,
    model_config,
    new_request,
)

from jaxpaged.engine.core import asleep_message
from jaxpaged.engine.protocol import EngineAsleepError, EngineDeadError, EngineStats, Prompt
from jaxpaged.lora_request import LoRARequest
from jaxpaged.models.config import ModelConfig
from jaxpaged.outputs import (
    RequestOutput,
    RequestOutputKind,
)
from jaxpaged.sampling_params import SamplingParams


class FakeAsyncEngine:
    """An ``EngineClient`` over FakeCore, stepped by an asyncio task every `step_delay`
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
        self._core = FakeCore(
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
        req = new_request(
            request_id,
            prompt,
            params,
            output_kind,
            tokenizer=self._core.tokenizer,
            max_model_len=self._core.max_model_len,
            in_use=self._live,
        )
        self._live.add(request_id)
        req.stream = Stream()
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
    def _admit(self, req: FakeRequest) -> None:
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

    def _send(self, r: FakeRequest, out: RequestOutput) -> None:
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
