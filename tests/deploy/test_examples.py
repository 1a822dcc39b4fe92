"""examples/ run as written, as a user runs them (`python examples/NAME.py`), on the bundled
SmolLM2: each prints what its vLLM original prints, from real generations.

As written, each example loads SmolLM2 and warms up every shape bucket of its engine. The
OpenAI-client example runs in every suite; the offline one (every bucket of a default
engine, ~3 minutes on a loaded 2-core machine; test_llm_e2e generates offline on SmolLM2),
the tensor-parallel (3 simulated devices, ~9 minutes) and swap-space (~2.5 minutes) ones
run with JAXPAGED_TEST_EXAMPLES=1 or JAXPAGED_TEST_FULL=1."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
minutes_long = pytest.mark.skipif(
    "1" not in (os.environ.get("JAXPAGED_TEST_EXAMPLES"), os.environ.get("JAXPAGED_TEST_FULL")),
    reason="this example as written takes minutes; set JAXPAGED_TEST_EXAMPLES=1",
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
LINE = re.compile(r"^Prompt: ('[^']*'), Generated text: (.*)$", re.M)  # reprs of str


def _run(name: str, *args: str, env: dict[str, str] | None = None) -> str:
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})},
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout


def _generations(stdout: str) -> dict[str, str]:
    """prompt -> generated text, from the examples' `print(f"Prompt: {p!r}, ... {t!r}")`."""
    return {ast.literal_eval(p): ast.literal_eval(t) for p, t in LINE.findall(stdout)}


@minutes_long
def test_offline_inference():
    printed = _generations(_run("offline_inference.py"))
    assert list(printed) == [
        "Hello, my name is",
        "The president of the United States is",
        "The capital of France is",
        "The future of AI is",
    ]
    assert any(text.strip() for text in printed.values())  # sampled: one may end at once


@minutes_long
def test_tensor_parallel_on_three_simulated_devices():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=3"}
    printed = _generations(_run("tensor_parallel.py", env=env))
    assert list(printed) == ["Hello, my name is", "The capital of France is"]
    assert any(text.strip() for text in printed.values())  # sampled: one may end at once


@minutes_long
def test_swap_space_swaps():
    stdout = _run("swap_space.py")
    printed = _generations(stdout)
    assert len(printed) == 8 and all(text.strip() for text in printed.values())
    assert int(re.search(r"^preemptions: (\d+)$", stdout, re.M).group(1)) > 0


def test_openai_chat_client_against_jaxpaged_serve():
    # the engine of tests/serving/test_real_cli.py's server (the example's ~30-token prompt
    # and 200 tokens fit in 256): whichever runs second loads the programs from the
    # persistent compile cache
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("jaxpaged")), "serve", "--port", "0",
         "--grpc-port", "0", "--max-model-len", "256", "--num-kv-blocks", "64",
         "--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--enforce-eager"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in server.stderr:
            lines.append(line)
            if "ready: serving" in line or "failed to build" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(600) and server.poll() is None, "".join(lines[-40:])
        port = next(
            m.group(1)
            for line in lines
            if (m := re.search(r"listening: gRPC .*, HTTP [\d.]+:(\d+)", line))
        )
        stdout = _run(
            "openai_chat_client.py", env={"OPENAI_BASE_URL": f"http://127.0.0.1:{port}/v1"}
        )
        reply = re.search(r"^Chat response: (.+)$", stdout, re.M)
        assert reply and reply.group(1).strip(), stdout
        assert re.search(r"^Finish reason: (stop|length)$", stdout, re.M), stdout
        assert "completion_tokens=" in stdout
    finally:
        server.kill()
        server.wait(30)
