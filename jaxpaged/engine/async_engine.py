"""AsyncEngine: the LLMEngine on its own thread, with an asyncio stream per request.

The engine thread loops ``engine.step()`` while there is work and sleeps on an event
otherwise; each step's outputs are handed to the asyncio loop with
``call_soon_threadsafe``. If a step raises, the engine is dead: every open stream raises
EngineDeadError, new requests are refused, and ``errored`` turns true (servers report
NOT_SERVING).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable

from jaxpaged.engine.llm_engine import EngineDeadError, EngineStats, LLMEngine, Prompt
from jaxpaged.outputs import RequestOutput
from jaxpaged.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class RequestStream:
    """Async iterator of one request's cumulative outputs; ends after the finished one."""

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
    """Serves an LLMEngine to asyncio code. Create it, then ``start()`` inside the loop."""

    def __init__(
        self, engine: LLMEngine, *, on_shutdown: Callable[[], object] | None = None
    ) -> None:
        self.engine = engine
        self._on_shutdown = on_shutdown  # e.g. release the follower hosts of a multi-host run
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._stop = False
        self.dead_error: BaseException | None = None
        self._stats: EngineStats | None = None

    # ------------------------------------------------------------- properties
    @property
    def model_config(self):
        return self.engine.model_config

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def engine_config(self) -> dict[str, object]:
        return self.engine.engine_config

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def get_stats(self) -> EngineStats:
        """The snapshot taken after the latest step: never waits for a running step."""
        if self._stats is None:
            self._stats = self.engine.get_stats()
        return self._stats

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
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
            self._thread = None
        if self._on_shutdown is not None:
            self._on_shutdown()
            self._on_shutdown = None

    # --------------------------------------------------------------- requests
    async def add_request(
        self, request_id: str, prompt: Prompt, params: SamplingParams
    ) -> RequestStream:
        """Validates synchronously (ValueError naming the problem) and queues the request."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine has failed: {self.dead_error}")
        if self._loop is None:
            raise RuntimeError("AsyncEngine.start() has not been called")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        # off the event loop: tokenizing, and the engine lock that a running step holds
        added = asyncio.get_running_loop().run_in_executor(
            None, self.engine.add_request, request_id, prompt, params
        )
        try:
            await asyncio.shield(added)
        except asyncio.CancelledError:
            # the caller went away mid-admission: drop the request once it is in
            self._streams.pop(request_id, None)
            added.add_done_callback(
                lambda f: (
                    f.cancelled()
                    or f.exception() is not None
                    or threading.Thread(target=self.engine.abort, args=(request_id,)).start()
                )
            )
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        self._wake.set()
        return stream

    async def generate(
        self, request_id: str, prompt: Prompt, params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """add_request + iterate; aborts the request if the consumer stops early."""
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.finished:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        """Frees the request's blocks; its stream ends with finish_reason "abort"."""
        out = await asyncio.to_thread(self.engine.abort, request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None and out is not None:
            stream.put(out)

    # ----------------------------------------------------------- engine thread
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]

    def _die(self, exc: BaseException) -> None:
        self.dead_error = exc
        err = EngineDeadError(f"the engine failed: {type(exc).__name__}: {exc}")
        for stream in self._streams.values():
            stream.put(err)
        self._streams.clear()

    def _run(self) -> None:
        assert self._loop is not None
        loop = self._loop
        while not self._stop:
            if not self.engine.has_unfinished_requests():
                self._stats = self.engine.get_stats()
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except BaseException as exc:  # noqa: BLE001 - any failure kills the engine
                logger.exception("engine step failed")
                self.engine.fail_all(exc)
                loop.call_soon_threadsafe(self._die, exc)
                return
            self._stats = self.engine.get_stats()
            if outputs:
                loop.call_soon_threadsafe(self._deliver, outputs)
