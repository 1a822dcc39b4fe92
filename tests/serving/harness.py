"""A server on loopback ports (chosen by the OS) running in a background thread with its own
asyncio loop, so that blocking clients (openai, grpc stubs) can talk to it from the test."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from jaxpaged.serving.frontend import ServingConfig
from jaxpaged.serving.server import Server


class ServerThread:
    """A Server on 127.0.0.1 with OS-chosen ports, its loop running in a daemon thread."""

    def __init__(self, engine: Any, **config: Any) -> None:
        self.engine = engine
        self.config = ServingConfig(
            served_model_name=config.pop("served_model_name", "test-model"),
            host="127.0.0.1",
            port=0,
            grpc_port=0,
            **config,
        )
        self.loop = asyncio.new_event_loop()
        self.server: Server | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise TimeoutError("server did not start")
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def main() -> None:
            try:
                self.server = Server(self.config, log_level="warning")
                await self.server.start()
                if self.engine is not None:
                    self.server.attach(self.engine)
            except BaseException as e:
                self._error = e
                self._ready.set()
                return
            self._ready.set()
            await self.server.wait_stopped()

        self.loop.run_until_complete(main())

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.server.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.server.grpc_port}"

    @property
    def frontend(self):
        return self.server.frontend

    def call(self, fn: Callable[[], Any]) -> Any:
        """Runs fn() (or awaits it if it returns a coroutine) on the server's loop."""

        async def run() -> Any:
            out = fn()
            if asyncio.iscoroutine(out):
                out = await out
            return out

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(30)

    def stop(self, timeout: float = 60) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.server.stop)
            self._thread.join(timeout)
        if not self.loop.is_closed() and not self._thread.is_alive():
            self.loop.close()
