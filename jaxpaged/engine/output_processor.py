"""Output processing on the engine thread: turns the scheduler's per-request updates into what
callers receive. Detokenizes incrementally, ends requests on stop strings (telling the
scheduler at once, so no later step is wasted on them), and emits for each user request
either its deltas (``DELTA``) or one final output (``FINAL_ONLY``). Nothing is rebuilt per
step: a DELTA output holds only the new text, ids and logprobs; a FINAL_ONLY request keeps its
tokens until it ends.

A user request with ``n > 1`` is n scheduler requests (``id#0 .. id#n-1``); this module maps
them back to one :class:`RequestOutput` with one :class:`CompletionOutput` per sample.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence

from jaxpaged.engine.detokenizer import IncrementalDetokenizer, NullDetokenizer, Tokenizer
from jaxpaged.outputs import (
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
    RequestOutputKind,
)
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.sched.output import RequestUpdate

__all__ = ["OutputProcessor", "sample_request_ids"]


def sample_request_ids(request_id: str, n: int) -> list[str]:
    """Scheduler ids of a user request's n samples."""
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]


@dataclasses.dataclass(eq=False)
class _Sample:
    index: int
    detokenizer: IncrementalDetokenizer | NullDetokenizer
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # FINAL_ONLY: everything so far; DELTA: what this step added (cleared once emitted)
    text: list[str] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[Logprob] = dataclasses.field(default_factory=list)
    changed: bool = False  # DELTA: has news to emit

    def take(self, wants_logprobs: bool, *, clear: bool) -> CompletionOutput:
        out = CompletionOutput(
            index=self.index,
            text="".join(self.text),
            token_ids=tuple(self.token_ids),
            logprobs=tuple(self.logprobs) if wants_logprobs else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
        if clear:
            self.text.clear()
            self.token_ids.clear()
            self.logprobs.clear()
            self.changed = False
        return out


@dataclasses.dataclass(eq=False)
class _Group:
    """One user request: its samples, how it wants its outputs, and its times."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    kind: RequestOutputKind
    samples: list[_Sample]
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: tuple[Logprob | None, ...] | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class OutputProcessor:
    """Per-request output state (see the module docstring). Engine thread only."""

    def __init__(self, tokenizer: Tokenizer | None, clock: Callable[[], float] = time.time) -> None:
        self.tokenizer = tokenizer
        self.clock = clock
        self._groups: dict[str, _Group] = {}
        self._by_sample: dict[str, tuple[_Group, _Sample]] = {}  # scheduler id -> sample

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._groups

    def __len__(self) -> int:
        return len(self._groups)

    def add(
        self,
        request_id: str,
        *,
        prompt: str | None,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        kind: RequestOutputKind,
        arrival_time: float,
    ) -> list[str]:
        """Registers a user request; returns the scheduler ids of its samples."""
        ids = sample_request_ids(request_id, params.n)
        samples = [
            _Sample(
                index=i,
                detokenizer=NullDetokenizer()
                if self.tokenizer is None
                else IncrementalDetokenizer(
                    self.tokenizer,
                    prompt_token_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    stop=params.stop,
                    include_stop_str_in_output=params.include_stop_str_in_output,
                ),
            )
            for i in range(params.n)
        ]
        group = _Group(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=tuple(prompt_token_ids),
            params=params,
            kind=kind,
            samples=samples,
            arrival_time=arrival_time,
        )
        self._groups[request_id] = group
        for sid, sample in zip(ids, samples, strict=True):
            self._by_sample[sid] = (group, sample)
        return ids

    def scheduled(self, request_ids: Iterable[str], cached_tokens: Callable[[str], int]) -> None:
        """Notes the first time each request is scheduled (and its prefix-cache hit)."""
        now = self.clock()
        for sid in request_ids:
            entry = self._by_sample.get(sid)
            if entry is not None and entry[0].first_scheduled_time is None:
                entry[0].first_scheduled_time = now
                entry[0].num_cached_tokens = cached_tokens(sid)

    def process(
        self,
        updates: Sequence[RequestUpdate],
        finish_on_stop_string: Callable[[str, str], None],
    ) -> list[RequestOutput]:
        """Applies one step's updates. ``finish_on_stop_string(sample_id, stop)`` ends a
        sample in the scheduler when its text hits a stop string."""
        now = self.clock()
        touched: dict[str, _Group] = {}
        for u in updates:
            entry = self._by_sample.get(u.request_id)
            if entry is None:
                continue
            group, sample = entry
            if sample.finish_reason is not None:
                continue
            touched[group.request_id] = group
            if u.new_token_ids and group.first_token_time is None:
                group.first_token_time = now
            delta, stopped, kept = _detokenize(sample.detokenizer, u.new_token_ids)
            finish_reason, stop_reason = u.finish_reason, u.stop_reason
            if stopped and finish_reason is None:
                stop_reason = sample.detokenizer.stop_reason
                finish_on_stop_string(u.request_id, stop_reason)
                finish_reason = "stop"
            elif stopped:
                finish_reason, stop_reason = "stop", sample.detokenizer.stop_reason
            elif finish_reason is not None:
                delta += sample.detokenizer.flush()
            if u.error is not None:
                group.error = u.error
            if u.prompt_logprobs is not None and sample.index == 0:
                group.prompt_logprobs = (None, *u.prompt_logprobs)
            sample.text.append(delta)
            sample.token_ids.extend(u.new_token_ids[:kept])
            sample.logprobs.extend(u.new_logprobs[:kept])
            sample.changed = True
            if finish_reason is not None:
                self._end_sample(group, sample, u.request_id, finish_reason, stop_reason, now)
        return self._emit(touched.values())

    def end(
        self, request_id: str, reason: str = "abort", error: str | None = None
    ) -> tuple[list[str], RequestOutput | None]:
        """Ends a user request from outside (abort, or an error of its own): returns the
        scheduler ids of its unfinished samples (to end there too) and its final output, or
        ([], None) when the id is unknown or finished."""
        group = self._groups.get(request_id)
        if group is None:
            return [], None
        if error is not None:
            group.error = error
        return self._end_group(group, reason), self._emit([group])[0]

    def fail_all(self, error: str) -> list[RequestOutput]:
        """Ends every request with finish_reason "error" (the engine can serve no more)."""
        groups = list(self._groups.values())
        for group in groups:
            group.error = error
            self._end_group(group, "error")
        return self._emit(groups)

    def _end_group(self, group: _Group, reason: str) -> list[str]:
        now = self.clock()
        ids = sample_request_ids(group.request_id, len(group.samples))
        ended = []
        for sid, sample in zip(ids, group.samples, strict=True):
            if sample.finish_reason is None:
                sample.changed = True
                self._end_sample(group, sample, sid, reason, None, now)
                ended.append(sid)
        return ended

    def _end_sample(
        self,
        group: _Group,
        sample: _Sample,
        sample_id: str,
        reason: str,
        stop_reason: int | str | None,
        now: float,
    ) -> None:
        sample.finish_reason = reason
        sample.stop_reason = stop_reason
        del self._by_sample[sample_id]
        if group.finished:
            group.finished_time = now

    def _emit(self, groups: Iterable[_Group]) -> list[RequestOutput]:
        outputs = []
        for group in groups:
            finished = group.finished
            wants_logprobs = group.params.logprobs is not None
            if group.kind is RequestOutputKind.FINAL_ONLY:
                if not finished:
                    continue
                completions = [s.take(wants_logprobs, clear=False) for s in group.samples]
            else:
                completions = [
                    s.take(wants_logprobs, clear=True) for s in group.samples if s.changed
                ]
            if finished:
                del self._groups[group.request_id]
            outputs.append(
                RequestOutput(
                    request_id=group.request_id,
                    prompt=group.prompt,
                    prompt_token_ids=group.prompt_token_ids,
                    outputs=tuple(completions),
                    finished=finished,
                    metrics=RequestMetrics(
                        arrival_time=group.arrival_time,
                        first_scheduled_time=group.first_scheduled_time,
                        first_token_time=group.first_token_time,
                        finished_time=group.finished_time,
                    ),
                    num_cached_tokens=group.num_cached_tokens,
                    error=group.error,
                    prompt_logprobs=group.prompt_logprobs,
                )
            )
        return outputs


def _detokenize(
    detokenizer: IncrementalDetokenizer | NullDetokenizer, token_ids: Sequence[int]
) -> tuple[str, bool, int]:
    """(text delta, stopped, tokens kept) of one update's tokens. Several tokens (a step
    that verified drafts) go in one at a time, as steps without speculation would bring
    them, so a stop string ends the output at the same token and the text is the same."""
    if len(token_ids) <= 1:
        delta, stopped = detokenizer.add_tokens(token_ids)
        return delta, stopped, len(token_ids)
    parts = []
    for i, t in enumerate(token_ids):
        delta, stopped = detokenizer.add_tokens((t,))
        parts.append(delta)
        if stopped:
            return "".join(parts), True, i + 1
    return "".join(parts), False, len(token_ids)
