"""What gRPC and HTTP share: the server's life phase, admission (auth, readiness, queue limit),
in-flight tracking, abort-on-exit streams, engine-failure detection and drain.

Both front ends turn a request into ``Frontend.open(...)``, iterate the returned
:class:`RequestHandle` inside ``async with`` and map the exceptions below to their status
codes. Leaving the ``async with`` early for any reason (client cancel, deadline, disconnect,
an error while sending) aborts the request in the engine, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import functools
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

from jaxpaged.engine.images import MAX_IMAGE_BYTES, chat_images
from jaxpaged.engine.protocol import EngineAsleepError, EngineClient, EngineDeadError, Prompt
from jaxpaged.outputs import RequestOutput, RequestOutputKind
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.serving.errors import (
    EngineFailure,
    InvalidRequest,
    Overloaded,
    ServingError,
    Unauthenticated,
    Unavailable,
    field_of,
)
from jaxpaged.serving.media import fetch_image_bytes
from jaxpaged.serving.metrics import RequestTotals, ServingMetrics
from jaxpaged.serving.reasoning import REASONING_PARSERS
from jaxpaged.serving.tool_parsers import TOOL_CALL_PARSERS
from jaxpaged.serving.tool_prompt import TemplateToolSupport, conversation_for_template

__all__ = [
    "EngineDeadError",
    "Frontend",
    "Phase",
    "RequestHandle",
    "ServingConfig",
    "close_all",
    "output_kind_for",
]

log = logging.getLogger("jaxpaged.serving")

# apply_chat_template's own arguments, which chat_template_kwargs may not override
_RESERVED_TEMPLATE_ARGS = frozenset(
    {"conversation", "messages", "tokenize", "add_generation_prompt", "chat_template",
     "return_dict", "return_tensors", "padding", "truncation", "max_length", "tools",
     "documents", "continue_final_message", "tokenizer_kwargs"}
)  # fmt: skip


class Phase(str, enum.Enum):
    LOADING = "loading"
    SERVING = "serving"
    DRAINING = "draining"
    FAILED = "failed"
    STOPPED = "stopped"


def output_kind_for(*, stream: bool) -> RequestOutputKind:
    """A streaming response forwards each delta; a non-streaming one needs only the one
    complete output at the end (the engine then builds no per-step outputs for it)."""
    return RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServingConfig:
    """Server settings that are not engine settings."""

    served_model_name: str
    served_model_aliases: tuple[str, ...] = ()  # more names requests may use (--served-model-name)
    model_path: str = ""
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 50051
    max_queue_len: int | None = None  # requests waiting for their first token; None = no limit
    api_key: str | None = None
    shutdown_timeout: float = 30.0  # seconds
    chat_template: str | None = None  # template text (a file is read by the CLI)
    enable_weight_updates: bool = False  # serve jaxpaged.v1.Admin (UpdateWeights) over gRPC
    reasoning_parser: str | None = None  # splits <think>...</think> into reasoning_content
    tool_call_parser: str | None = None  # the model's tool-call format (serving/tool_parsers.py)
    enable_auto_tool_choice: bool = False  # tool_choice "auto": the model decides to call
    # serve /v1/load_lora_adapter and /v1/unload_lora_adapter (also with the environment
    # variable VLLM_ALLOW_RUNTIME_LORA_UPDATING=true, as vLLM)
    allow_runtime_lora_updating: bool = False
    # Responses API: how many stored responses are kept (least recently used evicted first)
    responses_store_size: int = 1024
    # seconds between the log's stats lines (vLLM's throughput and SpecDecoding lines,
    # serving/stats_log.py) while the engine is busy; 0: none (--disable-log-stats)
    log_stats_interval: float = 10.0
    # hosts whose http(s) image URLs chat requests may name (empty: fetching is off), and
    # the time one fetch may take in all (serving/media.py)
    allowed_media_domains: tuple[str, ...] = ()
    media_fetch_timeout: float = 10.0

    def __post_init__(self) -> None:
        if self.responses_store_size < 0:
            raise ValueError(f"responses_store_size must be >= 0, got {self.responses_store_size}")
        if not self.served_model_name or not all(self.served_model_aliases):
            raise ValueError("served_model_name must not be empty")
        if self.max_queue_len is not None and self.max_queue_len < 1:
            raise ValueError(
                f"max_queue_len must be >= 1 (or None: no limit), got {self.max_queue_len}"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser must be one of {list(REASONING_PARSERS)}, "
                f"got {self.reasoning_parser!r}"
            )
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {list(TOOL_CALL_PARSERS)}, "
                f"got {self.tool_call_parser!r}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser")
        if self.log_stats_interval < 0:
            raise ValueError(f"log_stats_interval must be >= 0, got {self.log_stats_interval}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        for name in ("port", "grpc_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {getattr(self, name)}")


class RequestHandle:
    """One admitted engine request: an async iterator of the engine's RequestOutputs as they
    arrive (deltas, or the one FINAL_ONLY output). Counts tokens and finish reasons into
    ``totals`` (usage, metrics) and keeps no text. Use inside ``async with``: leaving before
    the final output aborts the request."""

    def __init__(
        self,
        frontend: Frontend,
        request_id: str,
        stream: AsyncIterator[RequestOutput],
        arrival: float,
        output_kind: RequestOutputKind,
    ) -> None:
        self.request_id = request_id
        self.output_kind = output_kind
        self.started = False  # a first output arrived
        self.finished = False  # the final output arrived, or the engine dropped the request
        self.totals = RequestTotals()
        self._frontend = frontend
        self._stream = stream
        self._arrival = arrival
        self._last_time = arrival  # time.monotonic() of the latest output that brought tokens
        self._failed = False  # an output said the engine failed this request
        self._closed = False

    @property
    def streams_tokens(self) -> bool:
        """Outputs arrive as tokens are generated (DELTA), not once at the end."""
        return self.output_kind is RequestOutputKind.DELTA

    async def __aenter__(self) -> RequestHandle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        frontend = self._frontend
        try:
            async for out in self._stream:
                self._observe(out, time.monotonic())
                if out.finished and self._failed:
                    frontend.check_engine()  # a dead engine ends its requests with errors
                    raise EngineFailure(
                        f"the engine failed while serving this request: {out.error}"
                    )
                yield out
                if self.finished:
                    return
        except EngineDeadError as e:
            self.finished = True  # the engine has already dropped it
            frontend.mark_failed(e)
            raise EngineFailure(f"the engine failed: {e}") from e
        except ServingError:
            raise
        except Exception as e:  # never a hang or a bare 500: this request fails, others go on
            log.exception("request %s failed", self.request_id)
            raise EngineFailure(f"request failed: {type(e).__name__}: {e}") from e
        if not self.finished:
            raise EngineFailure("the engine ended the stream without a final output")

    def _observe(self, out: RequestOutput, now: float) -> None:
        """Counts one output into the totals and the inter-token-latency metric."""
        self.started = True
        had_tokens = self._last_time != self._arrival
        new = self.totals.add(out)
        self._failed = (
            self._failed
            or out.error is not None
            or any(c.finish_reason == "error" for c in out.outputs)
        )
        if new and had_tokens:
            self._frontend.metrics.observe_inter_token(now - self._last_time, new)
        if new:
            self._last_time = now
        if out.finished:
            self.finished = True
            if not self.streams_tokens:
                self._observe_spread_inter_token()

    def _observe_spread_inter_token(self) -> None:
        """A FINAL_ONLY request's tokens arrive together: its gaps between tokens (each
        sample's tokens after its first) share the engine's first-token-to-finish span."""
        m = self.totals.metrics
        if m is None or m.first_token_time is None or m.finished_time is None:
            return
        first_tokens = sum(1 for n in self.totals.num_tokens.values() if n)
        gaps = self.totals.num_completion_tokens - first_tokens
        if gaps > 0:
            span = max(0.0, m.finished_time - m.first_token_time)
            self._frontend.metrics.observe_inter_token(span, gaps)

    def close_nowait(self) -> asyncio.Task | None:
        """Forgets the request and, unless it finished, starts its abort in a task of its own
        (so that a cancellation of the caller, even a repeated one, cannot stop it)."""
        if self._closed:
            return None
        self._closed = True
        frontend = self._frontend
        frontend._in_flight.discard(self)
        frontend._changed()
        if self.totals.finished:
            frontend.metrics.observe_finished(self.totals)
        if self.finished or frontend.engine is None:
            return None
        task = asyncio.get_running_loop().create_task(frontend._abort_quietly(self.request_id))
        frontend._background.add(task)
        task.add_done_callback(frontend._background.discard)
        return task

    async def close(self) -> None:
        """Aborts the request unless it finished; safe to call twice."""
        task = self.close_nowait()
        if task is not None:
            await asyncio.shield(task)


async def close_all(handles: Sequence[RequestHandle]) -> None:
    """Closes several handles, starting every abort before waiting for any."""
    tasks = [t for t in (h.close_nowait() for h in handles) if t is not None]
    if tasks:
        await asyncio.shield(asyncio.gather(*tasks))


class Frontend:
    """The serving state shared by the gRPC servicer and the HTTP app."""

    def __init__(self, config: ServingConfig, metrics: ServingMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics if metrics is not None else ServingMetrics()
        self.engine: EngineClient | None = None  # once loaded
        self.phase = Phase.LOADING
        self.failure: BaseException | None = None
        # open handles (by identity: the engine may reuse the id of a request whose final
        # output is out before its handle is closed)
        self._in_flight: set[RequestHandle] = set()
        self._listeners: list[Callable[[Phase], None]] = []
        self._background: set[asyncio.Task] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._force = asyncio.Event()
        self._admitting = 0
        self._tool_support: TemplateToolSupport | None = None  # probed on first use
        self.metrics.bind(self)

    # ---- life cycle -------------------------------------------------------------------------
    def add_listener(self, fn: Callable[[Phase], None]) -> None:
        """fn(phase) is called on every phase change (e.g. to update gRPC health)."""
        self._listeners.append(fn)

    def _set_phase(self, phase: Phase) -> None:
        if phase == self.phase:
            return
        log.info("server state: %s -> %s", self.phase.value, phase.value)
        self.phase = phase
        for fn in self._listeners:
            fn(phase)

    def attach_engine(self, engine: EngineClient) -> None:
        """The engine is loaded and started: accept requests."""
        self.engine = engine
        if self.phase == Phase.LOADING:
            self._set_phase(Phase.SERVING)

    def mark_failed(self, error: BaseException | None) -> None:
        if self.phase in (Phase.FAILED, Phase.STOPPED):
            return
        self.failure = error
        log.error("engine failed: %r; refusing new requests", error)
        self._set_phase(Phase.FAILED)

    def check_engine(self) -> None:
        """Turns an engine that died on its own into the FAILED phase (polled by the server)."""
        if self.engine is not None and self.engine.errored:
            self.mark_failed(self.engine.dead_error)

    @property
    def ready(self) -> bool:
        self.check_engine()
        return self.phase == Phase.SERVING

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def num_queued(self) -> int:
        """Requests being admitted or admitted and still waiting for their first token. A
        streaming request shows its first token; a FINAL_ONLY one shows nothing until it
        ends, so those are counted from the engine's waiting queue (see _final_only_waiting)."""
        handles = list(self._in_flight)
        unstarted = sum(1 for h in handles if h.streams_tokens and not h.started)
        final_only = sum(1 for h in handles if not h.streams_tokens and not h.finished)
        return self._admitting + unstarted + self._final_only_waiting(final_only, unstarted)

    def _final_only_waiting(self, final_only: int, unstarted: int) -> int:
        """How many of the `final_only` open FINAL_ONLY requests wait in the engine: its
        waiting requests less the `unstarted` streaming ones (which may be among them), at
        most `final_only`. The engine's stats lag by up to one step."""
        if not final_only or self.engine is None:
            return 0
        waiting = self.engine.get_stats().num_waiting
        return min(final_only, max(0, waiting - unstarted))

    def _changed(self) -> None:
        if self._in_flight:
            self._idle.clear()
        else:
            self._idle.set()

    # ---- admission ----------------------------------------------------------------------------
    def check_api_key(self, presented: str | None) -> None:
        """presented: the value of an `authorization` header/metadata entry, or None."""
        key = self.config.api_key
        if key is None:
            return
        if presented is None:
            raise Unauthenticated("missing API key: send 'Authorization: Bearer <key>'")
        scheme, _, token = presented.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), key.encode()
        ):
            raise Unauthenticated("invalid API key")

    def check_ready(self) -> None:
        self.check_engine()
        if self.phase == Phase.SERVING:
            return
        reasons = {
            Phase.LOADING: "the model is still loading",
            Phase.DRAINING: "the server is shutting down",
            Phase.STOPPED: "the server is shutting down",
            Phase.FAILED: f"the engine failed ({self.failure!r}); restart the server",
        }
        raise Unavailable(f"server not ready: {reasons[self.phase]}")

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
        tokenize: bool = True,
    ) -> Any:
        """Token ids of a conversation under the chat template, ready for the reply (the same
        ids as ``LLM.chat`` uses); ``tokenize=False``: the rendered text. ``template_kwargs`` become variables of the template (the
        request's ``chat_template_kwargs``, e.g. ``enable_thinking``). ``tools`` and tool turns
        go to the template, or into the messages where it does not render them
        (serving/tool_prompt.py)."""
        if not messages:
            raise InvalidRequest("messages must not be empty", param="messages")
        for i, m in enumerate(messages):
            parts = m.get("content")
            if isinstance(parts, list) and any(
                isinstance(p, Mapping) and p.get("type") == "image_url" for p in parts
            ):  # chat_prompt decodes them; elsewhere the template would drop them silently
                raise InvalidRequest(
                    "image_url parts are taken by /v1/chat/completions only",
                    param=f"messages.{i}.content",
                )
        template_kwargs = dict(template_kwargs or {})
        reserved = sorted(set(template_kwargs) & _RESERVED_TEMPLATE_ARGS)
        if reserved:
            raise InvalidRequest(
                f"chat_template_kwargs may not set {reserved}: the server sets them",
                param="chat_template_kwargs",
            )
        if tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
            messages, tools = conversation_for_template(
                messages, tools, self._template_tool_support(), self.config.tool_call_parser
            )
        if tools:
            template_kwargs["tools"] = list(tools)
        try:
            ids = self.engine.tokenizer.apply_chat_template(
                list(messages),
                add_generation_prompt=add_generation_prompt,
                tokenize=tokenize,
                chat_template=self.config.chat_template,
                **template_kwargs,
            )
        except Exception as e:  # template errors are the caller's input problem
            raise InvalidRequest(
                f"messages: cannot apply the chat template: {e}", param="messages"
            ) from e
        if not tokenize:
            return ids
        if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    async def chat_prompt(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> Any:
        """The engine prompt of a conversation: its token ids (``render_chat``), or with
        image parts the rendered text and the decoded images (engine/images.py), decoded off
        the event loop; InvalidRequest (400) for an image that is malformed, truncated, too
        large, 0 x 0 or of another format, before anything reaches the engine."""
        fetch = None
        if self.config.allowed_media_domains:
            fetch = functools.partial(
                fetch_image_bytes,
                allowed_domains=self.config.allowed_media_domains,
                timeout=self.config.media_fetch_timeout,
                max_bytes=MAX_IMAGE_BYTES,
            )
        try:
            template_messages, images = await asyncio.to_thread(chat_images, messages, fetch)
        except ValueError as e:
            raise InvalidRequest(str(e), param="messages") from None
        if not images:
            return self.render_chat(messages, template_kwargs=template_kwargs, tools=tools)
        text = self.render_chat(
            template_messages, template_kwargs=template_kwargs, tools=tools, tokenize=False
        )
        return {"prompt": text, "add_special_tokens": False, "multi_modal_data": {"image": images}}

    def _template_tool_support(self) -> TemplateToolSupport:
        if self._tool_support is None:
            tokenizer, template = self.engine.tokenizer, self.config.chat_template

            def render(messages: list, **kwargs: Any) -> str:
                return tokenizer.apply_chat_template(
                    messages, tokenize=False, chat_template=template, **kwargs
                )

            self._tool_support = TemplateToolSupport.probe(render)
        return self._tool_support

    async def open(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        *,
        output_kind: RequestOutputKind = RequestOutputKind.DELTA,
        lora_name: str | None = None,
    ) -> RequestHandle:
        """Admits one request to the engine (with the LoRA adapter `lora_name`, if given);
        its handle yields outputs of `output_kind` (DELTA to stream, FINAL_ONLY for one
        complete output). Raises InvalidRequest (the engine's ValueError: a bad prompt or
        params, a request id in use), Overloaded (queue full), Unavailable (loading,
        draining, asleep or engine dead)."""
        self.check_ready()
        limit = self.config.max_queue_len
        if limit is not None and self.num_queued >= limit:
            self.metrics.count_rejected("queue_full")
            raise Overloaded(
                f"too many requests waiting ({self.num_queued} >= --max-queue-len {limit}); "
                "retry later"
            )
        engine = self.engine
        assert engine is not None  # check_ready passed: the engine is attached
        arrival = time.monotonic()
        self._admitting += 1
        try:
            # the engine tokenizes and validates off the loop; a cancel meanwhile queues nothing
            stream = await engine.add_request(
                request_id, prompt, params, output_kind=output_kind, lora_name=lora_name
            )
        except EngineDeadError as e:
            self.mark_failed(e)
            raise Unavailable(f"server not ready: the engine failed ({e!r})") from e
        except EngineAsleepError as e:
            raise Unavailable(f"server not ready: {e}") from e
        except ValueError as e:
            raise InvalidRequest(str(e), param=field_of(str(e))) from e
        finally:
            self._admitting -= 1
        handle = RequestHandle(self, request_id, stream, arrival, output_kind)
        self._in_flight.add(handle)
        self._changed()
        return handle

    async def abort(self, request_id: str) -> None:
        """Asks the engine to end the request (it does so on its own thread); the request's
        stream then ends with finish_reason "abort"."""
        if self.engine is not None:
            await self.engine.abort(request_id)

    async def _abort_quietly(self, request_id: str) -> None:
        try:
            await self.abort(request_id)
        except Exception:  # a failed abort must not hide the request's own outcome
            log.exception("abort of %s failed", request_id)

    # ---- shutdown -------------------------------------------------------------------------------
    async def drain(self, timeout: float) -> int:
        """Stops admitting, waits up to `timeout` s for in-flight requests, then aborts the rest
        (their streams end with finish_reason "abort" once the engine has processed the
        aborts). Returns how many were aborted."""
        if self.phase in (Phase.SERVING, Phase.LOADING):
            self._set_phase(Phase.DRAINING)
        n = self.num_in_flight
        if n:
            log.info("draining %d in-flight request(s), up to %.1f s", n, timeout)
        idle = asyncio.ensure_future(self._idle.wait())
        force = asyncio.ensure_future(self._force.wait())
        await asyncio.wait({idle, force}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        idle.cancel()
        force.cancel()
        if not self._in_flight:
            return 0
        left = [h.request_id for h in self._in_flight]
        why = "forced" if self._force.is_set() else "shutdown timeout"
        log.warning("%s: aborting %d request(s)", why, len(left))
        for rid in left:
            await self.abort(rid)
        try:  # give the streams a moment to deliver their "abort" endings
            await asyncio.wait_for(self._idle.wait(), 5.0)
        except asyncio.TimeoutError:
            log.warning("%d request(s) still open after abort", self.num_in_flight)
        return len(left)

    def force_drain(self) -> None:
        """Ends a drain's wait now (a second SIGTERM/SIGINT): the rest is aborted."""
        self._force.set()

    def stopped(self) -> None:
        self._set_phase(Phase.STOPPED)
