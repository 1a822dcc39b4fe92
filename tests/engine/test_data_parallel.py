"""Data parallelism (``--data-parallel-size``, ``LLM(data_parallel_size=N)``).

In this process: the router's choices against hand-computed loads, each replica's devices,
the replicas' stats added up, the health check's verdicts on a hand-driven clock, and the
refusals. In ONE subprocess with 4 simulated CPU
devices (dp_checks.py): 2 replica processes x 2 devices, first as the offline
LLM(data_parallel_size=2), then behind the real server, asked with the `openai` client:
greedy texts equal one engine's, requests spread, /metrics adds the replicas up (and shows
each), a shared prompt prefix stays on one replica, killing a replica fails exactly its open
streams (never a hang), a request it had not taken yet goes to the other, which serves the
rest until the killed one is restarted and rejoins; then the other replica is frozen
(SIGSTOP, hung): the health check finds it within its period, its streams fail naming it,
it is killed and its restart begins (the first restart showed a rejoin). In this process
too, on fake replica processes (fake_dp_replica.py): a restart's catch-up and the restart
limit.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from simulated_devices import assert_ok, run_checks

from jaxpaged.engine.data_parallel import DataParallelClient
from jaxpaged.engine.dp_devices import replica_environments
from jaxpaged.engine.dp_router import ReplicaLoad, Router, RouterConfig, prefix_keys
from jaxpaged.engine.dp_stats import sum_stats
from jaxpaged.engine.protocol import EngineClient, EngineStats
from jaxpaged.engine.protocol_check import assert_implements

HERE = Path(__file__).parent


def _load(open_requests=0, kv=0.0, sent=0, alive=True) -> ReplicaLoad:
    return ReplicaLoad(alive=alive, open_requests=open_requests, kv_cache_usage=kv, sent_total=sent)


def test_router_least_loaded_then_affinity_within_its_slack():
    router = Router(RouterConfig(block_size=2, affinity_slack=1, kv_overload=0.9))
    # fewest open requests, then KV usage in tenths, then fewest sent, then rank
    assert router.least_loaded([_load(2), _load(1), _load(1, kv=0.3)]) == 1
    assert router.least_loaded([_load(1, kv=0.31, sent=9), _load(1, kv=0.34)]) == 1
    assert router.least_loaded([_load(1, sent=3), _load(1, sent=2)]) == 1
    assert router.least_loaded([_load(0, alive=False), _load(5)]) == 1
    with pytest.raises(ValueError, match="no live replica"):
        router.least_loaded([_load(alive=False)])

    conversation = [1, 2, 3, 4, 5, 6]
    keys = prefix_keys(conversation, router.config)
    assert len(keys) == 3 and prefix_keys([1, 2, 3], router.config) == keys[:1]
    assert router.choose(keys, [_load(1), _load(0)]) == 1  # new prefix: least loaded
    # a longer turn of the same conversation stays, up to `slack` more open requests
    longer = prefix_keys([*conversation, 7, 8], router.config)
    assert router.choose(longer, [_load(0), _load(1)]) == 1
    assert router.choose(longer, [_load(0), _load(2)]) == 0  # overloaded by 2 > slack 1
    assert router.choose(longer, [_load(0), _load(0, kv=0.95)]) == 0  # now held by 0
    assert router.choose(keys, [_load(3), _load(0)]) == 1  # 0's KV: fine, its load: not
    # only the shared first block: the replica that was sent it last
    assert router.choose(prefix_keys([1, 2, 9, 9], router.config), [_load(0), _load(0)]) == 1
    router.forget(1)
    assert router.choose(keys, [_load(1), _load(0, alive=False)]) == 0


def test_text_prefix_keys_follow_characters():
    config = RouterConfig(block_size=4)  # 16-character chunks
    a = prefix_keys("x" * 40 + "tail one", config)
    b = prefix_keys("x" * 40 + "other tail", config)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    assert prefix_keys("short", config) == []
    assert len(prefix_keys("y" * 10_000, config)) == config.max_chunks


def test_replica_devices():
    envs = replica_environments(
        2, 2, platform="cpu", num_devices=4,
        environ={"XLA_FLAGS": "--xla_force_host_platform_device_count=4 --xla_foo=1"},
    )  # fmt: skip
    assert (
        envs
        == [
            {
                "XLA_FLAGS": "--xla_foo=1 --xla_force_host_platform_device_count=2",
                "JAX_PLATFORMS": "cpu",
            }
        ]
        * 2
    )
    gpu = replica_environments(3, 2, platform="gpu", num_devices=6, environ={})
    assert [e["CUDA_VISIBLE_DEVICES"] for e in gpu] == ["0,1", "2,3", "4,5"]
    given = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    gpu = replica_environments(2, 1, platform="gpu", num_devices=4, environ=given)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in gpu] == ["4", "5"]
    with pytest.raises(ValueError, match=r"data_parallel_size 3 x tensor_parallel_size 2 needs 6"):
        replica_environments(3, 2, platform="gpu", num_devices=4, environ={})
    with pytest.raises(ValueError, match="not supported on tpu"):
        replica_environments(2, 1, platform="tpu", num_devices=4, environ={})


def _stats(**kw) -> EngineStats:
    base = dict(
        num_running=0, num_waiting=0, num_swapped=0, kv_cache_usage=0.0, kv_cache_waste=0.0,
        num_kv_blocks=100, num_free_blocks=100, num_preemptions=0, prefix_cache_queries=0,
        prefix_cache_hits=0, prompt_tokens_total=0, generation_tokens_total=0, num_steps=0,
        num_compilations=0, num_compilations_after_warmup=0,
    )  # fmt: skip
    return EngineStats(**{**base, **kw})


def test_stats_add_up():
    a = _stats(num_running=2, kv_cache_usage=0.5, prompt_tokens_total=10,
               spec_decode_num_accepted_tokens_per_pos=(3, 1), running_lora_adapters=("x",))  # fmt: skip
    b = _stats(num_waiting=1, kv_cache_usage=0.2, num_kv_blocks=300, num_free_blocks=240,
               prompt_tokens_total=5, spec_decode_num_accepted_tokens_per_pos=(2,),
               running_lora_adapters=("w", "x"))  # fmt: skip
    dead = _stats(num_running=7, prompt_tokens_total=100)
    s = sum_stats([(a, True), (b, True), (dead, False)])
    assert (s.num_running, s.num_waiting) == (2, 1)  # gauges: the live replicas
    assert s.prompt_tokens_total == 115  # counters: every replica's last
    assert s.num_kv_blocks == 400 and s.num_free_blocks == 340
    assert s.kv_cache_usage == pytest.approx((0.5 * 100 + 0.2 * 300) / 400)
    assert s.spec_decode_num_accepted_tokens_per_pos == (5, 1)
    assert s.running_lora_adapters == ("w", "x")


def test_refusals(capsys):
    from jaxpaged.args import EngineArgs
    from jaxpaged.cli.serve import build_parser, main
    from jaxpaged.engine import LLMEngine

    assert_implements(EngineClient, DataParallelClient)
    args = build_parser().parse_args(["-dp", "2", "-tp", "2"])
    assert EngineArgs.from_cli_args(args).parallel_config().data_parallel_size == 2
    with pytest.raises(ValueError, match="data_parallel_size must be an int >= 1"):
        EngineArgs(data_parallel_size=0).parallel_config()
    period = ["-dp", "2", "--data-parallel-health-check-period", "2.5"]
    parsed = EngineArgs.from_cli_args(build_parser().parse_args(period))
    assert parsed.parallel_config().data_parallel_health_check_period == 2.5
    for bad in (0, -1.0, float("nan"), "5"):
        with pytest.raises(ValueError, match="data_parallel_health_check_period must be"):
            EngineArgs(data_parallel_health_check_period=bad).parallel_config()
    with pytest.raises(ValueError, match="an LLMEngine is one replica"):  # before any load
        LLMEngine.from_engine_args(EngineArgs(model="/nonexistent", data_parallel_size=2))
    for argv, message in [
        (["-dp", "2"], "data_parallel_size 2 x tensor_parallel_size 1 needs 2 devices; 1 "),
        (["-dp", "2", "--num-processes", "2"], "runs its replicas on one host"),
    ]:  # this process has one device
        with pytest.raises(SystemExit):
            main([*argv, "--no-configure-process"])
        assert message in capsys.readouterr().err


# ---- 2 replica processes x 2 simulated devices (one subprocess) ------------------------------


@pytest.fixture(scope="module")
def dp_results(tmp_path_factory) -> tuple[dict[str, str], str]:
    return run_checks(HERE / "dp_checks.py", tmp_path_factory.mktemp("dp"), timeout=900)


CHECKS = ["offline", "server", "metrics", "affinity", "replica_death", "replica_restart",
          "replica_hang"]  # fmt: skip


@pytest.mark.parametrize("check", CHECKS)
def test_data_parallel(dp_results, check):
    assert_ok(dp_results, check)


def _watch(replicas, steps, probe) -> list[tuple[int, float, float]]:
    """dp_health.watch (period 5 s: probes every 1 s, hung after 4 s silent) on a clock
    that starts at 0 and advances by ``steps`` at each of its sleeps; (rank, time, seconds
    silent) of each verdict. A verdict marks the replica dead, as the client does."""
    import asyncio

    from jaxpaged.engine.dp_health import watch

    now, steps, verdicts = [0.0], iter(steps), []

    def hung(r, silent: float) -> None:
        verdicts.append((r.rank, now[0], silent))
        r.alive = False

    async def sleep(_: float) -> None:
        try:
            now[0] += next(steps)
        except StopIteration:
            raise asyncio.CancelledError from None

    async def go() -> None:
        with pytest.raises(asyncio.CancelledError):
            await watch(lambda: replicas, 5.0, lambda r: probe(r, now[0]), hung,
                        clock=lambda: now[0], sleep=sleep)  # fmt: skip

    asyncio.run(go())
    return verdicts


def test_health_check_finds_a_silent_replica_within_its_period():
    """The client's health check on a hand-driven clock: a replica that answers its probes
    is never judged; one that stops answering at 2 s is declared hung once, within the
    period (5 s) of it; a dead one is not probed; a tick that came late (this process was
    not scheduled) judges nobody."""
    from types import SimpleNamespace

    answers = SimpleNamespace(rank=0, alive=True, last_heard=0.0)
    freezes = SimpleNamespace(rank=1, alive=True, last_heard=0.0)
    dead = SimpleNamespace(rank=2, alive=False, last_heard=0.0)
    probes = []

    def probe(r, now: float) -> None:
        probes.append((r.rank, now))
        if r is answers or now < 2.0:
            r.last_heard = now

    verdicts = _watch([answers, freezes, dead], [1.0] * 12, probe)
    assert verdicts == [(1, 6.0, 5.0)]  # last answer at 1 s; judged 4 s after it stopped
    assert [t for r, t in probes if r == 0] == [float(t) for t in range(13)]
    assert [t for r, t in probes if r == 1] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert all(r != 2 for r, _ in probes)

    silent = SimpleNamespace(rank=0, alive=True, last_heard=0.0)
    # the tick at 4.5 s comes 4.5 s after the one before: no verdict; the next one judges
    assert _watch([silent], [4.5, 1.0, 1.0], lambda r, now: None) == [(0, 5.5, 5.5)]


def _fake_replicas(tmp_path, monkeypatch, *modes: str):
    """The client's replica processes become fake_dp_replica.py ones, rank i with
    FAKE_DP_DIE=modes[i]; returns notes(rank, pid=None): the lines rank's processes logged."""
    import functools
    import sys

    from jaxpaged.engine import data_parallel
    from jaxpaged.engine.dp_process import start_replica

    logs = [tmp_path / f"rank{rank}.log" for rank in range(len(modes))]
    envs = [
        {"FAKE_DP_LOG": str(log), "FAKE_DP_DIE": mode}
        for log, mode in zip(logs, modes, strict=True)
    ]
    fake = (sys.executable, str(HERE / "fake_dp_replica.py"))
    monkeypatch.setattr(data_parallel, "replica_environments", lambda *a, **k: envs)
    monkeypatch.setattr(
        data_parallel, "start_replica", functools.partial(start_replica, command=fake)
    )

    def notes(rank: int, pid: int | None = None) -> list[str]:
        lines = [line.split() for line in logs[rank].read_text().splitlines()]
        return [what for p, what in lines if pid is None or int(p) == pid]

    return notes


async def _until(condition, seconds: float = 60) -> None:
    import asyncio

    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_restarts_catch_up_then_stop_at_the_limit(tmp_path, monkeypatch):
    """On fake replica processes (fake_dp_replica.py: the pipe protocol, no engine, ~0.1 s
    to start): a restarted replica is sent the sleep level and the adapter added since the
    start before it serves; one that dies after every start is restarted
    data_parallel_max_restarts (2) times, then given up (its stats say so, the other serves
    on); once every rank is given up the engine is dead and a request fails naming why."""
    import asyncio

    from jaxpaged.args import EngineArgs
    from jaxpaged.engine.protocol import EngineDeadError
    from jaxpaged.lora_request import LoRARequest
    from jaxpaged.sampling_params import SamplingParams

    notes = _fake_replicas(tmp_path, monkeypatch, "", "after_ready")

    async def go() -> None:
        client = DataParallelClient(EngineArgs(data_parallel_size=2, data_parallel_max_restarts=2))
        client.start()
        try:
            await _until(lambda: client.replicas[1].given_up)
            assert notes(1).count("start") == 3  # its first start and 2 restarts
            replicas = client.get_stats().replicas
            assert [(r.alive, r.given_up) for r in replicas] == [(True, False), (False, True)]
            assert not client.errored and "given up" in str(client.replicas[1].error)

            await client.sleep(1)
            await client.add_lora(LoRARequest("a", 1, "/adapters/a"))
            first = client.replicas[0]
            first.process.kill()
            await _until(lambda: client.replicas[0] is not first and client.replicas[0].alive)
            assert notes(0, client.replicas[0].pid) == ["start", "sleep", "add_lora"]
            await client.wake_up()

            second = client.replicas[0]
            second.process.kill()  # its second restart: the limit
            await _until(lambda: client.replicas[0] is not second and client.replicas[0].alive)
            client.replicas[0].process.kill()
            await _until(lambda: client.errored)
            assert client.replicas[0].given_up
            with pytest.raises(EngineDeadError, match="given up"):
                await client.add_request("x", "hello", SamplingParams())
        finally:
            await client.shutdown()

    asyncio.run(go())


def test_a_request_with_no_output_yet_goes_to_another_replica(tmp_path, monkeypatch):
    """A replica that dies right after taking a request (fake: it never answers) leaves the
    request, which had no output yet, to the other replica: the caller's stream is the same
    and carries no error."""
    import asyncio

    from jaxpaged.args import EngineArgs
    from jaxpaged.sampling_params import SamplingParams

    notes = _fake_replicas(tmp_path, monkeypatch, "", "after_add")

    async def go() -> None:
        client = DataParallelClient(EngineArgs(data_parallel_size=2))
        client.start()
        try:
            await client.add_request("a", "first prompt", SamplingParams())  # rank 0: tie
            stream = await client.add_request("b", "second prompt", SamplingParams())  # rank 1
            await _until(lambda: "add:b" in notes(0))
            assert notes(1).count("add:b") == 1 and notes(0).count("add:b") == 1
            assert client._owner["b"] is client.replicas[0] and stream._queue.empty()
        finally:
            await client.shutdown()

    asyncio.run(go())
