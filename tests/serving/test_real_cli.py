"""`python -m jaxpaged.serve` on the bundled SmolLM2 as a real process: start-up log, the
`python -m jaxpaged.client` CLI and HTTP agree, --api-key, and SIGTERM drains an in-flight
stream to its end and exits 0."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

import httpx
import pytest
from fakes import wait_until

from jaxpaged.serving.client import GenerationClient

pytestmark = pytest.mark.slow

KEY = "test-key"


class RealServe:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jaxpaged.serve", "--port", "0", "--grpc-port", "0",
             "--max-model-len", "256", "--num-kv-blocks", "64", "--max-num-seqs", "4",
             "--max-num-batched-tokens", "32", "--enforce-eager", "--shutdown-timeout", "120",
             "--api-key", KEY],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "JAXPAGED_API_KEY": ""},
        )  # fmt: skip
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def find(self, pattern: str) -> str | None:
        for line in list(self.lines):
            m = re.search(pattern, line)
            if m:
                return m.group(1)
        return None


@pytest.fixture(scope="module")
def served():
    s = RealServe()
    ok = wait_until(lambda: s.find(r"(ready): serving") or s.proc.poll() is not None, 400, 0.2)
    if not ok or s.proc.poll() is not None:
        s.proc.kill()
        pytest.fail("server did not start:\n" + "\n".join(s.lines[-40:]))
    s.grpc_port = int(s.find(r"listening: gRPC [\d.]+:(\d+)"))
    s.http_port = int(s.find(r"listening: gRPC .*, HTTP [\d.]+:(\d+)"))
    yield s
    if s.proc.poll() is None:
        s.proc.kill()
        s.proc.wait(30)


def test_startup_log_and_clients_agree(served):
    log = "\n".join(served.lines)
    assert "KV pool: 64 blocks x 16 tokens" in log
    assert "concurrent sequences of max_model_len 256" in log
    assert f"python -m jaxpaged.client --grpc 127.0.0.1:{served.grpc_port}" in log
    assert f"curl http://127.0.0.1:{served.http_port}/v1/chat/completions" in log
    assert KEY not in log  # the example names $JAXPAGED_API_KEY, never the key

    question = "What is the capital of France?"
    out = subprocess.run(
        [sys.executable, "-m", "jaxpaged.client", "--grpc", f"127.0.0.1:{served.grpc_port}",
         "--max-tokens", "6", "--api-key", KEY, question],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "[finish_reason:" in out.stderr
    r = httpx.post(
        f"http://127.0.0.1:{served.http_port}/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={
            "messages": [{"role": "user", "content": question}],
            "max_tokens": 6,
            "temperature": 0,
        },
        timeout=300,
    )
    assert r.status_code == 200, r.text
    assert out.stdout.rstrip("\n") == r.json()["choices"][0]["message"]["content"]

    bad = subprocess.run(
        [sys.executable, "-m", "jaxpaged.client", "--grpc", f"127.0.0.1:{served.grpc_port}", "hi"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "JAXPAGED_API_KEY": ""},
    )  # fmt: skip
    assert bad.returncode == 1 and "UNAUTHENTICATED" in bad.stderr


def test_sigterm_drains_in_flight_stream(served):
    with GenerationClient(f"127.0.0.1:{served.grpc_port}", api_key=KEY) as client:
        chunks = client.stream(
            "Write a poem about the sea.", max_tokens=12, temperature=0, ignore_eos=True
        )
        first = next(chunks)
        served.proc.send_signal(signal.SIGTERM)
        rest = list(chunks)
    assert sum(len(c.token_ids) for c in [first, *rest]) == 12
    assert rest[-1].finish_reason == "length"
    assert served.proc.wait(120) == 0
    assert any("received SIGTERM" in line for line in served.lines)
