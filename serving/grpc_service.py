"""The gRPC service `jaxpaged.v1.Generation` (grpc.aio), with the standard health service and
server reflection on the same server.

Status codes: INVALID_ARGUMENT (bad input, message naming the field; also a field this
server does not know, e.g. from a client built on a newer .proto), UNAUTHENTICATED (API
key missing or wrong in the `authorization: Bearer <key>` metadata), RESOURCE_EXHAUSTED
(queue full), UNAVAILABLE (loading, draining, engine dead), INTERNAL (the engine failed
while serving the call). A cancelled call or an expired deadline aborts the request.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf import unknown_fields
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

import jaxpaged
from jaxpaged.outputs import CompletionOutput, Logprob, RequestOutput
from jaxpaged.sampling_params import SamplingParams, StructuredOutput
from jaxpaged.serving import generation_pb2 as pb
from jaxpaged.serving import generation_pb2_grpc as pb_grpc
from jaxpaged.serving.errors import InvalidRequest, ServingError, field_of
from jaxpaged.serving.frontend import Frontend, Phase, output_kind_for
from jaxpaged.serving.grpc_chat import ChatTools, chat_prompt
from jaxpaged.serving.grpc_embed import embed
from jaxpaged.serving.metrics import RequestTotals

__all__ = ["SERVICE_NAME", "GenerationServicer", "build_grpc_server", "sampling_params_from_proto"]

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "jaxpaged.v1.Generation"

_SCALAR_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "n",
    "logprobs",
    "max_tokens",
    "min_tokens",
    "skip_special_tokens",
    "prompt_logprobs",
    "priority",
)


def check_known_fields(msg: Message, where: str = "") -> None:
    """Refuses a message (or any message inside it) that carries fields this server's .proto
    does not define: protobuf keeps them as unknown fields, and ignoring them would answer a
    request other than the one sent."""
    name = where or msg.DESCRIPTOR.name
    unknown = unknown_fields.UnknownFieldSet(msg)
    if len(unknown):
        numbers = sorted({f.field_number for f in unknown})
        raise InvalidRequest(
            f"{name}: field number(s) {numbers} are unknown to this server (a client built "
            "from a newer .proto?); jaxpaged refuses fields it would not honour",
            param=name,
        )
    for field, value in msg.ListFields():
        if field.message_type is None or field.message_type.GetOptions().map_entry:
            continue
        items = value if field.is_repeated else [value]
        for i, item in enumerate(items):
            suffix = f"[{i}]" if field.is_repeated else ""
            check_known_fields(item, f"{name}.{field.name}{suffix}")


def _structured_output(msg: pb.StructuredOutput) -> StructuredOutput:
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise InvalidRequest(
            "structured_output: set one of json, json_object, regex, choice or grammar",
            param="structured_output",
        )
    value = list(msg.choice.choices) if kind == "choice" else getattr(msg, kind)
    try:
        return StructuredOutput(**{kind: value})
    except ValueError as e:
        raise InvalidRequest(str(e), param="structured_output") from None


def sampling_params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """SamplingParams from the proto; unset optional fields keep SamplingParams' defaults."""
    kwargs: dict[str, Any] = {
        name: getattr(msg, name) for name in _SCALAR_FIELDS if msg.HasField(name)
    }
    kwargs["logit_bias"] = dict(msg.logit_bias)
    if msg.HasField("structured_output"):
        kwargs["structured_output"] = _structured_output(msg.structured_output)
    kwargs["ignore_eos"] = msg.ignore_eos
    kwargs["include_stop_str_in_output"] = msg.include_stop_str_in_output
    kwargs["stop"] = list(msg.stop)
    kwargs["stop_token_ids"] = list(msg.stop_token_ids)
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise InvalidRequest(str(e), param=field_of(str(e))) from e


def _logprobs_pb(logprobs: tuple[Logprob, ...] | None) -> list[pb.TokenLogprob]:
    if not logprobs:
        return []
    return [
        pb.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top.items()],
        )
        for lp in logprobs
    ]


def _completion_pb(c: CompletionOutput) -> pb.CompletionDelta:
    """One sample's news (DELTA) or the whole sample (FINAL_ONLY): the message is the same."""
    return pb.CompletionDelta(
        index=c.index,
        token_ids=c.token_ids,
        text=c.text,
        logprobs=_logprobs_pb(c.logprobs),
        finish_reason=c.finish_reason or "",
        stop_reason="" if c.stop_reason is None else str(c.stop_reason),
    )


def _final_fields(out: RequestOutput, totals: RequestTotals) -> dict[str, Any]:
    """Usage (counted over the whole stream) and timings, for the request's last message."""
    m = out.metrics

    def since_arrival(t: float | None) -> float:
        return 0.0 if t is None else max(0.0, t - m.arrival_time)

    return {
        "usage": pb.Usage(
            prompt_tokens=totals.num_prompt_tokens,
            completion_tokens=totals.num_completion_tokens,
            cached_prompt_tokens=totals.num_cached_tokens,
        ),
        "timings": pb.Timings(
            arrival_time=m.arrival_time,
            queue_time_s=since_arrival(m.first_scheduled_time),
            time_to_first_token_s=since_arrival(m.first_token_time),
            e2e_latency_s=since_arrival(m.finished_time),
        ),
    }


def _response_pb(
    request_id: str,
    out: RequestOutput,
    totals: RequestTotals,
    *,
    first: bool,
    with_prompt_logprobs: bool,
) -> pb.GenerateResponse:
    """One message per engine output; the prompt's ids ride on the first only, its logprobs
    on the one ``with_prompt_logprobs`` says."""
    return pb.GenerateResponse(
        request_id=request_id,
        outputs=[_completion_pb(c) for c in out.outputs],
        finished=out.finished,
        prompt_token_ids=out.prompt_token_ids if first else (),
        prompt_logprobs=_logprobs_pb(out.prompt_logprobs[1:]) if with_prompt_logprobs else (),
        **(_final_fields(out, totals) if out.finished else {}),
    )


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, frontend: Frontend) -> None:
        self._frontend = frontend

    async def _fail(self, context: grpc.aio.ServicerContext, err: ServingError) -> None:
        await context.abort(getattr(grpc.StatusCode, err.grpc_code), err.message)

    def _check_auth(self, context: grpc.aio.ServicerContext) -> None:
        md = {k.lower(): v for k, v in (context.invocation_metadata() or ())}
        self._frontend.check_api_key(md.get("authorization"))

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        frontend = self._frontend
        try:
            self._check_auth(context)
            check_known_fields(request)
            params = sampling_params_from_proto(request.sampling_params)
            frontend.check_ready()
            tools = None
            kind = request.WhichOneof("input")
            if kind is None:
                raise InvalidRequest(
                    "input: one of text, token_ids or chat is required", param="input"
                )
            if kind == "text":
                prompt: Any = request.text
            elif kind == "token_ids":
                prompt = list(request.token_ids.ids)
            else:
                prompt, params, plan = await chat_prompt(frontend, request.chat, params)
                tools = ChatTools(plan)
            rid = request.request_id or f"grpc-{uuid.uuid4().hex}"
            handle = await frontend.open(
                rid,
                prompt,
                params,
                output_kind=output_kind_for(stream=request.stream),
                lora_name=request.lora_name or None,
            )
        except ServingError as e:
            await self._fail(context, e)
            return
        async with handle:
            first, prompt_sent = True, False
            try:
                async for out in handle:
                    send_prompt = not prompt_sent and out.prompt_logprobs is not None
                    response = _response_pb(
                        rid, out, handle.totals, first=first, with_prompt_logprobs=send_prompt
                    )
                    if tools is not None:
                        tools.add_calls(response)
                    yield response
                    first, prompt_sent = False, prompt_sent or send_prompt
            except ServingError as e:
                await self._fail(context, e)

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        try:
            self._check_auth(context)
        except ServingError as e:
            await self._fail(context, e)
        await self._frontend.abort(request.request_id)
        return pb.AbortResponse()

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        frontend = self._frontend
        try:
            self._check_auth(context)
            if frontend.engine is None:
                frontend.check_ready()
        except ServingError as e:
            await self._fail(context, e)
        engine = frontend.engine
        mc = engine.model_config
        return pb.ModelInfo(
            served_model_name=frontend.config.served_model_name,
            model_path=frontend.config.model_path,
            model_type=mc.model_type,
            vocab_size=mc.vocab_size,
            max_model_len=engine.max_model_len,
            num_layers=mc.num_layers,
            hidden_size=mc.hidden_size,
            num_heads=mc.num_heads,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            eos_token_ids=list(mc.eos_token_ids),
        )

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerInfo:
        frontend = self._frontend
        try:
            self._check_auth(context)
        except ServingError as e:
            await self._fail(context, e)
        frontend.check_engine()
        info = pb.ServerInfo(
            version=jaxpaged.__version__,
            state=frontend.phase.value,
            in_flight_requests=frontend.num_in_flight,
            max_queue_len=frontend.config.max_queue_len or 0,
        )
        engine = frontend.engine
        if engine is None:
            return info
        for k, v in dict(engine.engine_config).items():
            info.engine_config[str(k)] = str(v)
        stats = engine.get_stats()  # the latest per-step snapshot (a dead engine's last one)
        info.num_running = stats.num_running
        info.num_waiting = stats.num_waiting
        info.num_swapped = stats.num_swapped
        info.kv_cache_usage = stats.kv_cache_usage
        info.num_kv_blocks = stats.num_kv_blocks
        info.num_free_blocks = stats.num_free_blocks
        info.num_preemptions = stats.num_preemptions
        return info

    async def Embed(
        self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> pb.EmbedResponse:
        try:
            self._check_auth(context)
            check_known_fields(request)
            return await embed(self._frontend, request)
        except ServingError as e:
            await self._fail(context, e)


_HEALTH = {
    Phase.SERVING: health_pb2.HealthCheckResponse.SERVING,
}


def build_grpc_server(frontend: Frontend, address: str) -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server with Generation, health (NOT_SERVING unless the frontend is SERVING)
    and reflection; returns (server, bound port). Call from within the running loop, then
    `await server.start()`."""
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", 64 << 20), ("grpc.so_reuseport", 0)]
    )
    pb_grpc.add_GenerationServicer_to_server(GenerationServicer(frontend), server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    admin = ()
    if frontend.config.enable_weight_updates:
        from jaxpaged.serving.admin_service import add_admin_service

        admin = (add_admin_service(frontend, server),)
    reflection.enable_server_reflection(
        (
            SERVICE_NAME,
            *admin,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    pending: set[asyncio.Task] = set()

    def on_phase(phase: Phase) -> None:
        # Health of the whole server ("") and of the service follow the frontend's phase.
        status = _HEALTH.get(phase, health_pb2.HealthCheckResponse.NOT_SERVING)
        for service in ("", SERVICE_NAME):
            task = asyncio.get_running_loop().create_task(health.set(service, status))
            pending.add(task)
            task.add_done_callback(pending.discard)

    frontend.add_listener(on_phase)
    on_phase(frontend.phase)
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind the gRPC server to {address}")
    return server, port
