"""The server process: start-up (health NOT_SERVING while loading), SIGTERM/SIGINT drain with
--shutdown-timeout, exit status; CLI flag errors; the committed gRPC stubs are current."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import httpx
import pytest
from fakes import expected_text, wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxpaged.serving import generation_pb2_grpc as pb_grpc
from jaxpaged.serving.client import GenerationClient, build_request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
_LISTENING = r"listening: gRPC [\d.]+:(\d+)"


class ServeProcess:
    """tests/serving/fake_serve_main.py in a subprocess; collects its log lines."""

    def __init__(self, *flags: str, env: dict[str, str] | None = None) -> None:
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [
                sys.executable,
                os.path.join(HERE, "fake_serve_main.py"),
                "--port",
                "0",
                "--grpc-port",
                "0",
                *flags,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        assert wait_until(lambda: self._find(_LISTENING) or self.proc.poll() is not None, 60)
        self.grpc_port = int(self._find(_LISTENING))
        self.http_port = int(self._find(r"listening: gRPC .*, HTTP [\d.]+:(\d+)"))

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def _find(self, pattern: str) -> str | None:
        for line in list(self.lines):
            m = re.search(pattern, line)
            if m:
                return m.group(1)
        return None

    def wait_ready(self, timeout: float = 60) -> None:
        assert wait_until(lambda: self._find(r"(ready): serving") is not None, timeout), "\n".join(
            self.lines
        )

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def serve_process():
    started: list[ServeProcess] = []

    def make(*flags: str, **env: str) -> ServeProcess:
        p = ServeProcess(*flags, env=env)
        started.append(p)
        return p

    yield make
    for p in started:
        p.kill()


def _health(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return (
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        )


def test_shutdown_timeout_aborts_the_rest(serve_process):
    p = serve_process("--shutdown-timeout", "0.5", FAKE_STEP_DELAY="0.02")
    p.wait_ready()
    with GenerationClient(f"127.0.0.1:{p.grpc_port}") as client:
        chunks = client.stream("abc", max_tokens=240)
        next(chunks)
        t0 = time.monotonic()
        p.proc.send_signal(signal.SIGINT)
        rest = list(chunks)
    assert rest[-1].finish_reason == "abort"
    assert 0.4 < time.monotonic() - t0 < 4.5  # 240 tokens would take ~5 s
    assert p.proc.wait(30) == 0


def test_second_signal_aborts_at_once(serve_process):
    p = serve_process("--shutdown-timeout", "60", FAKE_STEP_DELAY="0.02")
    p.wait_ready()
    with GenerationClient(f"127.0.0.1:{p.grpc_port}") as client:
        chunks = client.stream("abc", max_tokens=240)
        next(chunks)
        p.proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: any("draining" in line for line in p.lines), 10)
        t0 = time.monotonic()
        p.proc.send_signal(signal.SIGTERM)
        rest = list(chunks)
    assert rest[-1].finish_reason == "abort"
    assert time.monotonic() - t0 < 3.5  # 240 tokens would take ~5 s
    assert p.proc.wait(30) == 0


def test_not_serving_while_loading_then_sigterm_lets_in_flight_requests_finish(serve_process):
    """One server (a process start less): NOT_SERVING and 503 while its engine loads, then
    ready; SIGTERM while a stream runs: health turns NOT_SERVING, new requests are refused
    (HTTP 503, gRPC UNAVAILABLE), the stream runs to its end and the process exits 0."""
    p = serve_process("--shutdown-timeout", "30", FAKE_LOAD_DELAY="3", FAKE_STEP_DELAY="0.02")
    assert _health(p.grpc_port) == health_pb2.HealthCheckResponse.NOT_SERVING
    assert httpx.get(f"http://127.0.0.1:{p.http_port}/health", timeout=10).status_code == 503
    with GenerationClient(f"127.0.0.1:{p.grpc_port}") as client:
        with pytest.raises(grpc.RpcError) as e:
            client.generate("a", max_tokens=1)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "loading" in e.value.details()
        p.wait_ready()
        assert _health(p.grpc_port) == health_pb2.HealthCheckResponse.SERVING
        assert client.generate("a", max_tokens=2).text == expected_text([ord("a")], 2)
    log = "\n".join(p.lines)
    assert "KV pool:" in log and "python -m jaxpaged.client --grpc" in log and "curl http://" in log

    with grpc.insecure_channel(f"127.0.0.1:{p.grpc_port}") as ch:
        call = pb_grpc.GenerationStub(ch).Generate(build_request("abc", max_tokens=80), timeout=60)
        first = next(call)
        p.proc.send_signal(signal.SIGTERM)
        assert wait_until(
            lambda: _health(p.grpc_port) == health_pb2.HealthCheckResponse.NOT_SERVING, 10
        )
        r = httpx.post(
            f"http://127.0.0.1:{p.http_port}/v1/completions", json={"prompt": "x"}, timeout=10
        )
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
        with pytest.raises(grpc.RpcError) as e:
            list(pb_grpc.GenerationStub(ch).Generate(build_request("x", max_tokens=2), timeout=10))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        rest = list(call)
    text = "".join(d.text for m in [first, *rest] for d in m.outputs)
    assert text == expected_text([ord(c) for c in "abc"], 80)
    assert rest[-1].outputs[-1].finish_reason == "length"
    assert p.proc.wait(30) == 0
    assert any("received SIGTERM" in line for line in p.lines)


def test_engine_build_failure_exits_1(serve_process):
    p = serve_process(FAKE_LOAD_ERROR="num_kv_blocks: 3 blocks cannot hold one sequence")
    assert p.proc.wait(60) == 1
    assert wait_until(lambda: any("cannot hold one sequence" in line for line in p.lines), 5)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["-tp", "2"], "--tensor-parallel-size 2 exceeds the 1 available device"),
        (["--num-processes", "2"], "coordinator_address"),
        (["--num-processes", "2", "--preemption-mode", "swap"], "preemption_mode='swap'"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--max-queue-len", "0"], "--max-queue-len"),
        (["--port", "70000"], "--port"),
        (["--kv-cache-memory", "lots"], "--kv-cache-memory"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
        (["--preemption-mode", "pause"], "--preemption-mode"),
        (["--chat-template", "/no/such/file"], "--chat-template"),
        (["--reasoning-parser", "gpt"], "--reasoning-parser"),
        (["--tool-call-parser", "xml"], "--tool-call-parser"),
        (["--enable-auto-tool-choice"], "needs --tool-call-parser"),
    ],
)
def test_bad_flags_fail_clearly(flags, message, capsys):
    from jaxpaged.cli.serve import main

    with pytest.raises(SystemExit) as e:
        main(flags)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_parse_size():
    from jaxpaged.cli.serve import parse_size

    assert parse_size("1000") == 1000
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("1.5k") == 1500
    assert parse_size("512MiB") == 512 << 20


def test_generated_stubs_are_current(tmp_path):
    subprocess.run(
        ["bash", os.path.join(ROOT, "serving", "regen_proto.sh"), str(tmp_path)],
        check=True,
        env={**os.environ, "PYTHON": sys.executable},
    )
    for proto in ("generation", "admin"):
        for name in (f"{proto}_pb2.py", f"{proto}_pb2.pyi", f"{proto}_pb2_grpc.py"):
            with open(os.path.join(ROOT, "serving", name)) as a, open(tmp_path / name) as b:
                assert a.read() == b.read(), f"serving/{name} is stale: run `make proto`"


def test_the_server_freezes_the_heap_its_engine_leaves(monkeypatch):
    """Objects from loading and warm-up are moved out of the collector's reach, so a full
    collection while serving does not scan them again."""
    import gc

    from jaxpaged.cli.serve import build_engine, build_parser
    from jaxpaged.engine import LLMEngine

    made = []
    loaded = [[] for _ in range(1000)]  # tracked objects, standing in for the loaded model
    monkeypatch.setattr(LLMEngine, "from_engine_args",
                        classmethod(lambda cls, engine_args: made.append(loaded) or "engine"))  # fmt: skip
    gc.unfreeze()
    try:
        assert build_engine(build_parser().parse_args([])) == "engine" and made
        assert gc.get_freeze_count() >= len(loaded)
    finally:
        gc.unfreeze()
