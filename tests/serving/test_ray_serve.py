"""jaxpaged under Ray Serve (jaxpaged.serving.ray_serve:build_app).

Default suite: build_app's mapping (serve's flags and Ray's options, as ``serve run key=value``
hands them over) becomes the deployment Ray would start, checked by serve's own parser, and a
bad key is refused before Ray starts anything.

With JAXPAGED_TEST_FULL=1: a local Ray cluster runs 2 replicas of a tiny random Llama (the
bundled tokenizer) and the real `openai` client sends 16 concurrent requests through Ray's
proxy; then one replica's actor is killed: requests sent afterwards are all answered and Ray
brings the replica back; then every replica is killed while a stream runs: the stream fails
(never hangs) and a request sent meanwhile is answered by the restarted replicas. Opt-in because it starts a Ray cluster and two engine processes
(70-80 s of both cores here), over the default suite's budget.
"""

from __future__ import annotations

import os
import shutil
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
    deployment = app._bound_deployment
    assert deployment.name == "jaxpaged"
    assert deployment.num_replicas == 2
    assert deployment.ray_actor_options["num_gpus"] == 1
    assert deployment.max_ongoing_requests == 32
    (argv,) = app._bound_deployment.init_args
    assert argv == [
        "--model", "/models/m", "--max-model-len", "4096", "--no-enable-prefix-caching",
        "--served-model-name", "m",
    ]  # fmt: skip
    options, _ = deployment_options(
        {"autoscaling_config": '{"min_replicas": 1, "max_replicas": 4}'}
    )
    assert options == {"autoscaling_config": {"min_replicas": 1, "max_replicas": 4}}
    options, _ = deployment_options({"session_affinity": "true"})
    router = options["request_router_config"]["request_router_class"]
    module, _, name = router.rpartition(".")
    assert hasattr(__import__(module, fromlist=[name]), name)  # this Ray has that router
    assert deployment_options({"session_affinity": False})[0] == {}


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


# ---- a local Ray cluster (JAXPAGED_TEST_FULL=1) -------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_app(tmp_path_factory):
    if not FULL:
        pytest.skip("a Ray cluster and two engine processes: JAXPAGED_TEST_FULL=1")
    import ray
    import transformers

    from jaxpaged.models import default_model_path

    folder = tmp_path_factory.mktemp("tiny")
    bundled = default_model_path()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(bundled, name), folder / name)
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(str(folder))

    port = _free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = build_app({
        "model": str(folder), "served_model_name": "tiny", "num_replicas": 2, "num_cpus": 0,
        "max_model_len": 128, "num_kv_blocks": 64, "max_num_seqs": 8, "enforce_eager": True,
        "health_check_period_s": 1, "health_check_timeout_s": 30, "session_affinity": True,
    })  # fmt: skip
    serve.run(app, name="jaxpaged", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def _replicas() -> list[str]:
    app = serve.status().applications["jaxpaged"]
    return [
        state for d in app.deployments.values() for state, n in d.replica_states.items()
        for _ in range(n)
    ]  # fmt: skip


def _ask(url: str, i: int) -> tuple[str, int]:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    if i % 2:
        stream = client.completions.create(
            model="tiny", prompt=f"Count {i % 4}:", max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        text, used = "", 0
        for chunk in stream:
            text += "".join(c.text for c in chunk.choices)
            used = chunk.usage.completion_tokens if chunk.usage else used
        return text, used
    out = client.completions.create(
        model="tiny", prompt=f"Count {i % 4}:", max_tokens=6, temperature=0,
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


def test_a_session_stays_on_one_replica(ray_app):
    """session_affinity: requests with one x-session-id land on one replica (Ray's
    consistent-hash router), and different sessions spread over both."""
    import httpx

    def replica(session: str) -> str:
        r = httpx.post(
            ray_app + "/v1/completions",
            headers={"x-session-id": session},
            json={"model": "tiny", "prompt": "Hi", "max_tokens": 2, "temperature": 0},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        return r.headers["x-jaxpaged-replica"]

    for session in ("conversation-a", "conversation-b"):
        assert len({replica(session) for _ in range(4)}) == 1, session
    assert len({replica(f"s{i}") for i in range(16)}) == 2


def test_killed_replica_is_replaced_and_requests_go_on(ray_app):
    import ray

    actors = [
        a for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("SERVE_REPLICA::jaxpaged#")
    ]  # fmt: skip
    assert len(actors) == 2
    ray.kill(ray.get_actor(actors[0]["name"], namespace=actors[0]["namespace"]), no_restart=True)
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: _ask(ray_app, i), range(8)))
    assert all(used == 6 for _, used in got)
    deadline = time.monotonic() + 240
    while _replicas() != ["RUNNING", "RUNNING"]:
        assert time.monotonic() < deadline, _replicas()
        time.sleep(1)


def _replica_actors() -> list:
    import ray

    return [
        ray.get_actor(a["name"], namespace=a["namespace"])
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("SERVE_REPLICA::jaxpaged#")
    ]  # fmt: skip


def test_stream_cut_by_dead_replicas_fails_and_new_requests_wait_for_new_ones(ray_app):
    """Every replica killed while a stream runs: the stream ends with an error (no hang), and
    a request sent meanwhile is answered once Ray has started replicas again."""
    import openai
    import ray

    deadline = time.monotonic() + 240
    while _replicas() != ["RUNNING", "RUNNING"]:  # after the previous test's replacement
        assert time.monotonic() < deadline, _replicas()
        time.sleep(1)
    client = openai.OpenAI(base_url=ray_app + "/v1", api_key="x", max_retries=0, timeout=120)
    stream = client.completions.create(
        model="tiny", prompt="Go:", max_tokens=120, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = iter(stream)
    next(chunks)  # streaming has started
    start = time.monotonic()
    for actor in _replica_actors():
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
