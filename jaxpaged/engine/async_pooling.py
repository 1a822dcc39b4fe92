"""AsyncPoolingEngine: a PoolingEngine behind the servers (the ``EngineClient`` protocol),
on a thread of its own.

Requests queue jobs (engine/pooling.py); the engine thread takes every job waiting, prepares
each (tokenizing and checking: a bad one fails alone), runs all their inputs through the
padded buckets together, and hands each request its outputs, so concurrent requests share
batches. Generation requests are refused by name; the admin calls (LoRA, sleep, weights)
do not apply to it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

from jaxpaged.engine.pooling import PoolingEngine, PoolingJob
from jaxpaged.engine.protocol import EngineDeadError, EngineStats, Prompt, Tokenizer
from jaxpaged.lora_request import LoRARequest
from jaxpaged.models.config import ModelConfig
from jaxpaged.outputs import RequestOutput, RequestOutputKind
from jaxpaged.pooling_outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    ScoringRequestOutput,
)
from jaxpaged.sampling_params import SamplingParams

__all__ = ["AsyncPoolingEngine"]

logger = logging.getLogger(__name__)

_Work = tuple[Callable[[], PoolingJob], asyncio.Future]


class AsyncPoolingEngine:
    """The pooling runner for the servers: ``await run(lambda: engine.embed_job(...))``."""

    def __init__(self, engine: PoolingEngine) -> None:
        self.engine = engine
        self._inbox: queue.Queue[_Work | None] = queue.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._dead_error: BaseException | None = None

    # ---- what it serves
    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def model_config(self) -> ModelConfig:
        return self.engine.model_config

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def engine_config(self) -> Mapping[str, object]:
        return self.engine.engine_config

    # ---- health and life cycle
    @property
    def dead_error(self) -> BaseException | None:
        return self._dead_error

    @property
    def errored(self) -> bool:
        return self._dead_error is not None

    def get_stats(self) -> EngineStats:
        return self.engine.get_stats()

    def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="jaxpaged-pooling", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        if self._thread is not None:
            self._inbox.put(None)
            await asyncio.to_thread(self._thread.join, 30)
            self._thread = None

    # ---- pooling (the PoolingClient calls)
    @property
    def is_classifier(self) -> bool:
        return self.engine.info.classifier

    @property
    def class_labels(self) -> tuple[str, ...]:
        return tuple(self.engine.info.id2label)

    async def embed(
        self,
        prompts: Sequence[Prompt],
        *,
        truncate_prompt_tokens: int | None = None,
        dimensions: int | None = None,
        prompt_name: str | None = None,
    ) -> list[EmbeddingRequestOutput]:
        return await self.run(
            lambda: self.engine.embed_job(
                prompts,
                truncate_prompt_tokens=truncate_prompt_tokens,
                dimensions=dimensions,
                prompt_name=prompt_name,
            )
        )

    async def classify(
        self, prompts: Sequence[Prompt], *, truncate_prompt_tokens: int | None = None
    ) -> list[ClassificationRequestOutput]:
        return await self.run(
            lambda: self.engine.classify_job(prompts, truncate_prompt_tokens=truncate_prompt_tokens)
        )

    async def score(
        self,
        text_1: Prompt | Sequence[Prompt],
        text_2: Prompt | Sequence[Prompt],
        *,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ScoringRequestOutput]:
        return await self.run(
            lambda: self.engine.score_job(
                text_1, text_2, truncate_prompt_tokens=truncate_prompt_tokens
            )
        )

    async def run(self, prepare: Callable[[], PoolingJob]) -> Any:  # noqa: ANN401
        """The outputs of the job ``prepare()`` builds on the engine thread (its ValueError,
        a bad input, is raised here)."""
        if self._dead_error is not None:
            raise EngineDeadError(f"the pooling engine failed: {self._dead_error!r}")
        future = asyncio.get_running_loop().create_future()
        self._inbox.put((prepare, future))
        return await future

    def _settle(self, future: asyncio.Future, value: Any, error: BaseException | None) -> None:
        if future.done():  # the request went away
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    def _reply(self, future: asyncio.Future, value: Any, error: BaseException | None) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._settle, future, value, error)

    def _run(self) -> None:
        while True:
            work = [self._inbox.get()]
            while True:  # every job waiting joins this batch
                try:
                    work.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            stop = None in work
            ready: list[tuple[PoolingJob, asyncio.Future]] = []
            for item in work:
                if item is None:
                    continue
                prepare, future = item
                try:
                    ready.append((prepare(), future))
                except Exception as e:  # a bad input fails its own request only
                    self._reply(future, None, e)
            if ready:
                try:
                    results = self.engine.run_jobs([job for job, _ in ready])
                except BaseException as e:  # the device failed: no request can be served
                    logger.exception("pooling engine failed")
                    self._dead_error = e
                    for _, future in ready:
                        self._reply(future, None, EngineDeadError(repr(e)))
                    return
                for (_, future), result in zip(ready, results, strict=True):
                    self._reply(future, result, None)
            if stop:
                return

    # ---- generation: refused by name
    async def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        *,
        output_kind: RequestOutputKind = RequestOutputKind.DELTA,
        lora_name: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        raise ValueError(
            f"model {self.engine.model_name!r} runs the pooling runner (embeddings and scores, "
            "no generation): completions and chat are refused; use /v1/embeddings, /pooling, "
            "/score or /rerank"
        )

    async def abort(self, request_id: str) -> None:
        del request_id  # a pooling request is never queued under an id

    # ---- LoRA, sleep, weights: the pooling runner has none of them
    def list_loras(self) -> Mapping[str, str]:
        return {}

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        raise ValueError("LoRA adapters are not supported by the pooling runner")

    async def remove_lora(self, name: str) -> None:
        raise ValueError("LoRA adapters are not supported by the pooling runner")

    @property
    def is_sleeping(self) -> bool:
        return False

    async def sleep(self, level: int = 1) -> int:
        raise RuntimeError("sleep mode is not supported by the pooling runner (no KV cache)")

    async def wake_up(self) -> None:
        raise RuntimeError("sleep mode is not supported by the pooling runner (no KV cache)")

    async def update_weights_from(self, path: str) -> float:
        raise NotImplementedError("the pooling runner cannot swap weights")
