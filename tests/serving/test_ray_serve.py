"""jaxpaged under Ray Serve (jaxpaged.serving.ray_serve:build_app).

build_app's mapping (serve's flags and Ray's options, as ``serve run key=value`` hands them
over) becomes the deployment Ray would start, checked by serve's own parser, and a bad key is
refused before Ray starts anything.

Then one local Ray cluster for the module runs 2 replicas of a tiny random Llama and the
real `openai` client sends 16 concurrent requests through Ray's proxy; a session stays on
one replica; the actor of the replica serving a stream is killed: the stream fails (never
hangs), requests sent afterwards are all answered and Ray brings the replica back. About
44 s of CPU with a warm compilation cache (Ray's processes ~12 s, three replica starts, the
replacement included, ~10 s each; docs/scaling.md). With
JAXPAGED_TEST_FULL=1 also: every replica killed while a stream runs: the stream fails and a
request sent meanwhile is answered by the restarted replicas.
"""

from __future__ import annotations

import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

serve = pytest.importorskip("ray.serve")  # the ray extra (in dev)

from jaxpaged.serving.ray_serve import build_app, deployment_options, serve_argv  # noqa: E402

FULL = os.environ.get("JAXPAGED_TEST_FULL") == "1"


def test_build_app_maps_flags_and_ray_options():
    app = build_app({
        "model": "/models/m", "max-model-len": "4096", "enable_prefix_caching": "false",
        "served_model_name": "m", "num_replicas": "2", "num_gpus": "1",
        "max_ongoing_requests": "32", "graceful_shutdown_timeout_s": "30",
    })  # fmt: skip
    assert app._bound_deployment.name == "jaxpaged-ingress"  # relays to the engine replicas
    assert app._bound_deployment.max_ongoing_requests == 10_000  # not Ray's 5
    (engine,) = app._bound_deployment.init_args
    deployment = engine._bound_deployment
    assert deployment.name == "jaxpaged"
    assert deployment.num_replicas == 2
    assert deployment.ray_actor_options["num_gpus"] == 1
    assert deployment.max_ongoing_requests == 32
    (argv,) = deployment.init_args
    assert argv == [
        "--model", "/models/m", "--max-model-len", "4096", "--no-enable-prefix-caching",
        "--served-model-name", "m",
    ]  # fmt: skip
    router = deployment._deployment_config.request_router_config.request_router_class
    assert router == "jaxpaged.serving.ray_router.PrefixAffinityRouter"
    options, _ = deployment_options(
        {"autoscaling_config": '{"min_replicas": 1, "max_replicas": 4}', "session_affinity": "true"}
    )
    assert options["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4}
    ingress = build_app({"model": "m", "ingress_options": '{"num_replicas": 2}'})
    assert ingress._bound_deployment.num_replicas == 2


@pytest.mark.parametrize(
    "args, message",
    [
        ({"max_model_lenn": "8"}, "max_model_lenn"),
        ({"max_model_len": "many"}, "max-model-len"),
        ({"port": "9000"}, "Ray"),
        ({"data_parallel_size": "2"}, "num_replicas"),
        ({"num_replicas": "two"}, "num_replicas"),
        ({"session_affinity": "maybe"}, "session_affinity"),
    ],
)
def test_build_app_refuses_bad_keys(args, message):
    with pytest.raises(ValueError, match=message):
        build_app(args)


def test_serve_argv_is_what_jaxpaged_serve_parses():
    from jaxpaged.cli.serve import build_parser

    argv = serve_argv({"model": "m", "tensor_parallel_size": 2, "enforce_eager": True})
    assert build_parser().parse_args(argv).tensor_parallel_size == 2


# ---- a local Ray cluster (one per module) ----------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_app(tmp_path_factory):
    """2 replicas of a tiny random Llama (a word-level tokenizer of 512 words: it loads in
    milliseconds, the bundled one in seconds) behind Ray's proxy, on a local cluster started with
    the least it needs: no dashboard; 4 CPUs, so Ray prestarts the 4 workers that Serve's
    controller, its proxy and the 2 replicas then run in; engines without warm-up (the few
    shapes the tests use compile on first use) sharing one persistent compilation cache; a
    health check every second; the router's queue probes given seconds, not 0.1 s. The proxy may take 60 s to start (Ray's 5 s default kills
    it on a busy machine, and serve.start then fails)."""
    import ray
    from tiny_llama import write_tiny_llama

    folder = write_tiny_llama(tmp_path_factory.mktemp("tiny"), words=512)
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(tmp_path_factory.mktemp("xla"))
    port = _free_port()
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")  # read by the controller
    # the router's probe of a replica's queue (0.1 s, at most 1 s by default) times out on a
    # busy machine, and the session router then falls back to the next replica on the ring
    monkeypatch.setenv("RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S", "5")
    monkeypatch.setenv("RAY_SERVE_MAX_QUEUE_LENGTH_RESPONSE_DEADLINE_S", "10")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    monkeypatch.undo()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_app({
            "model": folder, "served_model_name": "tiny", "num_replicas": 2, "num_cpus": 0,
            "max_model_len": 512, "num_kv_blocks": 64, "max_num_seqs": 8,
            "enforce_eager": True, "compile_cache_dir": cache, "health_check_period_s": 1,
            "health_check_timeout_s": 30, "session_affinity": True,
        })  # fmt: skip
        serve.run(app, name="jaxpaged", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        ray.shutdown()  # Serve's actors and the replicas' engines go with the cluster


def _replicas() -> list[str]:
    """The engine replicas' states (the ingress deployment aside)."""
    engines = serve.status().applications["jaxpaged"].deployments["jaxpaged"]
    return [state for state, n in engines.replica_states.items() for _ in range(n)]


def _wait_for_two_running(seconds: float = 240) -> None:
    deadline = time.monotonic() + seconds
    while _replicas() != ["RUNNING", "RUNNING"]:
        assert time.monotonic() < deadline, _replicas()
        time.sleep(0.2)


def _replica_actors() -> dict[str, object]:
    """Replica actor handles by actor name (which ends with the replica's tag)."""
    import ray

    return {
        a["name"]: ray.get_actor(a["name"], namespace=a["namespace"])
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("SERVE_REPLICA::jaxpaged#jaxpaged#")
    }  # fmt: skip


def _ask(url: str, i: int) -> tuple[str, int]:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    if i % 2:
        stream = client.completions.create(
            model="tiny", prompt=f"w{10 + i % 4} w20 w30", max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        text, used = "", 0
        for chunk in stream:
            text += "".join(c.text for c in chunk.choices)
            used = chunk.usage.completion_tokens if chunk.usage else used
        return text, used
    out = client.completions.create(
        model="tiny", prompt=f"w{10 + i % 4} w20 w30", max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    return out.choices[0].text, out.usage.completion_tokens


def test_two_replicas_answer_concurrent_openai_requests(ray_app):
    assert _replicas() == ["RUNNING", "RUNNING"]
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda i: _ask(ray_app, i), range(16)))
    assert all(used == 6 for _, used in got)
    # greedy: a prompt gives one text, whichever replica (and streamed or not) served it
    for k in range(4):
        assert len({text for i, (text, _) in enumerate(got) if i % 4 == k}) == 1


def test_a_conversation_stays_on_one_replica(ray_app):
    """A conversation's growing prompt (no header) lands on one replica, so does a session's
    x-session-id, and different conversations spread over both (jaxpaged.serving.ray_router)."""
    import httpx

    def replica(prompt: str, headers: dict | None = None) -> str:
        r = httpx.post(
            ray_app + "/v1/completions",
            headers=headers or {},
            json={"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        return r.headers["x-jaxpaged-replica"]

    first = {}
    for c in range(4):  # each turn repeats the conversation so far, then adds to it
        turns = " ".join(f"w{c}{k} w3{k}" for k in range(12))
        first[c] = replica(turns)
        assert {replica(turns + f" w5{t} w6{t}" * t) for t in range(1, 4)} == {first[c]}, c
    assert len(set(first.values())) == 2  # new conversations go to the less-loaded one
    for session in ("conversation-a", "conversation-b"):
        assert len({replica(f"w9 w{i}", {"x-session-id": session}) for i in range(3)}) == 1


def test_a_client_that_goes_away_aborts_its_request(ray_app):
    """A stream closed after its first chunk is aborted on its replica through the ingress's
    relay: that replica runs nothing within seconds, having generated far fewer than the
    500 tokens asked for (the session header sends /metrics to the same replica)."""
    import httpx

    headers = {"x-session-id": "goes-away"}

    def replica_metrics() -> tuple[str, dict[str, float]]:
        from prometheus_client.parser import text_string_to_metric_families

        r = httpx.get(ray_app + "/metrics", headers=headers, timeout=60)
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(r.text):
            for sample in family.samples:  # summed over labels (model_name)
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
        return r.headers["x-jaxpaged-replica"], values

    tag, before = replica_metrics()
    body = {"model": "tiny", "prompt": "w7 w8", "max_tokens": 500, "temperature": 0,
            "stream": True, "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", ray_app + "/v1/completions", headers=headers, json=body,
                      timeout=120) as r:  # fmt: skip
        assert r.headers["x-jaxpaged-replica"] == tag
        next(r.iter_lines())
    deadline = time.monotonic() + 30
    while True:
        where, values = replica_metrics()
        assert where == tag
        if values["vllm:num_requests_running"] == 0:
            break
        assert time.monotonic() < deadline, "the request still runs after its client left"
        time.sleep(0.1)
    generated = (
        values["jaxpaged:generation_tokens_total"] - before["jaxpaged:generation_tokens_total"]
    )
    assert 0 < generated < 400, generated


def test_killed_replica_fails_its_stream_only_and_is_replaced(ray_app):
    """The actor of the replica serving a stream is killed: that stream, which had started,
    ends with an error within seconds (never hangs); the requests sent after the kill are
    all answered (by the other replica); Ray starts a replacement, and both run again."""
    import openai
    import ray

    client = openai.OpenAI(base_url=ray_app + "/v1", api_key="x", max_retries=0, timeout=120)
    raw = client.completions.with_raw_response.create(
        model="tiny", prompt="w7 w8", max_tokens=400, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    tag = raw.headers["x-jaxpaged-replica"]
    chunks = iter(raw.parse())
    next(chunks)  # streaming has started
    actors = _replica_actors()
    (victim,) = [name for name in actors if name.endswith(tag)]
    start = time.monotonic()
    ray.kill(actors[victim], no_restart=True)
    with pytest.raises(openai.APIError):
        n = sum(1 for _ in chunks)
        pytest.fail(f"the stream ended normally after {n} more chunks")  # not an APIError
    assert time.monotonic() - start < 30
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: _ask(ray_app, i), range(8)))
    assert all(used == 6 for _, used in got)
    _wait_for_two_running()
    assert victim not in _replica_actors()  # a new replica, not the killed one


@pytest.mark.skipif(not FULL, reason="two more replica starts (~20 s): JAXPAGED_TEST_FULL=1")
def test_stream_cut_by_dead_replicas_fails_and_new_requests_wait_for_new_ones(ray_app):
    """Every replica killed while a stream runs: the stream ends with an error (no hang), and
    a request sent meanwhile is answered once Ray has started replicas again."""
    import openai
    import ray

    _wait_for_two_running()
    client = openai.OpenAI(base_url=ray_app + "/v1", api_key="x", max_retries=0, timeout=120)
    stream = client.completions.create(
        model="tiny", prompt="w7 w8", max_tokens=400, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = iter(stream)
    next(chunks)  # streaming has started
    start = time.monotonic()
    for actor in _replica_actors().values():
        ray.kill(actor, no_restart=True)
    with pytest.raises(openai.APIError):
        n = sum(1 for _ in chunks)
        pytest.fail(f"the stream ended normally after {n} more chunks")  # not an APIError
    assert time.monotonic() - start < 30
    assert _ask(ray_app, 1)[1] == 6  # queued by Ray until a replica is back


def test_replica_health_follows_its_engine_and_the_destructor_stops_it():
    """What Ray calls on a replica, without Ray: check_health raises until the engine serves
    and after it fails; the destructor (Ray's downscale) drains and stops the engine."""
    import asyncio

    from fakes import FakeAsyncEngine

    from jaxpaged.serving.frontend import Frontend, Phase, ServingConfig
    from jaxpaged.serving.ray_serve import JaxpagedReplica

    async def go() -> None:
        replica = JaxpagedReplica([])
        with pytest.raises(RuntimeError, match="not built"):
            await replica.check_health()
        engine = FakeAsyncEngine()
        engine.start()
        replica.frontend = Frontend(ServingConfig(served_model_name="m"))
        replica.frontend.attach_engine(engine)
        await replica.check_health()
        await replica.__del__()
        assert replica.frontend.phase is Phase.STOPPED
        with pytest.raises(RuntimeError, match="stopped"):
            await replica.check_health()

        failing = JaxpagedReplica([])
        engine = FakeAsyncEngine()
        engine.start()
        failing.frontend = Frontend(ServingConfig(served_model_name="m"))
        failing.frontend.attach_engine(engine)
        engine.kill(RuntimeError("device lost"))
        with pytest.raises(RuntimeError, match="failed: device lost"):
            await failing.check_health()
        await failing.__del__()
        assert failing.__del__() is None  # stopped: nothing left for the interpreter's call

    asyncio.run(go())
