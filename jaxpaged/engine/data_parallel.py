"""Data parallelism in one server: ``data_parallel_size`` engine replicas, each a process of
its own on its own ``tensor_parallel_size`` devices, behind one :class:`DataParallelClient`,
which is itself an ``EngineClient`` (the servers serve it unchanged).

Processes rather than threads: each engine's host work (scheduling, batch preparation,
output processing, detokenizing) is Python and holds the GIL, and the step overlap
(jaxpaged.engine.core) hides it only while one engine's host work is shorter than its device
step; N engines on threads of one process would share one interpreter's host time. A process
per replica also gives each replica its own view of the devices (the accelerator's visible
devices variable, JAX's simulated CPU devices), so every replica builds its engine exactly as
a one-replica server does, and a replica that dies takes nothing else with it.

Each request goes to one replica (jaxpaged.engine.dp_router: the least-loaded, or the one
that served the prompt's prefix unless it is overloaded). A replica that dies (its process
exits, or its engine fails) ends its open requests that had output with
:class:`ReplicaFailedError` naming it (a request's failure: the server goes on) and sends
those with no output yet to another replica; the others keep serving, and the router sends
nothing more to it. A replica that hangs (answers no health probe for
``data_parallel_health_check_period`` seconds, jaxpaged.engine.dp_health) is killed and
treated the same. A dead replica is restarted on its devices and rejoins once it is ready
(with the sleep level, the adapters and the weights path the others were given since they
started); requests meanwhile go to the others, or wait for it when none is left. A rank
is restarted (a failed start tried again) at most ``data_parallel_max_restarts`` times within
10 minutes (dp_health.RestartLimit); past that it is given up: logged, named by /health
(``replicas_given_up``) and its ReplicaStats. Only when no replica is left and none is
restarting do requests get :class:`EngineDeadError` and ``errored`` turn true (the server
then reports NOT_SERVING). Admin calls (LoRA adapters,
sleep mode, weights by path) go to every live replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import pickle
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from jaxpaged.args import EngineArgs
from jaxpaged.engine.async_engine import RequestStream
from jaxpaged.engine.core import asleep_message
from jaxpaged.engine.dp_devices import replica_environments
from jaxpaged.engine.dp_health import RestartLimit, watch
from jaxpaged.engine.dp_process import ReplicaInfo, start_replica, wait_exit, wait_ready
from jaxpaged.engine.dp_replica import replica_args
from jaxpaged.engine.dp_router import Router, RouterConfig, prefix_keys
from jaxpaged.engine.dp_stats import sum_stats
from jaxpaged.engine.input_processor import check_request_id
from jaxpaged.engine.protocol import (
    EngineAsleepError,
    EngineDeadError,
    EngineStats,
    Prompt,
    Tokenizer,
)
from jaxpaged.lora_request import LoRARequest
from jaxpaged.models.config import ModelConfig
from jaxpaged.outputs import RequestOutput, RequestOutputKind
from jaxpaged.sampling_params import SamplingParams

__all__ = ["DataParallelClient", "ReplicaFailedError", "ReplicaInfo"]

log = logging.getLogger(__name__)


class ReplicaFailedError(RuntimeError):
    """The data-parallel replica serving a request died (others still serve)."""


class DataParallelClient:
    """``data_parallel_size`` replica processes behind one EngineClient (module docstring).
    Construction starts the replicas and waits until every one has loaded and warmed up
    (they do so at the same time); ``start()`` inside the serving loop starts the health
    check."""

    def __init__(
        self, args: EngineArgs, *, router: RouterConfig | None = None, start_timeout: float = 3600
    ) -> None:
        parallel = args.parallel_config()  # ValueError
        self._period = parallel.data_parallel_health_check_period
        self._restart_limit = RestartLimit(parallel.data_parallel_max_restarts)
        args.cache_config()
        from jaxpaged.engine.runner_choice import choose_runner

        if choose_runner(args) != "generate":
            raise ValueError(
                "data_parallel_size: replicas serve text generation; a pooling model "
                "(embeddings, scores) runs on one engine (data_parallel_size 1)"
            )
        import jax

        devices = jax.devices()
        envs = replica_environments(
            args.data_parallel_size,
            args.tensor_parallel_size,
            platform=devices[0].platform,
            num_devices=len(devices),
            environ=os.environ,
        )
        self._router = Router(router or RouterConfig(block_size=args.block_size))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._owner: dict[str, ReplicaInfo] = {}  # request id -> the replica serving it
        self._unanswered: dict[str, _Unanswered] = {}  # requests with no output yet
        self._call_ids = itertools.count()
        self._sleep_level = 0
        self._stopping = False
        self._envs = envs
        self._start_timeout = start_timeout
        self._restarting: dict[int, ReplicaInfo | None] = {}  # rank -> its new process
        self._retired: list[EngineStats] = []  # replaced replicas' last stats (counters)
        self._added_loras: dict[str, LoRARequest] = {}  # since start: a restart re-adds them
        self._weights_path: str | None = None  # likewise
        self._changed: asyncio.Event | None = None  # set when a restart ends
        self._tasks: set[asyncio.Task] = set()
        try:  # before any process starts: every setting must reach the replicas
            child_args = pickle.dumps(replica_args(args))
        except Exception as exc:  # noqa: BLE001 - e.g. a lambda among logits_processors
            raise ValueError(
                f"data_parallel_size: the engine arguments must be picklable to reach the "
                f"replica processes (logits_processors: importable functions), got {exc}"
            ) from exc
        self._child_args = child_args
        self.replicas = [start_replica(rank, env, child_args) for rank, env in enumerate(envs)]
        try:
            infos = [wait_ready(r, start_timeout) for r in self.replicas]
        except BaseException:
            self._terminate(grace=0)
            raise
        first = infos[0]
        self._model_config: ModelConfig = first["model_config"]
        self._engine_config = {**first["engine_config"], "data_parallel_size": len(envs)}
        self._max_model_len: int = first["max_model_len"]
        self._tokenizer = first["tokenizer"]
        self._loras: dict[str, str] = dict(first["loras"])
        for r, info in zip(self.replicas, infos, strict=True):
            r.stats = info["stats"]

    # ------------------------------------------------------------- properties
    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def model_config(self) -> ModelConfig:
        return self._model_config

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def engine_config(self) -> Mapping[str, object]:
        return self._engine_config

    @property
    def dead_error(self) -> BaseException | None:
        if any(r.alive for r in self.replicas) or self._restarting:
            return None
        return next((r.error for r in self.replicas if r.error is not None), None)

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    @property
    def num_in_flight(self) -> int:
        return len(self._owner)

    def get_stats(self) -> EngineStats:
        """The replicas' latest stats added up: counters over every replica (a dead one's
        last), gauges over the live ones, KV usage as the share of all their blocks."""
        items = [(s, False) for s in self._retired]
        items += [(r.stats, r.alive) for r in self.replicas if r.stats is not None]
        total = sum_stats(items)
        return dataclasses.replace(total, replicas=tuple(r.summary() for r in self.replicas))

    # -------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        for r in self.replicas:
            r.last_heard = time.monotonic()
            self._start_reader(r)
        self._spawn(
            watch(
                lambda: () if self._stopping else self.replicas,
                self._period,
                lambda r: self._send(r, ("probe",)),
                self._hung,
            )
        )

    async def shutdown(self) -> None:
        """Aborts what is left, asks every replica to stop and waits for its process."""
        if self._stopping:
            return
        for rid in list(self._owner):
            await self.abort(rid)
        self._stopping = True
        for r in self.replicas:
            if r.alive:
                self._send(r, ("shutdown",))
        for task in list(self._tasks):
            task.cancel()
        await asyncio.to_thread(self._terminate)
        for r in self.replicas:  # outputs that did not arrive before the replica stopped
            for rid, stream in r.streams.items():
                stream.put(EngineDeadError(f"the engine shut down while serving {rid!r}"))
            r.streams.clear()
        self._owner.clear()

    def close(self) -> None:
        """Stops the replica processes without draining (no event loop needed): each is
        asked to stop, and killed if it has not within 5 s."""
        if self._stopping:
            return
        self._stopping = True
        for r in self.replicas:
            if r.alive:
                self._send(r, ("shutdown",))
        self._terminate(grace=5)

    # --------------------------------------------------------------- requests
    async def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        *,
        output_kind: RequestOutputKind = RequestOutputKind.DELTA,
        lora_name: str | None = None,
    ) -> RequestStream:
        """Chooses a replica (least loaded, or the holder of the prompt's prefix) and adds
        the request there; the replica validates it (its ValueError is raised here). A
        replica that dies before the request's first output (it had not taken it, or it was
        still waiting there) leaves it to the next."""
        if self._sleep_level:
            raise EngineAsleepError(asleep_message(self._sleep_level))
        if self._loop is None:
            raise RuntimeError("DataParallelClient.start() has not been called")
        check_request_id(request_id, self._owner)
        stream = RequestStream(request_id)
        pending = _Unanswered((prompt, params, output_kind, lora_name))
        self._unanswered[request_id] = pending
        try:
            await self._place(stream, pending)
        except BaseException:
            self._unanswered.pop(request_id, None)
            raise
        return stream

    async def _place(self, stream: RequestStream, pending: _Unanswered) -> None:
        """Adds the request of ``stream`` to a live replica (waiting while every one is
        restarting); the replica's ValueError, or EngineDeadError, is raised."""
        request_id, prompt = stream.request_id, pending.body[0]
        keys = prefix_keys(prompt, self._router.config) if _is_prompt(prompt) else []
        while True:
            if not any(x.alive for x in self.replicas):
                error = self.dead_error
                if error is not None:
                    raise EngineDeadError(f"the engine has failed: {error}")
                assert self._changed is not None
                await self._changed.wait()  # every replica is restarting
                continue
            r = self.replicas[self._router.choose(keys, [x.load() for x in self.replicas])]
            r.streams[request_id] = stream
            self._owner[request_id] = r
            r.sent_total += 1
            try:
                await self._request(r, "add", request_id, *pending.body)
            except (ReplicaFailedError, EngineDeadError) as exc:
                self._forget_request(r, request_id)
                if r.alive:  # its engine failed: the replica's own report follows
                    self._died(r, f"its engine failed: {exc}")
                continue  # to a live replica, or the engine's death above
            except BaseException:
                if self._forget_request(r, request_id) and r.alive:
                    self._send(r, ("abort", request_id))  # e.g. the caller went away
                raise
            if not r.alive and request_id in self._unanswered:
                continue  # it died right after taking the request (_died left it here)
            pending.taken = True
            if pending.aborted:  # while it was being sent again
                self._send(r, ("abort", request_id))
            return

    async def _send_again(self, stream: RequestStream, pending: _Unanswered) -> None:
        """A request whose replica died before its first output, on another replica."""
        pending.taken = False
        try:
            await self._place(stream, pending)
        except BaseException as exc:
            self._unanswered.pop(stream.request_id, None)
            self._owner.pop(stream.request_id, None)
            if not isinstance(exc, Exception):  # cancelled: the client shuts down
                exc = EngineDeadError(f"the engine shut down while serving {stream.request_id!r}")
            stream.put(exc)

    async def abort(self, request_id: str) -> None:
        pending = self._unanswered.get(request_id)
        if pending is not None:
            pending.aborted = True
        r = self._owner.get(request_id)
        if r is not None and r.alive:
            self._send(r, ("abort", request_id))

    # ------------------------------------------------------------------ admin
    def list_loras(self) -> dict[str, str]:
        return dict(self._loras)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        added = await self._broadcast("add_lora", lora_request)
        self._added_loras[lora_request.lora_name] = lora_request
        known = self._loras.get(lora_request.lora_name)
        self._loras[lora_request.lora_name] = lora_request.lora_path or known or ""
        return any(added)

    async def remove_lora(self, name: str) -> None:
        await self._broadcast("remove_lora", name)
        self._loras.pop(name, None)
        self._added_loras.pop(name, None)

    @property
    def is_sleeping(self) -> bool:
        return self._sleep_level > 0

    async def sleep(self, level: int = 1) -> int:
        freed = await self._broadcast("sleep", level)
        self._sleep_level = max(self._sleep_level, level)
        return sum(freed)

    async def wake_up(self) -> None:
        await self._broadcast("wake_up")
        self._sleep_level = 0

    async def update_weights_from(self, path: str) -> float:
        """Every replica loads ``path`` and swaps it in; returns the slowest load's seconds."""
        seconds = max(await self._broadcast("update_weights_from", path))
        self._weights_path = path
        return seconds

    # ---------------------------------------------------------------- private
    def _forget_request(self, r: ReplicaInfo, request_id: str) -> bool:
        """Drops a request that was being added; False if it was dropped already."""
        if r.streams.pop(request_id, None) is None:
            return False
        self._owner.pop(request_id, None)
        return True

    def _send(self, r: ReplicaInfo, msg: tuple) -> None:
        try:
            r.conn.send(msg)
        except (OSError, ValueError) as exc:  # its process is gone
            self._died(r, f"its pipe broke ({exc})")

    async def _request(self, r: ReplicaInfo, kind: str, *body: Any) -> Any:  # noqa: ANN401
        """Sends a message that the replica replies to; its value, or its exception."""
        assert self._loop is not None
        call_id = next(self._call_ids)
        future = self._loop.create_future()
        r.calls[call_id] = future
        self._send(r, (kind, call_id, *body))
        try:
            return await future
        finally:
            r.calls.pop(call_id, None)

    async def _broadcast(self, method: str, *args: Any) -> list[Any]:  # noqa: ANN401
        live = [r for r in self.replicas if r.alive]
        if not live:
            raise EngineDeadError(f"the engine has failed: {self.dead_error}")
        results = await asyncio.gather(
            *(self._request(r, "call", method, args) for r in live), return_exceptions=True
        )
        for value in results:
            if isinstance(value, BaseException):
                raise value
        return results

    def _read(self, r: ReplicaInfo) -> None:
        """A replica's reader thread: hands each batch of messages to the loop."""
        loop = self._loop
        assert loop is not None
        while True:
            try:
                batch = r.conn.recv()
                r.last_heard = time.monotonic()  # the health check's clock
            except (EOFError, OSError):
                batch = None
                wait_exit(r.process, 2)  # so that its exit code is known
            try:
                loop.call_soon_threadsafe(self._on_batch, r, batch)
            except RuntimeError:  # the loop is closed
                return
            if batch is None:
                return

    def _on_batch(self, r: ReplicaInfo, batch: list[tuple] | None) -> None:
        if batch is None:
            code = r.process.poll()
            self._died(r, "its process exited" + ("" if code is None else f" (exit code {code})"))
            return
        for msg in batch:
            kind = msg[0]
            if kind == "out":
                self._deliver(r, msg[1])
            elif kind == "reply":
                _, call_id, ok, value = msg
                future = r.calls.get(call_id)
                if future is not None and not future.done():
                    if ok:
                        future.set_result(value)
                    else:
                        future.set_exception(value)
            elif kind == "stats":
                r.stats = msg[1]
            elif kind == "fail":
                stream = r.streams.pop(msg[1], None)
                self._owner.pop(msg[1], None)
                self._unanswered.pop(msg[1], None)
                if stream is not None:
                    stream.put(ReplicaFailedError(f"data-parallel replica {r.rank}: {msg[2]}"))
            elif kind == "dead":
                self._died(r, f"its engine failed: {msg[1]}")
            # "alive" (a probe's answer): the reader stamped last_heard

    def _deliver(self, r: ReplicaInfo, out: RequestOutput) -> None:
        stream = r.streams.get(out.request_id)
        if stream is None:
            return
        self._unanswered.pop(out.request_id, None)
        stream.put(out)
        if out.finished:
            del r.streams[out.request_id]
            self._owner.pop(out.request_id, None)

    def _died(self, r: ReplicaInfo, reason: str) -> None:
        """Marks a replica dead: its open requests and calls fail naming it, and the router
        forgets it."""
        if not r.alive:
            return
        r.alive = False
        left = sum(x.alive for x in self.replicas)
        # one being added back (a restart's catch-up) that dies is not restarted again
        restart = not self._stopping and self._loop is not None and self.replicas[r.rank] is r
        if restart and not self._restart_limit.allow(r.rank):
            restart, r.given_up = False, True
            limit = self._restart_limit
            reason += (
                f"; given up: restarted {limit.max_restarts} times within {limit.window:g} s "
                "(data_parallel_max_restarts)"
            )
        # with none left and none coming back, the engine is dead; else only its requests fail
        error_type = ReplicaFailedError if left or restart or self._restarting else EngineDeadError
        r.error = error_type(f"data-parallel replica {r.rank} (pid {r.pid}) failed: {reason}")
        if self._stopping:
            return
        log.error(
            "%s; its %d open requests fail (those with no output yet go to another replica); "
            "%d replicas left%s", r.error, len(r.streams), left,
            "; restarting it" if restart else "",
        )  # fmt: skip
        self._router.forget(r.rank)
        again = []
        for rid, stream in r.streams.items():
            pending = self._unanswered.get(rid)
            if pending is not None and not pending.taken:
                continue  # being added: _place tries the next replica
            if pending is not None and (left or restart or self._restarting):
                again.append((stream, pending))  # nothing came out yet: another replica
                continue
            self._owner.pop(rid, None)
            self._unanswered.pop(rid, None)
            stream.put(error_type(f"{r.error} while serving request {rid!r}"))
        r.streams.clear()
        for stream, pending in again:
            self._spawn(self._send_again(stream, pending))
        for future in r.calls.values():
            if not future.done():
                future.set_exception(r.error)
        r.calls.clear()
        if restart:
            self._restarting[r.rank] = None
            self._spawn(self._restart(r))

    def _hung(self, r: ReplicaInfo, silent: float) -> None:
        """The health check's verdict: ``r`` answered nothing for ``silent`` seconds."""
        r.process.kill()  # SIGKILL ends a stopped (SIGSTOP) process too
        self._died(
            r,
            f"it answered no health check for {silent:.1f} s (hung; "
            f"data_parallel_health_check_period {self._period:g} s), so it was killed",
        )

    async def _restart(self, old: ReplicaInfo) -> None:
        """Starts a new process for ``old``'s rank once ``old``'s has exited (its devices are
        free then), brings it up to date (sleep level, adapters and weights path given since
        the start) and lets the router use it. A failed restart is tried again while the
        restart limit allows, then the rank is given up."""
        rank, new, retry = old.rank, None, False
        try:
            if not await asyncio.to_thread(wait_exit, old.process, 10):
                old.process.kill()
                await asyncio.to_thread(wait_exit, old.process, 5)
            if self._stopping:
                return
            new = start_replica(rank, self._envs[rank], self._child_args)
            self._restarting[rank] = new
            info = await asyncio.to_thread(wait_ready, new, self._start_timeout)
            if self._stopping:
                return
            new.stats, new.sent_total = info["stats"], old.sent_total
            self._start_reader(new)
            if self._sleep_level:
                await self._request(new, "call", "sleep", (self._sleep_level,))
            for lora_request in self._added_loras.values():
                await self._request(new, "call", "add_lora", (lora_request,))
            if self._weights_path is not None:
                await self._request(new, "call", "update_weights_from", (self._weights_path,))
            if not new.alive:
                raise RuntimeError(str(new.error))
        except Exception as exc:  # noqa: BLE001 - logged; tried again within the limit
            if new is not None:
                new.process.kill()
                await asyncio.to_thread(wait_exit, new.process, 5)
            retry = not self._stopping and self._restart_limit.allow(rank)
            old.given_up = not retry
            log.error(
                "data-parallel replica %d could not be restarted: %s; %s", rank, exc,
                "trying again" if retry else "given up (data_parallel_max_restarts)",
            )  # fmt: skip
        else:  # not after a return (stopping)
            if old.stats is not None:
                self._retired.append(old.stats)
            new.last_heard = time.monotonic()
            self.replicas[rank] = new
            log.warning("data-parallel replica %d restarted (pid %s)", rank, new.pid)
        finally:
            self._restarting.pop(rank, None)
            if retry:
                self._restarting[rank] = None
                self._spawn(self._restart(old))
            if self._stopping and new is not None and new.process.poll() is None:
                new.process.kill()
            assert self._changed is not None
            self._changed.set()  # add_request's waiters look again
            self._changed = asyncio.Event()

    def _spawn(self, coro: Any) -> None:  # noqa: ANN401 - a coroutine
        assert self._loop is not None
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _start_reader(self, r: ReplicaInfo) -> None:
        threading.Thread(
            target=self._read, args=(r,), name=f"jaxpaged-dp-{r.rank}", daemon=True
        ).start()

    def _terminate(self, grace: float = 30) -> None:
        """Waits ``grace`` seconds for every replica process, then kills what is left."""
        starting = [r for r in list(self._restarting.values()) if r is not None]
        for r in self.replicas + starting:
            if not wait_exit(r.process, grace):
                r.process.kill()
                wait_exit(r.process, 5)
            r.alive = False
            r.conn.close()


@dataclasses.dataclass
class _Unanswered:
    """A request with no output yet, kept to send it again if its replica dies."""

    body: tuple  # add_request's (prompt, params, output_kind, lora_name)
    taken: bool = False  # a replica has taken it (replied to its "add")
    aborted: bool = False


def _is_prompt(prompt: object) -> bool:
    return isinstance(prompt, str) or (
        isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt)
    )
