"""What generation returns: vLLM-shaped RequestOutput / CompletionOutput records."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class Logprob:
    """One sampled token's log-probability and the top alternatives at that position."""

    token_id: int
    logprob: float
    top: dict[int, float]  # token id -> logprob, best first


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompletionOutput:
    """One of the n samples of a request, cumulative so far."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[Logprob, ...] | None
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(frozen=True, kw_only=True)
class RequestMetrics:
    """Wall-clock times (time.time()) of a request's life; None until they happen."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class RequestOutput:
    """State of one user request after an engine step: every sample, cumulative."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    error: str | None = None  # set when the engine failed while serving this request
