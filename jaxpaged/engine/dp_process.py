"""A data-parallel replica's process as the client holds it (jaxpaged.engine.data_parallel):
starting it (a fresh interpreter running jaxpaged.engine.dp_replica with its devices in its
environment), waiting until it is ready, and what the client tracks about it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any

from jaxpaged.engine.async_engine import RequestStream
from jaxpaged.engine.dp_router import ReplicaLoad
from jaxpaged.engine.protocol import EngineStats, ReplicaStats

__all__ = ["REPLICA_COMMAND", "ReplicaInfo", "start_replica", "wait_exit", "wait_ready"]

log = logging.getLogger(__name__)


class ReplicaInfo:
    """One replica as the client tracks it (its process, pipe, open requests, stats, and
    when it was last heard from: the health check's clock)."""

    def __init__(self, rank: int, process: subprocess.Popen, conn: Connection) -> None:
        self.rank = rank
        self.process = process
        self.conn = conn
        self.alive = True
        self.given_up = False  # dead past its restart limit (data_parallel.RestartLimit)
        self.error: RuntimeError | None = None
        self.streams: dict[str, RequestStream] = {}
        self.calls: dict[int, asyncio.Future] = {}
        self.stats: EngineStats | None = None
        self.sent_total = 0  # requests routed to this rank (carried over by a restart)
        self.last_heard = time.monotonic()  # set by the reader thread on every message

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def summary(self) -> ReplicaStats:
        """Its gauges for the metrics (zeros once dead, or before its first stats)."""
        stats = self.stats if self.alive else None
        return ReplicaStats(
            alive=self.alive,
            num_running=0 if stats is None else stats.num_running,
            num_waiting=0 if stats is None else stats.num_waiting + stats.num_swapped,
            kv_cache_usage=0.0 if stats is None else stats.kv_cache_usage,
            requests_total=self.sent_total,
            given_up=self.given_up,
        )

    def load(self) -> ReplicaLoad:
        return ReplicaLoad(
            alive=self.alive,
            open_requests=len(self.streams),
            kv_cache_usage=0.0 if self.stats is None else self.stats.kv_cache_usage,
            sent_total=self.sent_total,
        )


REPLICA_COMMAND = (sys.executable, "-m", "jaxpaged.engine.dp_replica")


def start_replica(
    rank: int,
    env: Mapping[str, str],
    child_args: bytes,
    command: Sequence[str] = REPLICA_COMMAND,
) -> ReplicaInfo:
    """Starts replica ``rank``'s process (``command FD RANK``) with ``env`` added to this
    one's environment and hands it its pickled EngineArgs; returns at once (see
    :func:`wait_ready`)."""
    # a fresh interpreter per replica (not multiprocessing's spawn, which would run the
    # caller's __main__ again), with its devices in its environment from the start
    ours, theirs = socket.socketpair()
    process = subprocess.Popen(
        [*command, str(theirs.fileno()), str(rank)],
        env={**os.environ, **env},
        pass_fds=(theirs.fileno(),),
    )
    theirs.close()  # the replica's end: its exit then reads as EOF here
    conn = Connection(ours.detach())
    conn.send_bytes(child_args)  # the replica's conn.recv() unpickles it
    return ReplicaInfo(rank, process, conn)


def wait_ready(r: ReplicaInfo, timeout: float) -> dict[str, Any]:
    """The replica's ready info, once it has loaded and warmed up; its start-up error (or
    its exit) raised."""
    waited = 0.0
    while waited < timeout:
        batch: list[tuple] = []
        if r.conn.poll(0.5):
            try:
                batch = r.conn.recv()
            except (EOFError, OSError):
                wait_exit(r.process, 5)
            for msg in batch:
                if msg[0] == "ready":
                    r.last_heard = time.monotonic()
                    return msg[1]
                if msg[0] == "failed":
                    log.error("data-parallel replica %d could not start: %s", r.rank, msg[1])
                    raise msg[1]
        if not batch and r.process.poll() is not None:
            raise RuntimeError(
                f"data-parallel replica {r.rank} exited while starting (exit code "
                f"{r.process.returncode}); its log is above"
            )
        waited += 0.5
    raise TimeoutError(f"data-parallel replica {r.rank} did not start within {timeout} s")


def wait_exit(process: subprocess.Popen, timeout: float) -> bool:
    """Whether ``process`` exited within ``timeout`` seconds."""
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        return False
    return True
