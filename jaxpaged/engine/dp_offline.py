"""DataParallelEngine: the data-parallel replicas (:class:`DataParallelClient`) behind the
blocking, step-driven calls that ``LLM`` makes of an LLMEngine (``add_request``, ``step``,
``abort``), for ``LLM(model, data_parallel_size=N)``. The client's event loop runs on a thread
of its own; ``step`` returns the outputs that arrived, waiting for at least one while
requests are open. What needs the weights in this process (``update_weights`` with params,
``wake_up`` with params) is refused by name.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Coroutine
from typing import Any

from jaxpaged.args import EngineArgs
from jaxpaged.engine.data_parallel import DataParallelClient
from jaxpaged.engine.protocol import EngineStats, Prompt
from jaxpaged.lora_request import LoRARequest
from jaxpaged.outputs import RequestOutput, RequestOutputKind
from jaxpaged.sampling_params import SamplingParams

__all__ = ["DataParallelEngine"]


class DataParallelEngine:
    """``data_parallel_size`` replica processes driven like one LLMEngine (module docstring)."""

    def __init__(self, args: EngineArgs) -> None:
        self.client = DataParallelClient(args)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="jaxpaged-dp-offline", daemon=True
        )
        self._thread.start()
        self._outputs: queue.SimpleQueue[RequestOutput | BaseException] = queue.SimpleQueue()
        self._open: set[str] = set()
        self.run_on_loop(self._start())

    async def _start(self) -> None:
        self.client.start()

    def run_on_loop(self, coro: Coroutine[Any, Any, Any]) -> Any:  # noqa: ANN401
        """Runs ``coro`` on the client's event loop and returns its result: whatever talks to
        ``self.client`` asynchronously (a server over the same replicas) runs there."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # ------------------------------------------------------------- what LLM reads
    @property
    def tokenizer(self) -> Any:  # noqa: ANN401
        return self.client.tokenizer

    @property
    def model_config(self) -> Any:  # noqa: ANN401
        return self.client.model_config

    @property
    def max_model_len(self) -> int:
        return self.client.max_model_len

    def get_stats(self) -> EngineStats:
        return self.client.get_stats()

    # -------------------------------------------------------------------- requests
    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        output_kind: RequestOutputKind = RequestOutputKind.DELTA,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validates (in the replica; its ValueError is raised here) and queues one request;
        its outputs come from :meth:`step`. A new LoRA adapter is registered on every
        replica first."""
        self.run_on_loop(
            self._add(request_id, prompt, params or SamplingParams(), output_kind, lora_request)
        )
        self._open.add(request_id)

    async def _add(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        output_kind: RequestOutputKind,
        lora: LoRARequest | None,
    ) -> None:
        if lora is not None and lora.lora_name not in self.client.list_loras():
            await self.client.add_lora(lora)
        stream = await self.client.add_request(
            request_id,
            prompt,
            params,
            output_kind=output_kind,
            lora_name=None if lora is None else lora.lora_name,
        )

        async def pump() -> None:
            try:
                async for out in stream:
                    self._outputs.put(out)
            except BaseException as exc:  # noqa: BLE001 - step() raises it
                self._outputs.put(exc)

        asyncio.get_running_loop().create_task(pump())

    def step(self) -> list[RequestOutput]:
        """The outputs that arrived since the last call (at least one while requests are
        open); a replica's failure is raised (EngineDeadError naming it)."""
        if not self._open:
            return []
        items = [self._outputs.get()]
        while True:
            try:
                items.append(self._outputs.get_nowait())
            except queue.Empty:
                break
        outputs = []
        for item in items:
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                self._open.discard(item.request_id)
            outputs.append(item)
        return outputs

    def abort(self, request_id: str) -> None:
        self._open.discard(request_id)
        self.run_on_loop(self.client.abort(request_id))

    # ----------------------------------------------------------------------- admin
    def sleep(self, level: int = 1) -> int:
        return self.run_on_loop(self.client.sleep(level))

    def wake_up(self, params: Any = None) -> None:  # noqa: ANN401
        if params is not None:
            raise ValueError(
                "wake_up(params): the replicas of data_parallel_size > 1 reload their own "
                "weights; call wake_up() without params"
            )
        self.run_on_loop(self.client.wake_up())

    def update_weights(self, params: Any) -> None:  # noqa: ANN401
        raise ValueError(
            "update_weights(params) is not supported with data_parallel_size > 1 (the weights "
            "live in the replica processes); serve with --enable-weight-updates and update "
            "from a checkpoint path, or use data_parallel_size=1"
        )

    def reset_prefix_cache(self) -> None:
        raise ValueError(
            "reset_prefix_cache() is not supported with data_parallel_size > 1 yet; use "
            "data_parallel_size=1"
        )

    def close(self) -> None:
        """Stops the replicas and the loop thread."""
        if not self._loop.is_running():
            return
        self.run_on_loop(self.client.shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
