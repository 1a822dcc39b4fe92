"""One chat request run for the APIs built on Chat Completions (the Responses API,
Anthropic's Messages API): the same tool plan, sampling parameters, chat template, LoRA
choice and reply parsing as ``/v1/chat/completions``, so that a conversation gets the same
tokens whichever API carries it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import Request

from jaxpaged.outputs import CompletionOutput
from jaxpaged.serving.chat_reply import ReplyBuilder
from jaxpaged.serving.errors import InvalidRequest
from jaxpaged.serving.frontend import Frontend, RequestHandle, output_kind_for
from jaxpaged.serving.lora_routes import lora_of
from jaxpaged.serving.metrics import RequestTotals
from jaxpaged.serving.protocol import ChatCompletionRequest
from jaxpaged.serving.tools import ToolPlan, plan_tools

__all__ = ["ChatRun", "check_model", "render_prompt", "start_chat", "until_disconnect"]

T = TypeVar("T")


def check_model(frontend: Frontend, name: str | None) -> None:
    """InvalidRequest unless ``name`` is None, the served model (or an alias) or an adapter."""
    cfg = frontend.config
    names = (cfg.served_model_name, *cfg.served_model_aliases, cfg.model_path)
    if name is not None and name not in names and lora_of(frontend, name) is None:
        raise InvalidRequest(
            f"model {name!r} does not exist; this server serves {cfg.served_model_name!r}",
            param="model",
        )


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Runs `work`; if the client disconnects first, cancels it (which aborts the requests)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise asyncio.CancelledError("client disconnected")
    return task.result()


def render_prompt(frontend: Frontend, body: ChatCompletionRequest) -> list[int]:
    """The prompt's token ids, exactly as /v1/chat/completions renders ``body``."""
    frontend.check_ready()
    return frontend.render_chat(
        body.template_messages(),
        template_kwargs=body.chat_template_kwargs,
        tools=body.template_tools(),
    )


@dataclasses.dataclass
class ChatRun:
    """An admitted chat request with one sample: its handle, and how its reply is read."""

    handle: RequestHandle
    tools: ToolPlan
    reasoning_parser: str | None
    # known when the server tokenized the prompt; None for a prompt with images, which
    # the engine tokenizes (then the count comes with the outputs)
    prompt_tokens: int | None

    @property
    def num_prompt_tokens(self) -> int:
        if self.prompt_tokens is not None:
            return self.prompt_tokens
        return self.handle.totals.num_prompt_tokens

    def builder(self) -> ReplyBuilder:
        return ReplyBuilder(self.reasoning_parser, self.tools)

    @property
    def totals(self) -> RequestTotals:
        return self.handle.totals

    async def deltas(self) -> AsyncIterator[CompletionOutput]:
        """The sample's outputs as they arrive (one, complete, when not streaming); the
        handle is closed (the request aborted unless finished) when the iteration ends."""
        try:
            async for out in self.handle:
                for sample in out.outputs:  # these APIs ask for one sample (n = 1)
                    yield sample
        finally:
            await self.handle.close()

    async def final(self, request: Request) -> CompletionOutput:
        """The whole sample (not streaming); a client disconnect aborts it."""

        async def collect() -> CompletionOutput:
            last = None
            async for d in self.deltas():
                last = d
            assert last is not None  # the handle raises when no final output came
            return last

        return await until_disconnect(request, collect())


async def start_chat(
    frontend: Frontend, body: ChatCompletionRequest, request_id: str, *, stream: bool
) -> ChatRun:
    """Plans tools, checks the parameters, renders the prompt and admits the request, as
    /v1/chat/completions does (InvalidRequest for anything it would refuse)."""
    cfg = frontend.config
    tools = plan_tools(
        body, tool_call_parser=cfg.tool_call_parser, auto_enabled=cfg.enable_auto_tool_choice
    )
    params = body.sampling_params(tool_grammar=tools.grammar)
    frontend.check_ready()
    prompt = await frontend.chat_prompt(
        body.template_messages(),
        template_kwargs=body.chat_template_kwargs,
        tools=body.template_tools(),
    )
    handle = await frontend.open(
        request_id,
        prompt,
        params,
        output_kind=output_kind_for(stream=stream),
        lora_name=lora_of(frontend, body.model),
    )
    count = len(prompt) if isinstance(prompt, list) else None
    return ChatRun(handle, tools, cfg.reasoning_parser, count)
