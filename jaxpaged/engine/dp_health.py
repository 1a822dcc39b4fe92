"""The data-parallel client's health check of its replicas (jaxpaged.engine.data_parallel):
a replica that stops answering is hung, told apart from one that is only busy.

Every ``period / PROBES_PER_PERIOD`` seconds each live replica is sent a probe, which its
event loop answers (jaxpaged.engine.dp_replica: the loop that takes requests and sends
outputs, while the engine steps on a thread of its own). Any message counts as an answer: the
reader thread stamps the replica's ``last_heard`` as it arrives, so a replica busy streaming
is never in doubt. One silent for ``period`` minus one probe interval is hung: since the
last answer it had came at most one interval after it went silent, it is declared hung at
most ``period`` seconds after it stopped (a stopped process, a loop blocked for good). A
tick of this loop that itself came late (this process was not scheduled, e.g. a busy host)
judges nobody: the probes go out again first.

A replica that dies is restarted, at most ``max_restarts`` times within ``RESTART_WINDOW``
seconds (:class:`RestartLimit`): one that keeps dying (a bad device, a crash at start-up) is
then given up rather than restarted forever.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence

from jaxpaged.engine.dp_process import ReplicaInfo

__all__ = ["PROBES_PER_PERIOD", "RESTART_WINDOW", "RestartLimit", "watch"]

PROBES_PER_PERIOD = 5
RESTART_WINDOW = 600.0  # seconds


class RestartLimit:
    """Counts each rank's restarts over the last ``window`` seconds."""

    def __init__(
        self,
        max_restarts: int,
        window: float = RESTART_WINDOW,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_restarts = max_restarts
        self.window = window
        self._clock = clock
        self._times: dict[int, list[float]] = {}

    def allow(self, rank: int) -> bool:
        """Whether ``rank`` may be restarted now (then the restart is counted)."""
        now = self._clock()
        times = [t for t in self._times.get(rank, []) if now - t < self.window]
        allowed = len(times) < self.max_restarts
        if allowed:
            times.append(now)
        self._times[rank] = times
        return allowed


async def watch(
    replicas: Callable[[], Sequence[ReplicaInfo]],
    period: float,
    probe: Callable[[ReplicaInfo], None],
    hung: Callable[[ReplicaInfo, float], None],
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> None:
    """Runs until cancelled: probes the live ones of ``replicas()`` and calls ``hung(r,
    seconds silent)`` for one silent too long (module docstring). ``clock`` is the one that
    stamps ``last_heard``."""
    interval = period / PROBES_PER_PERIOD
    limit = period - interval
    last_tick = clock()
    while True:
        now = clock()
        late = now - last_tick > 2 * interval
        last_tick = now
        for r in list(replicas()):
            if not r.alive:
                continue
            silent = now - r.last_heard
            if silent > limit and not late:
                hung(r, silent)
            else:
                probe(r)
        await sleep(interval)
