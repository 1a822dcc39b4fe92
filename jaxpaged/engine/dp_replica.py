"""One data-parallel replica: the process that :class:`~jaxpaged.engine.data_parallel.
DataParallelClient` starts per replica. It sees only its own devices (the environment it is
started with), builds one LLMEngine, serves it through an AsyncEngine, and talks to the
client over a pipe of pickled messages.

From the client (after the EngineArgs): ``("add", call_id, request_id, prompt, params,
output_kind, lora_name)``, ``("abort", request_id)``, ``("call", call_id, method, args)`` (an
AsyncEngine admin method), ``("probe",)`` (the health check), ``("shutdown",)``. To the
client, in lists (one ``send`` per loop pass): ``("ready", info)`` once, ``("failed",
error)`` if the engine could not be built, ``("reply", call_id, ok, value)``, ``("out",
RequestOutput)``, ``("fail", request_id, message)`` (the engine died under that request),
``("stats", EngineStats)``, ``("alive",)`` (a probe's answer), and ``("dead", message)``
before it exits after an engine failure.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
import pickle
import signal
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

from jaxpaged.args import EngineArgs

__all__ = ["main", "replica_args", "replica_main"]

log = logging.getLogger(__name__)

STATS_PERIOD = 0.05  # seconds between stats reports while the stats change


def main(argv: list[str] | None = None) -> None:
    """``python -m jaxpaged.engine.dp_replica FD RANK``: FD is this end of the client's
    socket pair; the first message on it is the EngineArgs. The environment (this replica's
    devices) was set by the client when it started the process, before JAX could start."""
    # Ctrl-C reaches the whole process group: the server drains, then stops its replicas
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    fd, rank = (int(x) for x in (sys.argv[1:] if argv is None else argv))
    conn = Connection(fd)
    args = conn.recv()
    replica_main(rank, args, conn)


def replica_main(rank: int, args: EngineArgs, conn: Connection) -> None:
    """Builds the engine and serves it over ``conn`` until the client stops it or goes."""
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s replica {rank} %(name)s: %(message)s"
    )
    from jaxpaged.engine.llm_engine import LLMEngine

    try:
        engine = LLMEngine.from_engine_args(args)
    except BaseException as exc:  # noqa: BLE001 - reported to the client
        conn.send([("failed", _picklable(exc))])
        return
    gc.collect()
    gc.freeze()  # what exists now lives as long as the replica (as jaxpaged serve does)
    asyncio.run(_serve(engine, conn))


async def _serve(engine: Any, conn: Connection) -> None:  # noqa: ANN401 - an LLMEngine
    from jaxpaged.engine.async_engine import AsyncEngine

    loop = asyncio.get_running_loop()
    client = AsyncEngine(engine)
    client.start()
    sender = _Sender(conn, loop, client)
    inbox: asyncio.Queue[tuple | None] = asyncio.Queue()

    def read() -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the client went away
                msg = None
            loop.call_soon_threadsafe(inbox.put_nowait, msg)
            if msg is None or msg[0] == "shutdown":
                return

    threading.Thread(target=read, name="jaxpaged-dp-reader", daemon=True).start()
    sender.send(
        (
            "ready",
            {
                "pid": os.getpid(),
                "model_config": engine.model_config,
                "engine_config": dict(engine.engine_config),
                "max_model_len": engine.max_model_len,
                "tokenizer": engine.tokenizer,
                "loras": dict(engine.list_loras()),
                "stats": client.get_stats(),
            },
        )
    )
    stats = asyncio.create_task(_report_stats(client, sender))
    stats.add_done_callback(lambda _: inbox.put_nowait(None))  # the engine died: exit
    tasks: set[asyncio.Task] = set()
    # requests being added (validated off the loop) -> whether an abort came meanwhile
    adding: dict[str, bool] = {}
    while True:
        msg = await inbox.get()
        if msg is None or msg[0] == "shutdown":
            break
        if msg[0] == "probe":  # the client's health check (jaxpaged.engine.dp_health)
            sender.send(("alive",))
            continue
        if msg[0] == "abort":
            if msg[1] in adding:
                adding[msg[1]] = True  # aborted as soon as it is in
            else:
                await client.abort(msg[1])
            continue
        if msg[0] == "add":
            adding[msg[2]] = False
            coro = _request(client, sender, adding, *msg[1:])
        else:
            coro = _call(client, sender, *msg[1:])
        task = asyncio.create_task(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    stats.cancel()
    await client.shutdown()
    sender.flush()


async def _request(
    client: Any,  # noqa: ANN401 - the AsyncEngine
    sender: _Sender,
    adding: dict[str, bool],
    call_id: int,
    request_id: str,
    prompt: Any,  # noqa: ANN401
    params: Any,  # noqa: ANN401
    output_kind: Any,  # noqa: ANN401
    lora_name: str | None,
) -> None:
    try:
        stream = await client.add_request(
            request_id, prompt, params, output_kind=output_kind, lora_name=lora_name
        )
    except Exception as exc:  # noqa: BLE001 - the client raises it
        adding.pop(request_id, None)
        sender.send(("reply", call_id, False, _picklable(exc)))
        return
    sender.send(("reply", call_id, True, None))
    if adding.pop(request_id, False):
        await client.abort(request_id)
    try:
        async for out in stream:
            sender.send(("out", out))
    except Exception as exc:  # noqa: BLE001 - the engine died under this request
        sender.send(("fail", request_id, f"{type(exc).__name__}: {exc}"))


async def _call(client: Any, sender: _Sender, call_id: int, method: str, args: tuple) -> None:  # noqa: ANN401
    try:
        value = getattr(client, method)(*args)
        if asyncio.iscoroutine(value):
            value = await value
    except Exception as exc:  # noqa: BLE001 - the client raises it
        sender.send(("reply", call_id, False, _picklable(exc)))
    else:
        sender.send(("reply", call_id, True, value))


async def _report_stats(client: Any, sender: _Sender) -> None:  # noqa: ANN401
    """Sends the engine's stats whenever a step changed them (steps without outputs too);
    reports a dead engine (then the replica exits)."""
    while True:
        sender.flush()
        if client.errored:
            sender.send(("dead", f"{type(client.dead_error).__name__}: {client.dead_error}"))
            sender.flush()
            return
        await asyncio.sleep(STATS_PERIOD)


class _Sender:
    """Batches the messages of one event-loop pass into one pipe write: the outputs of one
    engine step reach the loop together and leave together, with the engine's stats when
    they changed (taken after that step, so the client's stats are never older than its
    outputs)."""

    def __init__(self, conn: Connection, loop: asyncio.AbstractEventLoop, client: Any) -> None:  # noqa: ANN401
        self._conn = conn
        self._loop = loop
        self._client = client
        self._stats: Any = None
        self._pending: list[tuple] = []

    def send(self, msg: tuple) -> None:
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(msg)

    def flush(self) -> None:
        batch, self._pending = self._pending, []
        stats = self._client.get_stats()
        if stats is not self._stats:
            batch.append(("stats", stats))
            self._stats = stats
        if not batch:
            return
        try:
            self._conn.send(batch)
        except (OSError, ValueError):  # the client is gone: nobody to tell
            log.warning("the client went away; %d messages dropped", len(batch))


def _picklable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling with its type, else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


def replica_args(args: EngineArgs) -> EngineArgs:
    """A replica's own engine arguments: one replica; its process is its own to configure."""
    return dataclasses.replace(args, data_parallel_size=1, configure_process=True)


if __name__ == "__main__":
    main()
