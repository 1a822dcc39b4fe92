"""Python clients of the gRPC service: `GenerationClient` (blocking) and
`AsyncGenerationClient` (asyncio). Both stream deltas::

    with GenerationClient("127.0.0.1:50051") as client:
        for chunk in client.stream("Hello", max_tokens=32, temperature=0):
            print(chunk.text, end="", flush=True)

Leaving a stream early (break, exception, garbage collection) cancels the call, which aborts
the request on the server and frees its KV blocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

import grpc

from jaxpaged.serving import generation_pb2 as pb
from jaxpaged.serving import generation_pb2_grpc as pb_grpc

__all__ = [
    "AsyncGenerationClient",
    "Chunk",
    "Completion",
    "GenerationClient",
    "Sample",
    "build_request",
]

_SAMPLING_FIELDS = {f.name for f in pb.SamplingParams.DESCRIPTOR.fields}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Chunk:
    """What one sample gained in one stream message."""

    request_id: str
    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[tuple[int, float, dict[int, float]], ...]  # (token id, logprob, top)
    finish_reason: str | None
    stop_reason: str | None
    usage: Mapping[str, int] | None = None  # on the request's last chunk


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sample:
    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    stop_reason: str | None
    logprobs: tuple[tuple[int, float, dict[int, float]], ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Completion:
    """A whole generation (all n samples)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    samples: tuple[Sample, ...]
    usage: Mapping[str, int]
    timings: Mapping[str, float]

    @property
    def text(self) -> str:
        return self.samples[0].text


def build_request(
    prompt: str | Sequence[int] | None = None,
    *,
    messages: Sequence[Mapping[str, str]] | None = None,
    request_id: str = "",
    stream: bool = True,
    **sampling: Any,
) -> pb.GenerateRequest:
    """A GenerateRequest from a text prompt, token ids or chat messages plus SamplingParams
    fields as keywords (e.g. max_tokens=32, temperature=0, stop=["\\n"])."""
    unknown = set(sampling) - _SAMPLING_FIELDS
    if unknown:
        raise ValueError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt or messages")
    params = pb.SamplingParams(**{k: v for k, v in sampling.items() if v is not None})
    req = pb.GenerateRequest(request_id=request_id, sampling_params=params, stream=stream)
    if messages is not None:
        req.chat.messages.extend(
            pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages
        )
    elif isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(int(t) for t in prompt)
    return req


def _logprobs(d: pb.CompletionDelta) -> tuple[tuple[int, float, dict[int, float]], ...]:
    return tuple(
        (lp.token_id, lp.logprob, {t.token_id: t.logprob for t in lp.top}) for lp in d.logprobs
    )


def _usage(msg: pb.GenerateResponse) -> dict[str, int]:
    u = msg.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "cached_prompt_tokens": u.cached_prompt_tokens,
    }


def _chunks(msg: pb.GenerateResponse) -> list[Chunk]:
    usage = _usage(msg) if msg.finished else None
    out = [
        Chunk(
            request_id=msg.request_id,
            index=d.index,
            text=d.text,
            token_ids=tuple(d.token_ids),
            logprobs=_logprobs(d),
            finish_reason=d.finish_reason or None,
            stop_reason=d.stop_reason or None,
            usage=usage if i == len(msg.outputs) - 1 else None,
        )
        for i, d in enumerate(msg.outputs)
    ]
    if usage is not None and not out:  # a final message with nothing new
        out.append(
            Chunk(request_id=msg.request_id, index=0, text="", token_ids=(), logprobs=(),
                  finish_reason=None, stop_reason=None, usage=usage)
        )  # fmt: skip
    return out


class _Accumulator:
    """Builds a Completion from the messages of one call."""

    def __init__(self) -> None:
        self.samples: dict[int, dict[str, Any]] = {}
        self.prompt_ids: tuple[int, ...] = ()
        self.last: pb.GenerateResponse | None = None

    def add(self, msg: pb.GenerateResponse) -> None:
        if msg.prompt_token_ids:
            self.prompt_ids = tuple(msg.prompt_token_ids)
        for d in msg.outputs:
            s = self.samples.setdefault(
                d.index, {"text": "", "ids": [], "lps": [], "finish": None, "stop": None}
            )
            s["text"] += d.text
            s["ids"].extend(d.token_ids)
            s["lps"].extend(_logprobs(d))
            s["finish"] = d.finish_reason or s["finish"]
            s["stop"] = d.stop_reason or s["stop"]
        self.last = msg

    def result(self) -> Completion:
        if self.last is None or not self.last.finished:
            raise RuntimeError("the stream ended without a final message")
        t = self.last.timings
        return Completion(
            request_id=self.last.request_id,
            prompt_token_ids=self.prompt_ids,
            samples=tuple(
                Sample(
                    index=i,
                    text=s["text"],
                    token_ids=tuple(s["ids"]),
                    finish_reason=s["finish"],
                    stop_reason=s["stop"],
                    logprobs=tuple(s["lps"]),
                )
                for i, s in sorted(self.samples.items())
            ),  # fmt: skip
            usage=_usage(self.last),
            timings={
                "arrival_time": t.arrival_time,
                "queue_time_s": t.queue_time_s,
                "time_to_first_token_s": t.time_to_first_token_s,
                "e2e_latency_s": t.e2e_latency_s,
            },
        )


def _metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


class GenerationClient:
    """Blocking client. `target` is "host:port"; `api_key` is sent as a Bearer token."""

    def __init__(self, target: str = "127.0.0.1:50051", *, api_key: str | None = None) -> None:
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self._md = _metadata(api_key)

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def stream(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: Sequence[Mapping[str, str]] | None = None,
        request_id: str = "",
        timeout: float | None = None,
        **sampling: Any,
    ) -> Iterator[Chunk]:
        """Deltas as they are generated; closing the iterator early cancels the request."""
        req = build_request(
            prompt, messages=messages, request_id=request_id, stream=True, **sampling
        )
        call = self.stub.Generate(req, timeout=timeout, metadata=self._md)
        try:
            for msg in call:
                yield from _chunks(msg)
        finally:
            call.cancel()  # no-op once finished

    def generate(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: Sequence[Mapping[str, str]] | None = None,
        request_id: str = "",
        timeout: float | None = None,
        **sampling: Any,
    ) -> Completion:
        """The whole generation in one message."""
        req = build_request(
            prompt, messages=messages, request_id=request_id, stream=False, **sampling
        )
        acc = _Accumulator()
        for msg in self.stub.Generate(req, timeout=timeout, metadata=self._md):
            acc.add(msg)
        return acc.result()

    def abort(self, request_id: str) -> None:
        self.stub.Abort(pb.AbortRequest(request_id=request_id), metadata=self._md)

    def model_info(self) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self._md)

    def server_info(self) -> pb.ServerInfo:
        return self.stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=self._md)


class AsyncGenerationClient:
    """asyncio client (grpc.aio); create it inside the running loop."""

    def __init__(self, target: str = "127.0.0.1:50051", *, api_key: str | None = None) -> None:
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self._md = _metadata(api_key)

    async def __aenter__(self) -> AsyncGenerationClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def stream(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: Sequence[Mapping[str, str]] | None = None,
        request_id: str = "",
        timeout: float | None = None,
        **sampling: Any,
    ) -> AsyncIterator[Chunk]:
        req = build_request(
            prompt, messages=messages, request_id=request_id, stream=True, **sampling
        )
        call = self.stub.Generate(req, timeout=timeout, metadata=self._md)
        try:
            async for msg in call:
                for chunk in _chunks(msg):
                    yield chunk
        finally:
            call.cancel()

    async def generate(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: Sequence[Mapping[str, str]] | None = None,
        request_id: str = "",
        timeout: float | None = None,
        **sampling: Any,
    ) -> Completion:
        req = build_request(
            prompt, messages=messages, request_id=request_id, stream=False, **sampling
        )
        acc = _Accumulator()
        async for msg in self.stub.Generate(req, timeout=timeout, metadata=self._md):
            acc.add(msg)
        return acc.result()

    async def abort(self, request_id: str) -> None:
        await self.stub.Abort(pb.AbortRequest(request_id=request_id), metadata=self._md)

    async def model_info(self) -> pb.ModelInfo:
        return await self.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self._md)

    async def server_info(self) -> pb.ServerInfo:
        return await self.stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=self._md)
