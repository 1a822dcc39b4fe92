"""Request: one sequence being generated, as the scheduler sees it.

A request's known tokens are ``prompt_token_ids + output_token_ids``. Steps overlap: a step is
scheduled and dispatched before the previous one's sampled tokens reach the host, so a request
may also have ``num_inflight`` tokens sampled on the device that the host has not seen yet
(``num_total_tokens`` counts them). The first ``num_computed_tokens`` of all tokens have their
K/V in the cache or written by a step already dispatched (the scheduler advances it when it
schedules). Its KV blocks are not here: the scheduler's ``BlockPool`` keeps every request's
block table (device blocks, host slots while SWAPPED, prefix keys) under its ``request_id``.

``n > 1``: the engine adds n Requests that share ``parent_id`` (the user's request id) and
differ in ``request_id`` and ``sample_index`` (0..n-1). The scheduler prefills the prompt
once and forks the others from it (they share every prompt block, copy-on-write).

The scheduler owns every mutable field and never hands a Request to another layer: what it
tells the runner and the engine is plain data (``NewRequestData``, ``ScheduledSeq``,
``RequestUpdate``).
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Mapping, Sequence

from jaxpaged.outputs import Logprob
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.sched.images import ImageItem, image_key_slice
from jaxpaged.sched.output import NewRequestData, ScheduledSeq

__all__ = ["FinishReason", "Request", "RequestStatus"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "finished_stopped"  # EOS, a stop token id, or a stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens or max_model_len reached
    FINISHED_ABORTED = "finished_aborted"  # the client went away, or abort() was called
    FINISHED_ERROR = "finished_error"  # the engine failed while serving it

    @property
    def is_finished(self) -> bool:
        return self.name.startswith("FINISHED")

    @property
    def finish_reason(self) -> str | None:
        """OpenAI-style reason: "stop", "length", "abort", "error"; None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}

FinishReason = str  # "stop" | "length" | "abort" | "error"


@dataclasses.dataclass(eq=False, repr=False, kw_only=True)
class Request:
    """Mutable per-request state; identity equality (two requests are never equal)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()  # set by the engine from the model / tokenizer
    prompt: str | None = None  # prompt text, for the engine's outputs only
    parent_id: str | None = None  # the user's request id when n > 1 (shared by siblings)
    sample_index: int = 0  # index among the n samples of one prompt (0..n-1)
    arrival_time: float = dataclasses.field(default_factory=time.time)
    lora_name: str | None = None  # the LoRA adapter it runs with (None: the base model)
    images: tuple[ImageItem, ...] = ()  # images whose placeholders are in the prompt
    pooling: bool = False  # returns its last prompt token's hidden state (max_tokens=1)

    # --- scheduler-owned state ---
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_inflight: int = 0  # sampled by dispatched steps, not yet seen by the host
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the cache (prefix hit or fork)
    num_preemptions: int = 0
    arrival_order: int = -1  # FCFS priority and engine-unique id, set by add_request
    rng_stream: int = 0  # engine-unique stream for unseeded sampling, set by add_request
    max_tokens: int = 0  # effective max output tokens, set by Scheduler.add_request
    state_row: int = -1  # row of the on-device sampler state while running, -1 = none
    lora_slot: int = 0  # the device slot of its adapter while it holds one (0 = none)
    first_token_time: float | None = None
    finish_time: float | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # prompt_logprobs: the logprob of prompt token i + 1 at index i, as steps compute them
    prompt_logprobs: list[Logprob] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)

    def __repr__(self) -> str:  # compact: prompts can be thousands of tokens
        return (
            f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )

    # --- derived ---
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens the host knows: prompt + output."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_total_tokens(self) -> int:
        """Known tokens plus those sampled on the device and not yet seen."""
        return self.num_tokens + self.num_inflight

    @property
    def num_generated(self) -> int:
        """Output tokens sampled so far, seen or not (the next one's place in its stream)."""
        return len(self.output_token_ids) + self.num_inflight

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def prefix_key_slice(self, start: int, stop: int) -> Sequence[int]:
        """What the prefix-cache keys of tokens [start, stop) hash: the token ids, each image
        placeholder replaced by its image's key (ImageItem.key)."""
        tokens = self.token_ids_slice(start, stop)
        return image_key_slice(tokens, start, self.images) if self.images else tokens

    def token_ids_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output without building the whole list."""
        p = len(self.prompt_token_ids)
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        if start >= p:
            return self.output_token_ids[start - p : stop - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - p]

    @property
    def group_id(self) -> str:
        """The user-visible id: parent_id for n > 1 samples, else request_id."""
        return self.parent_id if self.parent_id is not None else self.request_id

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.status.finish_reason

    @property
    def is_prefill(self) -> bool:
        """True while more than one token is uncomputed (prompt, or recompute after preemption)."""
        return self.num_total_tokens - self.num_computed_tokens > 1

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether its prompt's log-probabilities are still to compute (the first sample of a
        request with prompt_logprobs computes them; its siblings fork from it)."""
        return (
            self.sampling_params.prompt_logprobs is not None
            and self.sample_index == 0
            and len(self.prompt_logprobs) < self.num_prompt_tokens - 1
        )

    def prompt_logprob_targets(self, start: int, end: int) -> tuple[int, ...]:
        """The prompt tokens whose logprobs positions ``start .. end - 1`` give (each the
        token after its position), when they are still wanted; else ()."""
        if not self.wants_prompt_logprobs:
            return ()
        return tuple(self.prompt_token_ids[start + 1 : min(end, self.num_prompt_tokens - 1) + 1])

    def add_prompt_logprobs(self, start: int, logprobs: Sequence[Logprob]) -> None:
        """Keeps the logprobs of positions ``start ..`` not kept yet (a recompute after a
        preemption computes them again)."""
        for i, lp in enumerate(logprobs, start):
            if i == len(self.prompt_logprobs):
                self.prompt_logprobs.append(lp)

    def length_reached(self, max_model_len: int) -> bool:
        """Whether the last token ``max_tokens`` or ``max_model_len`` allows is already
        sampled (seen by the host or still in flight)."""
        return self.num_generated >= self.max_tokens or self.num_total_tokens >= max_model_len

    def stop_status(self, token: int, max_model_len: int) -> RequestStatus | None:
        """The finished status that appending ``token`` (just done) ends it with, if any
        token-based stop condition holds (setting ``stop_reason``); None to go on."""
        sp = self.sampling_params
        n_out = self.num_output_tokens
        if n_out >= sp.min_tokens:
            if not sp.ignore_eos and token in self.eos_token_ids:
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if token in sp.stop_token_ids:
                self.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if n_out >= self.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    @property
    def can_speculate(self) -> bool:
        """Whether its decodes may verify drafted tokens: each verified position is sampled
        as if the drafts before it were accepted, which per-request state (penalties,
        min_tokens, logit_bias, logits processors: the token history) would have to follow;
        those requests decode one token a step, as do requests that turned speculation off
        (``SamplingParams.speculative``). A grammar's mask does follow drafts (a copy of
        the matcher walks them on the host: the engine core for n-gram drafts, the runner
        after reading back drafts made on the device), so structured-output requests draft
        with every proposer (``grammar_drafts``), once their last token is on the host."""
        sp = self.sampling_params
        return sp.speculative and not self.needs_state_row

    @property
    def needs_state_row(self) -> bool:
        """Whether its sampling reads on-device per-request state: penalties, min_tokens,
        logit_bias or a logits processor (which reads the token history)."""
        sp = self.sampling_params
        return (
            sp.repetition_penalty != 1.0
            or sp.presence_penalty != 0.0
            or sp.frequency_penalty != 0.0
            or sp.min_tokens > 0
            or sp.logits_processor is not None
            or bool(sp.logit_bias)
        )

    def new_request_data(self) -> NewRequestData:
        """What the runner keeps of it while it is in the batch (sent once per stay)."""
        sp = self.sampling_params
        return NewRequestData(
            request_id=self.request_id,
            seq_id=self.arrival_order,
            params=sp,
            key_stream=self.sample_index if sp.seed is not None else self.rng_stream,
            state_row=self.state_row,
            lora_slot=self.lora_slot,
            images=self.images,
            pooling=self.pooling,
        )

    def scheduled_seq(
        self,
        start: int,
        n: int,
        *,
        prev_rows: Mapping[str, int],
        block_changes: tuple[int, Sequence[int]],
        drafts: Sequence[int] = (),
    ) -> ScheduledSeq:
        """The plan entry feeding tokens ``start .. start + n``; ``prev_rows``: the rows of
        the last planned step's samples, for a decode of the token still in flight;
        ``block_changes``: (first changed entry, the table from there) of its block table;
        ``drafts``: speculative tokens fed after them (a decode of the last known token)."""
        end = start + n
        prev_row = -1
        if end > self.num_tokens:  # feeds the token in flight: a decode of it alone
            if n != 1 or self.num_inflight != 1 or self.request_id not in prev_rows:
                raise RuntimeError(
                    f"{self.request_id}: cannot feed tokens the host has not seen "
                    f"(start {start}, {n} tokens, {self.num_tokens} known)"
                )
            prev_row = prev_rows[self.request_id]
            token_ids: tuple[int, ...] = (0,)
        else:
            token_ids = tuple(self.token_ids_slice(start, end))
        block_start, new_block_ids = block_changes
        return ScheduledSeq(
            request_id=self.request_id,
            seq_id=self.arrival_order,
            token_ids=token_ids + tuple(drafts),
            prev_row=prev_row,
            start_pos=start,
            new_block_ids=tuple(new_block_ids),
            block_start=block_start,
            key_counter=self.num_generated if end == self.num_total_tokens else -1,
            prompt_targets=self.prompt_logprob_targets(start, end),
            prompt_top_k=self.sampling_params.prompt_logprobs or 0,
            num_draft_tokens=len(drafts),
            next_token=self.token_ids_slice(end, end + 1)[0] if end < self.num_tokens else -1,
        )
