"""AsyncEngine: an engine's core on a thread of its own, with an asyncio stream per request.

The engine thread is the only one that touches the engine's state: it loops
``core.step()`` while there is work and otherwise sleeps until the core's inbox gets
something. asyncio code only queues (``add_request`` after validating in a worker thread,
``abort``) and receives each step's outputs through ``call_soon_threadsafe``; nothing waits
for a device step, and there is no lock. If a step raises, the engine is dead: every open
stream ends (an error output, then EngineDeadError), new requests are refused, and
``errored`` turns true (the servers report NOT_SERVING).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from jaxpaged.engine.core import EngineStepError, asleep_message
from jaxpaged.engine.input_processor import check_request_id
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.engine.lora import read_adapter
from jaxpaged.engine.protocol import (
    EngineAsleepError,
    EngineDeadError,
    EngineStats,
    Prompt,
    Tokenizer,
)
from jaxpaged.lora_request import LoRARequest
from jaxpaged.models.config import ModelConfig
from jaxpaged.outputs import RequestOutput, RequestOutputKind
from jaxpaged.sampling_params import SamplingParams

__all__ = ["AsyncEngine", "RequestStream"]

logger = logging.getLogger(__name__)

_IDLE_WAIT = 0.05  # seconds the idle engine thread sleeps between looks at its stop flag


class RequestStream:
    """Async iterator of one request's outputs (deltas, or one final output); ends after
    the one with ``finished=True``, or raises what the engine failed with."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item


class AsyncEngine:
    """Serves an LLMEngine's core to asyncio code: the ``EngineClient`` the servers use.
    Create it, then ``start()`` inside the loop."""

    def __init__(
        self, engine: LLMEngine, *, on_shutdown: Callable[[], object] | None = None
    ) -> None:
        self.engine = engine
        self._core = engine.core
        self._on_shutdown = on_shutdown  # e.g. release the follower hosts of a multi-host run
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self._dead_error: BaseException | None = None

    # ------------------------------------------------------------- properties
    @property
    def model_config(self) -> ModelConfig:
        return self.engine.model_config

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def engine_config(self) -> Mapping[str, object]:
        return self.engine.engine_config

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead_error

    @property
    def errored(self) -> bool:
        return self._dead_error is not None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def get_stats(self) -> EngineStats:
        """The snapshot the engine thread took after its latest step: never waits."""
        return self._core.stats

    # -------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="jaxpaged-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Aborts what is left and stops the engine thread."""
        for rid in list(self._streams):
            await self.abort(rid)
        self._stop = True
        self._core.wake()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
            self._thread = None
        if self._on_shutdown is not None:
            self._on_shutdown()
            self._on_shutdown = None

    # --------------------------------------------------------------- requests
    async def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        *,
        output_kind: RequestOutputKind = RequestOutputKind.DELTA,
        lora_name: str | None = None,
    ) -> RequestStream:
        """Validates (ValueError naming the problem; tokenizing runs in a worker thread, off
        the event loop) and queues the request for the engine thread. ``lora_name``: a
        registered LoRA adapter it runs with."""
        if self._core.sleep_level:
            raise EngineAsleepError(asleep_message(self._core.sleep_level))
        if self._dead_error is not None:
            raise EngineDeadError(f"the engine has failed: {self._dead_error}")
        if self._loop is None:
            raise RuntimeError("AsyncEngine.start() has not been called")
        # claimed here, on the loop, so that two adds of one id cannot both pass
        check_request_id(request_id, self._streams)
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        try:
            request = await asyncio.to_thread(
                self.engine.inputs.process,
                request_id,
                prompt,
                params,
                output_kind=output_kind,
                lora_name=lora_name,
            )
        except BaseException:  # invalid, or the caller went away while it was checked
            self._streams.pop(request_id, None)
            raise
        self._core.add_request(request)
        return stream

    async def generate(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        *,
        output_kind: RequestOutputKind = RequestOutputKind.DELTA,
    ) -> AsyncIterator[RequestOutput]:
        """add_request + iterate; aborts the request if the consumer stops early."""
        stream = await self.add_request(request_id, prompt, params, output_kind=output_kind)
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.finished:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        """Queues the abort: the engine thread frees the request's blocks at its next step,
        and its stream ends with finish_reason "abort"."""
        if request_id in self._streams:
            self._core.abort(request_id)

    # ------------------------------------------------------------------ admin
    async def update_weights(self, params: Any) -> None:  # noqa: ANN401 - the params pytree
        """Swaps the weights between two steps (see ``LLMEngine.update_weights``): checked
        and placed in a worker thread, swapped by the engine thread; requests running go on
        with the new weights."""
        if self._dead_error is not None:
            raise EngineDeadError(f"the engine has failed: {self._dead_error}")
        params = await asyncio.to_thread(self.engine.prepare_weights, params)
        core = self._core
        await asyncio.wrap_future(core.call(lambda: core.update_weights(params)))

    async def update_weights_from(self, path: str) -> float:
        """Loads a checkpoint (folder, hub id or .gguf) the way the engine's weights were
        loaded, in a worker thread, then swaps it in (:meth:`update_weights`). Returns the
        seconds the load took."""
        if self.engine.weights_from is None:
            raise NotImplementedError(
                "this engine cannot load weights by path (it was built on params in hand)"
            )
        start = time.perf_counter()
        params = await asyncio.to_thread(self.engine.weights_from, path)
        loaded = time.perf_counter() - start
        await self.update_weights(params)
        return loaded

    async def sleep(self, level: int = 1) -> int:
        """Frees the KV pool (level 2: the weights too) between two steps, as
        ``LLMEngine.sleep``: RuntimeError while requests are unfinished. Returns the KV
        bytes freed."""
        core = self._core
        return await asyncio.wrap_future(core.call(lambda: core.sleep(level)))

    async def wake_up(self) -> None:
        """Restores the KV pool; after level 2 the weights are reloaded the way they were
        loaded (in a worker thread), or RuntimeError for an engine built on params."""
        core, reload = self._core, self.engine.reload_weights
        if core.sleep_level == 2 and reload is not None:
            await self.update_weights(await asyncio.to_thread(reload))
        await asyncio.wrap_future(core.call(core.wake_up))

    @property
    def is_sleeping(self) -> bool:
        return self._core.sleep_level > 0

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Registers a LoRA adapter (its folder read in a worker thread); False if it was
        registered already (see ``LLMEngine.add_lora``)."""
        known = self.engine.list_loras().get(lora_request.lora_name)
        if known is not None and lora_request.lora_path in ("", known):
            return False
        weights = await asyncio.to_thread(read_adapter, self.engine.lora, lora_request)
        name, path, core = lora_request.lora_name, lora_request.lora_path, self._core
        return await asyncio.wrap_future(core.call(lambda: core.add_lora(name, weights, path)))

    async def remove_lora(self, name: str) -> None:
        """Unregisters a LoRA adapter (ValueError if unknown or in use)."""
        core = self._core
        await asyncio.wrap_future(core.call(lambda: core.remove_lora(name)))

    def list_loras(self) -> dict[str, str]:
        """Registered LoRA adapter name -> its folder."""
        return self.engine.list_loras()

    # ----------------------------------------------------------- engine thread
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]

    def _die(self, exc: BaseException, outputs: list[RequestOutput]) -> None:
        self._dead_error = exc  # first: whoever reads an error output sees the engine dead
        self._deliver(outputs)  # every open request's final "error" output
        err = EngineDeadError(f"the engine failed: {type(exc).__name__}: {exc}")
        for stream in self._streams.values():
            stream.put(err)
        self._streams.clear()

    def _run(self) -> None:
        assert self._loop is not None
        loop, core = self._loop, self._core
        while not self._stop:
            if not core.has_work():
                core.wait_for_work(_IDLE_WAIT)
                continue
            try:
                outputs = core.step()
            except EngineStepError as exc:
                logger.exception("engine step failed")
                cause = exc.__cause__ or exc
                loop.call_soon_threadsafe(self._die, cause, exc.outputs)
                return
            except BaseException as exc:  # noqa: BLE001 - any failure kills the engine
                logger.exception("engine loop failed")
                loop.call_soon_threadsafe(self._die, exc, core.fail_all(exc))
                return
            if outputs:
                loop.call_soon_threadsafe(self._deliver, outputs)
