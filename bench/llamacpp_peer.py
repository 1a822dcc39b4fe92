"""llama.cpp as a benchmark peer on the same GGUF file (``--llama-cpp-server BIN``).

llama.cpp is never a dependency: BIN is a ``llama-server`` binary built apart
(``../shared/anchors/build_llamacpp.sh`` builds ``llama-server`` and ``llama-bench`` from the
llama-cpp-python source distribution, which vendors llama.cpp). ``llama-bench`` is taken from
BIN's folder. Both run with the thread count jaxpaged has (``--llama-cpp-threads``, default
every CPU) and from a temporary folder, never a checkout's root.

- ``gguf_file``: the GGUF file a model name stands for (the bundled SmolLM2's by default).
- ``launched_llama_server``: ``llama-server`` on a free port with ``parallel`` slots, for
  bench/serving.py's load (its OpenAI ``/v1/completions`` takes token-id prompts and
  ``ignore_eos``) and for throughput.py's offline workload.
- ``run_llama_offline``: a workload's token-id prompts through that server, ``parallel`` in
  flight, greedy, EOS ignored; the tokens each request produced and the wall time.
- ``llama_bench``: ``llama-bench``'s prompt (pp) and generation (tg, batch 1) tok/s.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shlex
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from common import BenchRequest
from vllm_peer import free_port, stop, wait_healthy

__all__ = [
    "LlamaRun",
    "check_llama_server",
    "gguf_file",
    "launched_llama_server",
    "llama_bench",
    "run_llama_offline",
]


def check_llama_server(path: str) -> Path:
    """``path`` as an executable ``llama-server``; ValueError naming the problem if not."""
    p = Path(path).expanduser().resolve()
    if not p.is_file() or not os.access(p, os.X_OK):
        raise ValueError(f"--llama-cpp-server: {path!r} is not an executable file")
    return p


def gguf_file(model: str | None) -> str:
    """The GGUF file of ``model``: the bundled SmolLM2's when None, else a path ending in
    .gguf; ValueError for anything else (llama.cpp reads only GGUF)."""
    if model is None:
        from jaxpaged.models.bundled import bundled_gguf_path

        return str(bundled_gguf_path())
    if not str(model).endswith(".gguf") or not Path(model).is_file():
        raise ValueError(f"llama.cpp needs a local .gguf file as --model, got {model!r}")
    return str(model)


def _env(binary: Path) -> dict[str, str]:
    lib = str(binary.parent)  # the build's shared libraries sit beside its binaries
    old = os.environ.get("LD_LIBRARY_PATH")
    return {**os.environ, "LD_LIBRARY_PATH": f"{lib}:{old}" if old else lib}


@contextlib.contextmanager
def launched_llama_server(
    binary: str,
    *,
    model: str,
    host: str,
    parallel: int,
    ctx_per_slot: int,
    threads: int,
    log_path: str | None = None,
    timeout: float = 600.0,
) -> Iterator[int]:
    """``llama-server`` for the GGUF ``model`` on a free port (yielded) with ``parallel``
    slots of ``ctx_per_slot`` tokens each (continuous batching), until the block ends."""
    exe = check_llama_server(binary)
    port = free_port()
    cmd = [str(exe), "-m", model, "--host", host, "--port", str(port), "-np", str(parallel),
           "-c", str(ctx_per_slot * parallel), "-t", str(threads), "-tb", str(threads),
           "--no-webui"]  # fmt: skip
    print("launching:", shlex.join(cmd), flush=True)
    with open(log_path or os.devnull, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(exe),
                                cwd=tempfile.gettempdir())  # fmt: skip
        try:
            took = wait_healthy(proc, f"http://{host}:{port}/health", timeout, "llama-server")
            print(f"llama-server ready in {took:.1f} s", flush=True)
            yield port
        finally:
            stop(proc)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaRun:
    token_counts: list[int]  # per request, tokens llama.cpp produced
    seconds: float  # first request sent to last response


def run_llama_offline(
    port: int, host: str, work: Sequence[BenchRequest], *, parallel: int
) -> LlamaRun:
    """Every request of ``work`` (token-id prompt, ``max_tokens``, greedy, EOS ignored)
    through the server's native ``/completion``, ``parallel`` in flight."""
    import httpx

    async def main() -> LlamaRun:
        limit = asyncio.Semaphore(parallel)
        async with httpx.AsyncClient(timeout=httpx.Timeout(None)) as client:

            async def one(r: BenchRequest) -> int:
                body = {"prompt": list(r.prompt_token_ids), "n_predict": r.max_tokens,
                        "temperature": 0.0, "ignore_eos": True, "cache_prompt": False}  # fmt: skip
                async with limit:
                    resp = await client.post(f"http://{host}:{port}/completion", json=body)
                resp.raise_for_status()
                return int(resp.json()["tokens_predicted"])

            t0 = time.perf_counter()
            counts = await asyncio.gather(*(one(r) for r in work))
            return LlamaRun(token_counts=list(counts), seconds=time.perf_counter() - t0)

    return asyncio.run(main())


def llama_bench(
    server_binary: str, *, model: str, threads: int, prompt: int, gen: int, repeats: int = 3
) -> dict[str, float]:
    """``llama-bench`` (beside ``server_binary``) on ``model``: {"pp": prompt tok/s over
    ``prompt`` tokens, "tg": batch-1 generation tok/s over ``gen`` tokens}, each the mean of
    ``repeats`` runs as llama-bench reports it."""
    exe = check_llama_server(server_binary).parent / "llama-bench"
    if not exe.is_file():
        raise ValueError(f"no llama-bench beside {server_binary}")
    cmd = [str(exe), "-m", model, "-t", str(threads), "-p", str(prompt), "-n", str(gen),
           "-r", str(repeats), "-o", "json"]  # fmt: skip
    print("running:", shlex.join(cmd), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, env=_env(exe),
                          cwd=tempfile.gettempdir(), timeout=1800)  # fmt: skip
    out = {}
    for test in json.loads(done.stdout):
        kind = "pp" if test.get("n_prompt", 0) and not test.get("n_gen", 0) else "tg"
        out[kind] = float(test["avg_ts"])
    return out
