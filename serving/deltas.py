"""Turns the engine's cumulative RequestOutput snapshots into per-sample deltas for streaming,
and merges the streams of several requests (an OpenAI completion with a list of prompts)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence

from jaxpaged.outputs import Logprob, RequestOutput

__all__ = ["Delta", "DeltaTracker", "merge_handles"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Delta:
    """What one sample gained since the last delta of the same sample."""

    index: int
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[Logprob, ...] | None
    finish_reason: str | None  # set once, on the sample's last delta
    stop_reason: int | str | None


class DeltaTracker:
    """Remembers how much of each sample was sent; `update` returns only what is new."""

    def __init__(self) -> None:
        self._tokens: dict[int, int] = {}
        self._chars: dict[int, int] = {}
        self._done: set[int] = set()

    def update(self, out: RequestOutput) -> list[Delta]:
        deltas = []
        for c in out.outputs:
            if c.index in self._done:
                continue
            nt = self._tokens.get(c.index, 0)
            nc = self._chars.get(c.index, 0)
            new_ids = tuple(c.token_ids[nt:])
            new_text = c.text[nc:]
            if not new_ids and not new_text and c.finish_reason is None:
                continue
            logprobs = None if c.logprobs is None else tuple(c.logprobs[nt : len(c.token_ids)])
            self._tokens[c.index] = len(c.token_ids)
            self._chars[c.index] = len(c.text)
            if c.finish_reason is not None:
                self._done.add(c.index)
            deltas.append(
                Delta(
                    index=c.index,
                    token_ids=new_ids,
                    text=new_text,
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
        return deltas


async def merge_handles(handles: Sequence) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yields (position in `handles`, snapshot) from several RequestHandles as they arrive.
    An exception from any stream is re-raised here; the other readers are then cancelled."""
    if len(handles) == 1:
        async for out in handles[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, handle) -> None:
        try:
            async for out in handle:
                await queue.put((i, out))
        except BaseException as e:  # hand every failure to the consumer
            await queue.put((i, e))
            return
        await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
