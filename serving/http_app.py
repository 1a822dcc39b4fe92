"""OpenAI-compatible HTTP API (FastAPI): /v1/completions, /v1/chat/completions (both with
server-sent-event streaming), /v1/models, /health and /metrics, and vLLM's /tokenize,
/detokenize and /version; the Responses API (serving/responses.py) and Anthropic's Messages
API (serving/anthropic.py) join it, built on the same chat path (serving/chat_run.py).

Errors come back in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``,
with 400 (bad input), 401 (API key), 429 (queue full), 500 (engine failure) or 503 (not
ready). A client that disconnects aborts its requests, which frees their KV blocks.
"""

from __future__ import annotations

import importlib.metadata
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jaxpaged.engine.protocol import Tokenizer
from jaxpaged.outputs import CompletionOutput, Logprob, RequestOutput, RequestOutputKind
from jaxpaged.serving.anthropic import add_anthropic_routes
from jaxpaged.serving.chat_reply import ReplyBuilder
from jaxpaged.serving.chat_run import check_model, until_disconnect
from jaxpaged.serving.deltas import merge_handles
from jaxpaged.serving.dev_routes import add_dev_routes
from jaxpaged.serving.errors import InvalidRequest, ServingError
from jaxpaged.serving.frontend import Frontend, RequestHandle, close_all, output_kind_for
from jaxpaged.serving.lora_routes import add_lora_routes, lora_model_cards, lora_of
from jaxpaged.serving.metrics import CONTENT_TYPE, RequestTotals
from jaxpaged.serving.pooling_routes import add_pooling_routes
from jaxpaged.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse_body,
)
from jaxpaged.serving.responses import add_responses_routes
from jaxpaged.serving.tools import plan_tools

__all__ = ["create_app"]


def _error_response(err: ServingError) -> JSONResponse:
    body = {
        "error": {
            "message": err.message,
            "type": err.error_type,
            "param": err.param,
            "code": err.http_status,
        }
    }
    return JSONResponse(body, status_code=err.http_status)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class _Formatter:
    """Token strings and logprob blocks in OpenAI's two formats."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer

    def token(self, token_id: int) -> str:
        return self._tok.decode([token_id])

    def text(self, token_ids: Sequence[int]) -> str:
        return self._tok.decode(list(token_ids))

    def completion_logprobs(self, logprobs: tuple[Logprob, ...], offset: int) -> dict:
        tokens, lps, tops, offsets = [], [], [], []
        pos = offset
        for lp in logprobs:
            s = self.token(lp.token_id)
            tokens.append(s)
            lps.append(lp.logprob)
            tops.append({self.token(t): v for t, v in lp.top.items()})
            offsets.append(pos)
            pos += len(s)
        return {
            "tokens": tokens,
            "token_logprobs": lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def echo_logprobs(self, out: RequestOutput, k: int, generated: dict) -> dict:
        """OpenAI's completion logprobs of an echoed prompt (the first token has none)
        followed by those of the generated tokens (``generated``, offsets already past the
        prompt's text)."""
        tokens = [self.token(t) for t in out.prompt_token_ids]
        lps = out.prompt_logprobs or (None,) * len(tokens)
        offsets, pos = [], 0
        for s in tokens:
            offsets.append(pos)
            pos += len(s)
        return {
            "tokens": tokens + generated["tokens"],
            "token_logprobs": [None if lp is None else lp.logprob for lp in lps]
            + generated["token_logprobs"],
            "top_logprobs": [
                None if lp is None else {self.token(t): v for t, v in list(lp.top.items())[:k]}
                for lp in lps
            ]
            + generated["top_logprobs"],
            "text_offset": offsets + generated["text_offset"],
        }

    def prompt_logprobs(self, lps: tuple[Logprob | None, ...] | None) -> list | None:
        """vLLM's prompt_logprobs: per prompt token None (the first) or token id -> its
        logprob and text, for the token itself and the top k."""
        if lps is None:
            return None
        return [
            None
            if lp is None
            else {
                str(t): {"logprob": v, "decoded_token": self.token(t)}
                for t, v in {lp.token_id: lp.logprob, **lp.top}.items()
            }
            for lp in lps
        ]

    def chat_logprobs(self, logprobs: tuple[Logprob, ...]) -> dict:
        content = []
        for lp in logprobs:
            s = self.token(lp.token_id)
            content.append(
                {
                    "token": s,
                    "logprob": lp.logprob,
                    "bytes": list(s.encode()),
                    "top_logprobs": [
                        {"token": (t := self.token(k)), "logprob": v, "bytes": list(t.encode())}
                        for k, v in lp.top.items()
                    ],
                }
            )
        return {"content": content}


def _usage(totals: Sequence[RequestTotals]) -> dict:
    """OpenAI usage over several requests (a completion with a list of prompts)."""
    prompt = sum(t.num_prompt_tokens for t in totals)
    completion = sum(t.num_completion_tokens for t in totals)
    cached = sum(t.num_cached_tokens for t in totals)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _chat_chunks(
    head: Callable[[list[dict]], dict],
    builder: Callable[[], ReplyBuilder],
    fmt: _Formatter,
) -> Callable[[int, RequestOutput, CompletionOutput], list[dict]]:
    """The stream chunks of a chat's sample deltas: a role chunk before a sample's first
    content, its content / reasoning / tool-call deltas (the delta's logprobs on the first),
    and a finish chunk on its last delta."""
    replies: dict[int, ReplyBuilder] = {}

    def choice(index: int, delta: dict, logprobs: Any = None, finish: str | None = None) -> dict:
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def chunks(_: int, __: RequestOutput, d: CompletionOutput) -> list[dict]:
        out = []
        reply = replies.get(d.index)
        if reply is None:
            reply = replies[d.index] = builder()
            out.append(head([choice(d.index, {"role": "assistant", "content": ""})]))
        deltas = reply.delta(d.text, finished=d.finish_reason is not None)
        deltas = [x for x in deltas if x != {"content": ""}]
        if not deltas and d.token_ids:  # held back: the tokens' logprobs still go out
            deltas = [{"content": ""} if reply.plain else {}]
        logprobs = None if d.logprobs is None else fmt.chat_logprobs(d.logprobs)
        for i, delta in enumerate(deltas):
            out.append(head([choice(d.index, delta, logprobs if i == 0 else None)]))
        if d.finish_reason is not None:
            last = choice(d.index, {}, finish=reply.finish_reason(d.finish_reason))
            out.append(head([{**last, "stop_reason": d.stop_reason}]))
        return out

    return chunks


def create_app(frontend: Frontend) -> FastAPI:
    """The HTTP app of one server; all state lives in `frontend`."""
    app = FastAPI(title="jaxpaged", docs_url=None, redoc_url=None, openapi_url=None)
    cfg = frontend.config

    @app.exception_handler(ServingError)
    async def _on_serving_error(request: Request, exc: ServingError) -> JSONResponse:
        return _error_response(exc)

    async def admit(request: Request, model: type) -> Any:
        frontend.check_api_key(request.headers.get("authorization"))
        body = parse_body(model, await request.body())
        check_model(frontend, body.model)
        return body

    async def open_all(
        prompts: list[Any],
        params: Any,
        prefix: str,
        output_kind: RequestOutputKind,
        model: str | None = None,
    ) -> list[RequestHandle]:
        handles: list[RequestHandle] = []
        lora = lora_of(frontend, model)  # a LoRA adapter's name, or None: the base model
        try:
            for i, prompt in enumerate(prompts):
                rid = prefix if len(prompts) == 1 else f"{prefix}-{i}"
                handles.append(
                    await frontend.open(
                        rid, prompt, params, output_kind=output_kind, lora_name=lora
                    )
                )
        except BaseException:
            await close_all(handles)
            raise
        return handles

    async def collect(handles: list[RequestHandle]) -> list[RequestOutput]:
        """The last output of each request (with FINAL_ONLY, its one complete output)."""
        try:
            last: list[RequestOutput | None] = [None] * len(handles)
            async for i, out in merge_handles(handles):
                last[i] = out
            return [o for o in last if o is not None]
        finally:
            await close_all(handles)

    async def sse(
        handles: list[RequestHandle],
        chunks: Callable[[int, RequestOutput, CompletionOutput], list[dict]],
        tail: list[Callable[[], dict]],
    ) -> AsyncIterator[str]:
        """Server-sent events: chunks(position of the request, its output, one sample's delta)
        for each
        sample of each output as it arrives, then the tail's objects, then [DONE]."""
        try:
            async for i, out in merge_handles(handles):
                for delta in out.outputs:
                    for chunk in chunks(i, out, delta):
                        yield _sse(chunk)
            for make in tail:
                yield _sse(make())
        except ServingError as e:
            yield _sse(
                {
                    "error": {
                        "message": e.message,
                        "type": e.error_type,
                        "param": e.param,
                        "code": e.http_status,
                    }
                }
            )
        finally:
            await close_all(handles)
        yield "data: [DONE]\n\n"

    # ---- endpoints ---------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if not frontend.ready:
            return JSONResponse({"status": frontend.phase.value}, status_code=503)
        # data-parallel replicas down (restarting, or given up) while others serve
        replicas = frontend.engine.get_stats().replicas
        down = [rank for rank, r in enumerate(replicas) if not r.alive]
        if not down:
            return Response(status_code=200)
        given_up = [rank for rank, r in enumerate(replicas) if r.given_up]
        return JSONResponse({"status": "degraded", "replicas_down": down,
                             "replicas_given_up": given_up})  # fmt: skip

    @app.get("/metrics")
    async def metrics() -> Response:
        body = frontend.metrics.render()  # reads the engine's per-step stats snapshot
        return Response(body, media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        frontend.check_api_key(request.headers.get("authorization"))
        max_len = frontend.engine.max_model_len if frontend.engine is not None else None
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "jaxpaged",
                    "root": cfg.model_path or cfg.served_model_name,
                    "max_model_len": max_len,
                }
                for name in (cfg.served_model_name, *cfg.served_model_aliases)
            ]
            + lora_model_cards(frontend),
        }

    add_lora_routes(app, frontend)
    add_responses_routes(app, frontend)
    add_anthropic_routes(app, frontend)
    add_dev_routes(app, frontend)
    add_pooling_routes(app, frontend)

    @app.get("/version")
    async def version() -> dict:
        return {"version": importlib.metadata.version("jaxpaged")}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        body: TokenizeRequest = await admit(request, TokenizeRequest)
        body.check()
        frontend.check_ready()
        tok = frontend.engine.tokenizer
        if body.messages is not None:
            ids = frontend.render_chat(
                body.template_messages(),
                add_generation_prompt=body.add_generation_prompt,
                template_kwargs=body.chat_template_kwargs,
                tools=body.template_tools(),
            )
        else:
            try:
                ids = [
                    int(t)
                    for t in tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
                ]
            except Exception as e:  # the tokenizer refuses the caller's text
                raise InvalidRequest(f"prompt: cannot tokenize: {e}", param="prompt") from e
        return {
            "count": len(ids),
            "max_model_len": frontend.engine.max_model_len,
            "tokens": ids,
            "token_strs": tok.convert_ids_to_tokens(ids) if body.return_token_strs else None,
        }

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        body: DetokenizeRequest = await admit(request, DetokenizeRequest)
        frontend.check_ready()
        vocab = frontend.engine.model_config.vocab_size
        for i, t in enumerate(body.tokens):
            if not 0 <= t < vocab:
                raise InvalidRequest(
                    f"tokens[{i}] is {t}, outside the vocabulary [0, {vocab})", param="tokens"
                )
        return {"prompt": frontend.engine.tokenizer.decode(body.tokens)}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body: CompletionRequest = await admit(request, CompletionRequest)
        params = body.sampling_params()
        prompts = body.prompts()
        frontend.check_ready()
        cid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        fmt = _Formatter(frontend.engine.tokenizer)
        n = params.n
        kind = output_kind_for(stream=body.stream)
        handles = await open_all(prompts, params, cid, kind, body.model)
        text_len: dict[int, int] = {}  # choice index -> length of its text sent so far
        # echo: each choice's text starts with its prompt's
        echoed = [p if isinstance(p, str) else fmt.text(p) for p in prompts] if body.echo else []

        def choice(i: int, out: RequestOutput, d: CompletionOutput) -> dict:
            """The choice of sample d of prompt i; its logprobs' text offsets continue from
            the text this choice has already sent. The choice's first chunk carries the echoed
            prompt (and its logprobs) and the prompt_logprobs asked for."""
            index = i * n + d.index
            first = index not in text_len
            prefix = echoed[i] if echoed and first else ""
            offset = text_len.get(index, 0) + len(prefix)
            text_len[index] = offset + len(d.text)
            logprobs = None
            if d.logprobs is not None:
                logprobs = fmt.completion_logprobs(d.logprobs, offset)
                if prefix:
                    logprobs = fmt.echo_logprobs(out, params.logprobs, logprobs)
            extra = {}
            if body.prompt_logprobs is not None and first:
                extra["prompt_logprobs"] = fmt.prompt_logprobs(out.prompt_logprobs)
            return {
                "index": index,
                "text": prefix + d.text,
                "logprobs": logprobs,
                "finish_reason": d.finish_reason,
                "stop_reason": d.stop_reason,
                **extra,
            }

        def head(choices: list[dict]) -> dict:
            return {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": cfg.served_model_name,
                "choices": choices,
            }

        def usage() -> dict:
            return _usage([h.totals for h in handles])

        if body.stream:
            tail = [lambda: {**head([]), "usage": usage()}] if body.include_usage else []
            return StreamingResponse(
                sse(handles, lambda i, out, d: [head([choice(i, out, d)])], tail),
                media_type="text/event-stream",
            )
        outs = await until_disconnect(request, collect(handles))
        choices = [choice(i, out, c) for i, out in enumerate(outs) for c in out.outputs]
        choices.sort(key=lambda c: c["index"])
        return JSONResponse({**head(choices), "usage": usage()})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body: ChatCompletionRequest = await admit(request, ChatCompletionRequest)
        tools = plan_tools(
            body,
            tool_call_parser=cfg.tool_call_parser,
            auto_enabled=cfg.enable_auto_tool_choice,
        )
        params = body.sampling_params(tool_grammar=tools.grammar)
        frontend.check_ready()
        prompt = await frontend.chat_prompt(
            body.template_messages(),
            template_kwargs=body.chat_template_kwargs,
            tools=body.template_tools(),
        )
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        fmt = _Formatter(frontend.engine.tokenizer)
        kind = output_kind_for(stream=body.stream)
        handles = await open_all([prompt], params, cid, kind, body.model)

        def usage() -> dict:
            return _usage([h.totals for h in handles])

        def head(choices: list[dict]) -> dict:
            return {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": cfg.served_model_name,
                "choices": choices,
            }

        def builder() -> ReplyBuilder:
            return ReplyBuilder(cfg.reasoning_parser, tools)

        if body.stream:
            chunks = _chat_chunks(head, builder, fmt)
            tail = [lambda: {**head([]), "usage": usage()}] if body.include_usage else []
            return StreamingResponse(sse(handles, chunks, tail), media_type="text/event-stream")
        (out,) = await until_disconnect(request, collect(handles))
        choices = []
        for c in sorted(out.outputs, key=lambda c: c.index):
            reply = builder()
            choices.append(
                {
                    "index": c.index,
                    "message": reply.message(c.text),
                    "logprobs": None if c.logprobs is None else fmt.chat_logprobs(c.logprobs),
                    "finish_reason": reply.finish_reason(c.finish_reason),
                    "stop_reason": c.stop_reason,
                }
            )
        extra = {}
        if body.prompt_logprobs is not None:
            extra["prompt_logprobs"] = fmt.prompt_logprobs(out.prompt_logprobs)
        return JSONResponse(
            {**head(choices), "object": "chat.completion", "usage": usage(), **extra}
        )

    return app
