"""Merges the output streams of several requests (an OpenAI completion with a list of
prompts) into one, as their outputs arrive. The engine already emits deltas, so nothing here
diffs anything."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from jaxpaged.outputs import RequestOutput
from jaxpaged.serving.frontend import RequestHandle

__all__ = ["merge_handles"]


async def merge_handles(
    handles: Sequence[RequestHandle],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yields (position in `handles`, output) from several RequestHandles as they arrive.
    An exception from any stream is re-raised here; the other readers are then cancelled."""
    if len(handles) == 1:
        async for out in handles[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, handle: RequestHandle) -> None:
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
