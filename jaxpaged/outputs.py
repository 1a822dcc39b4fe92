"""What generation returns: vLLM-shaped RequestOutput / CompletionOutput records.

A caller chooses per request how outputs arrive (:class:`RequestOutputKind`): ``DELTA``
(streaming: each RequestOutput holds, for each sample that changed, only the new text, token
ids and logprobs; a sample's last delta carries its finish_reason; the request's last output
has ``finished=True``) or ``FINAL_ONLY`` (``LLM.generate``: one RequestOutput when the whole
request is done, every sample complete). The engine never rebuilds a cumulative snapshot per
step.
"""

from __future__ import annotations

import dataclasses
import enum


class RequestOutputKind(enum.Enum):
    DELTA = "delta"  # each output carries only what is new since the previous one
    FINAL_ONLY = "final_only"  # one output, once the request is finished, with everything


@dataclasses.dataclass(frozen=True, kw_only=True)
class Logprob:
    """One sampled token's log-probability and the top alternatives at that position."""

    token_id: int
    logprob: float
    top: dict[int, float]  # token id -> logprob, best first


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompletionOutput:
    """One of the n samples of a request: what is new (DELTA) or all of it (FINAL_ONLY)."""

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
    """One user request's news after an engine step: the samples that changed (DELTA), or
    every sample, complete (FINAL_ONLY). ``index`` of each CompletionOutput names its sample."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    error: str | None = None  # set when the engine failed while serving this request
    # SamplingParams.prompt_logprobs: one per prompt token, None for the first (nothing
    # precedes it); on every output once the first token is out, else None
    prompt_logprobs: tuple[Logprob | None, ...] | None = None
