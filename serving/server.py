"""One process, one asyncio loop: the gRPC server and the HTTP server (uvicorn) side by side,
both in front of one engine. Owns the life cycle: bind, load the engine (health says
NOT_SERVING meanwhile), serve, watch for engine failure, and on SIGTERM/SIGINT drain
(stop admitting, let in-flight requests finish up to the shutdown timeout, abort the rest).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import threading
from collections.abc import Callable, Generator
from typing import Any

import uvicorn

from jaxpaged.engine.protocol import EngineClient, PoolingClient
from jaxpaged.serving.frontend import Frontend, Phase, ServingConfig
from jaxpaged.serving.grpc_service import build_grpc_server
from jaxpaged.serving.http_app import create_app
from jaxpaged.serving.metrics import ServingMetrics
from jaxpaged.serving.stats_log import StatsLog

__all__ = ["Server", "serve"]

log = logging.getLogger("jaxpaged.serving")

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "int8": 1}


class _UvicornServer(uvicorn.Server):
    """uvicorn without its own signal handlers: the Server below drains first."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class Server:
    """Both front ends of one engine. Usage (inside a running loop)::

    server = Server(config)
    await server.start()              # binds; health NOT_SERVING
    await server.load(engine_factory) # or server.attach(engine); health SERVING
    await server.wait_stopped()       # until stop() / a signal, then drains
    """

    def __init__(self, config: ServingConfig, *, log_level: str = "info") -> None:
        self.config = config
        self.metrics = ServingMetrics()
        self.frontend = Frontend(config, self.metrics)
        self.http_port: int | None = None
        self.grpc_port: int | None = None
        self._log_level = log_level
        self._stop = asyncio.Event()
        self._grpc: Any = None
        self._http: _UvicornServer | None = None
        self._http_task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None
        self._stats_task: asyncio.Task | None = None

    # ---- start ---------------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        self._grpc, self.grpc_port = build_grpc_server(self.frontend, f"{cfg.host}:{cfg.grpc_port}")
        await self._grpc.start()
        uv_config = uvicorn.Config(
            create_app(self.frontend),
            host=cfg.host,
            port=cfg.port,
            log_level=self._log_level.lower(),
            lifespan="off",
            timeout_graceful_shutdown=5,
            access_log=False,
        )
        self._http = _UvicornServer(uv_config)
        self._http_task = asyncio.create_task(self._run_http())
        while not self._http.started:
            if self._http_task.done():
                await self._grpc.stop(None)
                raise OSError(f"HTTP server could not start on {cfg.host}:{cfg.port}")
            await asyncio.sleep(0.01)
        self.http_port = self._http.servers[0].sockets[0].getsockname()[1]
        log.info(
            "listening: gRPC %s:%d, HTTP %s:%d", cfg.host, self.grpc_port, cfg.host, self.http_port
        )
        self._watch_task = asyncio.create_task(self._watch_engine())

    async def _run_http(self) -> None:
        try:
            await self._http.serve()
        except SystemExit:  # uvicorn exits this way when it cannot bind
            log.error("HTTP server failed to start")

    async def _watch_engine(self) -> None:
        while True:
            self.frontend.check_engine()
            await asyncio.sleep(0.25)

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop, sig)

    def stop(self, sig: int | None = None) -> None:
        """Begins the graceful shutdown (safe from the loop thread, e.g. a signal handler)."""
        if sig is not None and not self._stop.is_set():
            log.info(
                "received %s: draining (again to abort in-flight requests now)",
                signal.Signals(sig).name,
            )
        elif sig is not None:
            log.info("received %s again: aborting in-flight requests", signal.Signals(sig).name)
            self.frontend.force_drain()
        self._stop.set()

    # ---- engine -------------------------------------------------------------------------------
    async def load(self, factory: Callable[[], EngineClient]) -> bool:
        """Builds the engine with `factory()` in a thread (the loop keeps answering health
        checks), then starts it. Returns False if a stop was requested first."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def build() -> None:
            try:
                engine = factory()
            except BaseException as e:  # handed to the loop
                loop.call_soon_threadsafe(_settle, done, None, e)
            else:
                loop.call_soon_threadsafe(_settle, done, engine, None)

        threading.Thread(target=build, name="jaxpaged-load", daemon=True).start()
        stopper = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait({done, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if not done.done():
            log.info("stop requested while loading; exiting")
            return False
        self.attach(done.result())
        return True

    def attach(self, engine: EngineClient) -> None:
        """Starts an already built engine and opens for requests."""
        engine.start()
        self.frontend.attach_engine(engine)
        self.log_ready()
        if self.config.log_stats_interval > 0:
            self._stats_task = asyncio.create_task(self._log_stats(engine))

    async def _log_stats(self, engine: EngineClient) -> None:
        """vLLM's periodic stats lines (serving/stats_log.py) while the engine is busy."""
        stats_log = StatsLog()
        loop = asyncio.get_running_loop()
        while True:
            for line in stats_log.lines(engine.get_stats(), loop.time()):
                log.info("%s", line)
            await asyncio.sleep(self.config.log_stats_interval)

    def log_ready(self) -> None:
        engine = self.frontend.engine
        cfg = self.config
        for line in kv_pool_summary(engine):
            log.info("%s", line)
        host = cfg.host if cfg.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        auth = ' -H "Authorization: Bearer $JAXPAGED_API_KEY"' if cfg.api_key else ""
        log.info(
            "gRPC  on %s:%d (jaxpaged.v1.Generation, health, reflection)", cfg.host, self.grpc_port
        )
        log.info(
            "  python -m jaxpaged.client --grpc %s:%d 'Hello, who are you?'", host, self.grpc_port
        )
        log.info(
            '  grpcurl -plaintext -d \'{"text": "Hello", "stream": true}\' %s:%d '
            "jaxpaged.v1.Generation/Generate",
            host,
            self.grpc_port,
        )
        log.info(
            "HTTP  on http://%s:%d (OpenAI-compatible /v1, /health, /metrics)",
            cfg.host,
            self.http_port,
        )
        if isinstance(engine, PoolingClient):
            path, body = "/v1/embeddings", '{"model": "%s", "input": "Hello"}'
        else:
            path = "/v1/chat/completions"
            body = '{"model": "%s", "messages": [{"role": "user", "content": "Hello"}]}'
        log.info(
            "  curl http://%s:%d%s -H 'Content-Type: application/json'%s -d '%s'",
            host,
            self.http_port,
            path,
            auth,
            body % cfg.served_model_name,
        )
        log.info(
            "  curl http://%s:%d/metrics   (Prometheus; /health for liveness)", host, self.http_port
        )
        log.info("ready: serving %s", cfg.served_model_name)

    # ---- stop ----------------------------------------------------------------------------------
    async def wait_stopped(self) -> None:
        """Waits for stop() (or a signal), then drains and shuts everything down."""
        await self._stop.wait()
        await self.shutdown()

    async def shutdown(self) -> None:
        aborted = await self.frontend.drain(self.config.shutdown_timeout)
        if aborted:
            log.info("aborted %d request(s) at the shutdown timeout", aborted)
        if self._watch_task is not None:
            self._watch_task.cancel()
        if self._stats_task is not None:
            self._stats_task.cancel()
        if self._grpc is not None:
            await self._grpc.stop(1.0)
        if self._http is not None:
            self._http.should_exit = True
            if self._http_task is not None:
                await self._http_task
        engine = self.frontend.engine
        if engine is not None:
            try:
                await engine.shutdown()
            except Exception:
                log.exception("engine shutdown failed")
        self.frontend.stopped()
        log.info("server stopped")

    @property
    def phase(self) -> Phase:
        return self.frontend.phase


def _settle(fut: asyncio.Future, value: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)


def kv_pool_summary(engine: EngineClient) -> list[str]:
    """Start-up lines about the KV pool: blocks, GiB, sequences of max_model_len that fit."""
    num_blocks = engine.get_stats().num_kv_blocks
    ec = engine.engine_config
    mc = engine.model_config
    block_size = int(ec["block_size"])
    if block_size == 0:  # the pooling runner
        return [f"no KV cache: runner {ec.get('runner')!r}, max_model_len {engine.max_model_len}"]
    dtype = str(ec["dtype"])
    per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * _DTYPE_BYTES.get(dtype, 4)
    gib = num_blocks * block_size * per_token / (1 << 30)
    max_len = int(engine.max_model_len)
    blocks_per_seq = math.ceil(max_len / block_size)
    return [
        f"KV pool: {num_blocks} blocks x {block_size} tokens = {num_blocks * block_size} tokens, "
        f"{gib:.3f} GiB ({dtype})",
        f"KV pool fits {num_blocks // blocks_per_seq} concurrent sequences of max_model_len "
        f"{max_len} ({blocks_per_seq} blocks each); shorter sequences share it more densely",
    ]


async def serve(
    config: ServingConfig,
    engine_factory: Callable[[], EngineClient],
    *,
    log_level: str = "info",
    install_signal_handlers: bool = True,
) -> int:
    """Runs the server until SIGTERM/SIGINT, then drains. Returns the exit status (0 after a
    clean drain; 1 if the engine could not be built)."""
    server = Server(config, log_level=log_level)
    await server.start()
    if install_signal_handlers:
        server.install_signal_handlers()
    log.info("loading the engine (health is NOT_SERVING until it is ready)")
    try:
        loaded = await server.load(engine_factory)
    except Exception:
        log.exception("failed to build the engine")
        server.frontend.mark_failed(None)
        await server.shutdown()
        return 1
    if not loaded:
        await server.shutdown()
        return 0
    await server.wait_stopped()
    return 0
