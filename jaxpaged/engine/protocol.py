"""What callers of an engine may rely on: the stats snapshot, the failure type, and the
``EngineClient`` protocol that the servers' front end talks to (the real ``AsyncEngine`` and
the test fakes both implement it, so neither can drift from the other)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Protocol, runtime_checkable

from jaxpaged.models.config import ModelConfig
from jaxpaged.outputs import RequestOutput, RequestOutputKind
from jaxpaged.sampling_params import SamplingParams

__all__ = ["EngineAsleepError", "EngineClient", "EngineDeadError", "EngineStats", "Prompt"]

Prompt = str | Sequence[int]


class EngineDeadError(RuntimeError):
    """The engine failed while serving; no request can be served any more."""


class EngineAsleepError(RuntimeError):
    """A request reached an engine that is asleep (``sleep()``, its KV cache freed): call
    ``wake_up()`` first."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineStats:
    """A snapshot of the engine's gauges and counters (for metrics endpoints and tests),
    taken by the engine thread after a step: reading it never waits for the device."""

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


class Tokenizer(Protocol):
    """What the servers use of a tokenizer (transformers' tokenizers fit)."""

    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def apply_chat_template(self, conversation, **kwargs): ...  # noqa: ANN001, ANN003


@runtime_checkable
class EngineClient(Protocol):
    """An engine as asyncio code sees it. ``add_request`` validates (ValueError naming the
    problem) and returns the request's stream of outputs: deltas (``DELTA``: each output
    holds only what is new) or one final output (``FINAL_ONLY``). ``abort`` ends a request;
    its stream then ends with finish_reason "abort". If the engine dies, every open stream
    raises :class:`EngineDeadError` and ``dead_error`` is set."""

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def model_config(self) -> ModelConfig: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def engine_config(self) -> Mapping[str, object]: ...

    @property
    def dead_error(self) -> BaseException | None: ...

    @property
    def errored(self) -> bool: ...

    def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    async def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        *,
        output_kind: RequestOutputKind = RequestOutputKind.DELTA,
    ) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    def get_stats(self) -> EngineStats: ...
