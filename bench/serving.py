"""Load generator for a running jaxpaged server (OpenAI HTTP with SSE streaming, or gRPC),
in the manner of ``vllm bench serve``.

    python bench/serving.py --concurrency 16 --num-prompts 64           # fixed concurrency
    python bench/serving.py --request-rate 4 --num-prompts 64           # Poisson arrivals
    python bench/serving.py --sweep 1,4,16,64 --out-prefix bench/serving_sweep
    python bench/serving.py --launch --sweep 1,4,16 ...                 # start/stop a server

Prompts are seeded chat requests (bench/common.py), sent as token ids, greedy with EOS
ignored, so every run of the same seed asks for the same work. Reported: request throughput,
output tokens/s, and mean / p50 / p99 of TTFT (time to first token), TPOT (time per output
token after the first), ITL (gaps between streamed chunks) and E2E latency. ``--sweep`` writes
``PREFIX.csv`` and ``PREFIX.png`` (throughput and latency against concurrency).

vLLM as a peer (bench/vllm_peer.py), with ``--launch``:

    python bench/serving.py --launch --vllm-python VENV/bin/python [--vllm-client] \
        --dtype float32 --max-model-len 1024 --max-num-seqs 16 --concurrency 16

runs the same load against jaxpaged's server and then vLLM's (launched in turn from that
environment, with the same --dtype / --max-model-len / --max-num-seqs), and prints the ratios.
``--vllm-client`` also runs vLLM's own client (``vllm bench serve``: random prompts of
``--vllm-input-len`` tokens, ``--vllm-output-len`` out, EOS ignored) against both servers.

llama.cpp as a peer (bench/llamacpp_peer.py), on the same GGUF file (the bundled one by
default) and the same thread count:

    python bench/serving.py --launch --llama-cpp-server BUILD/bin/llama-server --concurrency 16

runs the same load against jaxpaged's server and then ``llama-server`` (one slot per request
in flight, ``--max-model-len`` tokens of context each), and prints the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import csv
import dataclasses
import json
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

from common import BenchRequest, make_workload, summarize
from llamacpp_peer import check_llama_server, gguf_file, launched_llama_server
from vllm_peer import (
    check_vllm_python,
    launched_vllm_server,
    print_vllm_bench_table,
    run_vllm_bench_serve,
    stop,
)

METRICS = ("ttft", "tpot", "itl", "e2e")


@dataclasses.dataclass(kw_only=True)
class RequestResult:
    ok: bool
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = dataclasses.field(default_factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


# ------------------------------------------------------------------------------ clients
async def _http_request(
    client: Any, url: str, model: str, req: BenchRequest, api_key: str | None
) -> RequestResult:
    body = {
        "model": model,
        "prompt": list(req.prompt_token_ids),
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    t0 = time.perf_counter()
    last = None
    ttft = None
    itls: list[float] = []
    chunks = 0
    usage_tokens = None
    async with client.stream("POST", url, json=body, headers=headers) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")[:200]
            return RequestResult(ok=False, error=f"HTTP {resp.status_code}: {text}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            msg = json.loads(data)
            if msg.get("usage"):
                usage_tokens = msg["usage"].get("completion_tokens")
            if not any(c.get("text") for c in msg.get("choices", ())):
                continue
            now = time.perf_counter()
            chunks += 1
            if ttft is None:
                ttft = now - t0
            else:
                itls.append(now - last)
            last = now
    e2e = time.perf_counter() - t0
    n = usage_tokens if usage_tokens is not None else chunks
    if ttft is None:
        return RequestResult(ok=False, error="no tokens streamed")
    return RequestResult(ok=True, output_tokens=n, ttft=ttft, e2e=e2e, itls=itls)


async def _grpc_request(client: Any, req: BenchRequest) -> RequestResult:
    t0 = time.perf_counter()
    last = None
    ttft = None
    itls: list[float] = []
    n = 0
    async for chunk in client.stream(list(req.prompt_token_ids), max_tokens=req.max_tokens,
                                     temperature=0.0, ignore_eos=True):  # fmt: skip
        if not chunk.token_ids:
            continue
        now = time.perf_counter()
        n += len(chunk.token_ids)
        if ttft is None:
            ttft = now - t0
        else:
            itls.append(now - last)
        last = now
    e2e = time.perf_counter() - t0
    if ttft is None:
        return RequestResult(ok=False, error="no tokens streamed")
    return RequestResult(ok=True, output_tokens=n, ttft=ttft, e2e=e2e, itls=itls)


# --------------------------------------------------------------------------------- load
async def run_load(
    args: argparse.Namespace,
    work: Sequence[BenchRequest],
    *,
    concurrency: int | None,
    request_rate: float | None,
) -> dict[str, Any]:
    """Sends every request of ``work``: at most ``concurrency`` in flight, and (if
    ``request_rate``) starting them at Poisson arrival times. Returns the run's summary."""
    rng = random.Random(args.seed + 1)
    limit = asyncio.Semaphore(concurrency or len(work))
    if args.backend == "http":
        import httpx

        client = httpx.AsyncClient(timeout=httpx.Timeout(None),
                                   limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))  # fmt: skip
        url = f"http://{args.host}:{args.port}/v1/completions"

        async def one(r: BenchRequest) -> RequestResult:
            return await _http_request(client, url, args.served_model_name, r, args.api_key)
    else:
        from jaxpaged.serving.client import AsyncGenerationClient

        client = AsyncGenerationClient(f"{args.host}:{args.grpc_port}", api_key=args.api_key)

        async def one(r: BenchRequest) -> RequestResult:
            return await _grpc_request(client, r)

    async def guarded(r: BenchRequest, start_at: float) -> RequestResult:
        delay = start_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        async with limit:
            try:
                return await one(r)
            except Exception as e:  # a failed request is counted, not fatal
                return RequestResult(ok=False, error=f"{type(e).__name__}: {e}")

    t0 = time.perf_counter()
    starts = []
    at = t0
    for _ in work:
        starts.append(at)
        if request_rate:
            at += rng.expovariate(request_rate)
    try:
        results = await asyncio.gather(*(guarded(r, s) for r, s in zip(work, starts, strict=True)))
    finally:
        await (client.aclose() if args.backend == "http" else client.close())
    duration = time.perf_counter() - t0
    return summarize_run(results, duration, concurrency=concurrency, request_rate=request_rate)


def summarize_run(results: Sequence[RequestResult], duration: float, *, concurrency: int | None,
                  request_rate: float | None) -> dict[str, Any]:  # fmt: skip
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    row: dict[str, Any] = {
        "concurrency": concurrency or 0,
        "request_rate": request_rate or 0.0,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_tok_s": out_tokens / duration,
        "output_tokens": out_tokens,
    }
    values = {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [x for r in ok for x in r.itls],
        "e2e": [r.e2e for r in ok],
    }
    for m in METRICS:
        for k, v in summarize(values[m]).items():
            row[f"{m}_{k}_ms"] = 1e3 * v
    errors = [r.error for r in results if not r.ok]
    if errors:
        row["first_error"] = errors[0]
    return row


def print_row(row: dict[str, Any]) -> None:
    mode = (f"request rate {row['request_rate']:g}/s" if row["request_rate"]
            else f"concurrency {row['concurrency']}")  # fmt: skip
    print(f"== {mode}: {row['completed']} ok, {row['failed']} failed in {row['duration_s']:.1f} s")
    print(f"   request throughput {row['request_throughput']:.2f} req/s, "
          f"output {row['output_tok_s']:.1f} tok/s")  # fmt: skip
    print(f"   {'ms':6s} {'mean':>9s} {'p50':>9s} {'p99':>9s}")
    for m in METRICS:
        print(f"   {m.upper():6s} {row[f'{m}_mean_ms']:9.1f} {row[f'{m}_p50_ms']:9.1f} "
              f"{row[f'{m}_p99_ms']:9.1f}")  # fmt: skip
    if "first_error" in row:
        print(f"   first error: {row['first_error']}")


def write_sweep(rows: Sequence[dict[str, Any]], prefix: str,
                peer: Sequence[dict[str, Any]] | None = None) -> tuple[str, str]:  # fmt: skip
    """``prefix``.csv with every column and ``prefix``.png: output tok/s (left) and TTFT /
    TPOT p50 and p99 (right) against concurrency; a ``peer``'s rows (vLLM's) beside them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    csv_path, png_path = f"{prefix}.csv", f"{prefix}.png"
    every = [*rows, *(peer or ())]
    keys = list(dict.fromkeys(k for r in every for k in r))
    with open(csv_path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(every)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    series = [("jaxpaged", rows, "-")] + ([("vLLM", peer, "--")] if peer else [])
    for name, rs, line in series:
        conc = [r["concurrency"] for r in rs]
        a.plot(conc, [r["output_tok_s"] for r in rs], "o" + line, label=f"{name} output tok/s")
        for m, mark in (("ttft", "o"), ("tpot", "s")):
            for q, dots in (("p50", line), ("p99", ":")):
                b.plot(conc, [r[f"{m}_{q}_ms"] for r in rs], mark + dots,
                       label=f"{name} {m.upper()} {q}")  # fmt: skip
    conc = [r["concurrency"] for r in rows]
    a.set_ylabel("output tokens/s")
    a.set_title("throughput")
    a.legend(fontsize=8)
    b.set_yscale("log")
    b.set_ylabel("ms")
    b.set_title("latency")
    b.legend(fontsize=7)
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_xticks(conc, [str(c) for c in conc])
        ax.minorticks_off()
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return csv_path, png_path


# ------------------------------------------------------------------------------ server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def launched_server(args: argparse.Namespace) -> Iterator[None]:
    """Starts ``python -m jaxpaged.serve`` on free ports, waits for /health, stops it (SIGTERM,
    then SIGKILL) at the end."""
    import httpx

    args.port, args.grpc_port = _free_port(), _free_port()
    cmd = [sys.executable, "-m", "jaxpaged.serve"]
    if args.model:
        cmd.append(args.model)
    cmd += ["--host", args.host, "--port", str(args.port), "--grpc-port", str(args.grpc_port),
            "--log-level", "warning", *_shared_server_args(args), *args.server_args]  # fmt: skip
    if args.served_model_name:
        cmd += ["--served-model-name", args.served_model_name]
    print("launching:", " ".join(cmd), flush=True)
    log = open(args.server_log, "w") if args.server_log else subprocess.DEVNULL  # noqa: SIM115
    env = getattr(args, "env", None)  # extra environment variables of the server
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env=None if env is None else {**os.environ, **env})  # fmt: skip
    try:
        t0 = time.perf_counter()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode} before becoming ready"
                                   + (f" (log: {args.server_log})" if args.server_log else ""))  # fmt: skip
            try:
                if (
                    httpx.get(f"http://{args.host}:{args.port}/health", timeout=2).status_code
                    == 200
                ):
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - t0 > args.launch_timeout:
                raise RuntimeError(f"server not ready after {args.launch_timeout} s")
            time.sleep(0.5)
        print(f"server ready in {time.perf_counter() - t0:.1f} s", flush=True)
        yield
    finally:
        stop(proc)
        if log is not subprocess.DEVNULL:
            log.close()


def _shared_server_args(args: argparse.Namespace) -> list[str]:
    """--dtype, --max-model-len and --max-num-seqs, for whichever server is launched."""
    out = []
    for flag, value in (("--dtype", args.dtype), ("--max-model-len", args.max_model_len),
                        ("--max-num-seqs", args.max_num_seqs)):  # fmt: skip
        if value is not None:
            out += [flag, str(value)]
    return out


@contextlib.contextmanager
def _vllm_target(args: argparse.Namespace, folder: str) -> Iterator[argparse.Namespace]:
    """vLLM's server launched for the same model and limits; ``args`` pointing at it."""
    with launched_vllm_server(args.vllm_python, model=folder, host=args.host,
                              served_model_name=args.served_model_name,
                              server_args=_shared_server_args(args),
                              log_path=args.vllm_log) as port:  # fmt: skip
        target = copy.copy(args)
        target.port = port
        yield target


def _served_name(args: argparse.Namespace) -> str:
    import httpx

    r = httpx.get(f"http://{args.host}:{args.port}/v1/models", timeout=10,
                  headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else {})  # fmt: skip
    r.raise_for_status()
    return r.json()["data"][0]["id"]


# -------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--backend", choices=("http", "grpc"), default="http")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument("--api-key", default=os.environ.get("JAXPAGED_API_KEY"))
    p.add_argument("--model", default=None,
                   help="model whose tokenizer builds the prompts (and that --launch serves)")  # fmt: skip
    p.add_argument("--served-model-name", default=None, help="default: asked from /v1/models")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--max-prompt-words", type=int, default=300)
    p.add_argument("--equal-length", type=int, default=None, metavar="N",
                   help="every request asks for exactly N tokens (starvation check)")  # fmt: skip
    g = p.add_mutually_exclusive_group()
    g.add_argument("--concurrency", type=int, default=None, help="requests in flight (default 16)")
    g.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second")
    g.add_argument("--sweep", default=None, help="comma-separated concurrencies, e.g. 1,4,16,64")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap with --request-rate")
    p.add_argument("--out-prefix", default="serving_sweep", help="--sweep writes PREFIX.csv/.png")
    p.add_argument("--json-out", default=None)
    p.add_argument(
        "--launch", action="store_true", help="start a server on free ports, stop it after"
    )
    p.add_argument("--launch-timeout", type=float, default=900.0)
    p.add_argument("--server-log", default=None, help="--launch: server output goes here")
    p.add_argument("--dtype", default=None, help="--launch: the servers' dtype")
    p.add_argument("--max-model-len", type=int, default=None, help="--launch: the servers' limit")
    p.add_argument("--max-num-seqs", type=int, default=None, help="--launch: the servers' limit")
    p.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="with --launch: also serve the load from vLLM (that environment's Python)")  # fmt: skip
    p.add_argument("--vllm-log", default=None, help="vLLM's server output goes here")
    p.add_argument("--vllm-client", action="store_true",
                   help="also run `vllm bench serve` against each server (needs --vllm-python)")  # fmt: skip
    p.add_argument("--vllm-input-len", type=int, default=256, help="--vllm-client prompt tokens")
    p.add_argument("--vllm-output-len", type=int, default=128, help="--vllm-client output tokens")
    p.add_argument("--llama-cpp-server", default=None, metavar="BIN",
                   help="also run the load against llama.cpp's llama-server BIN (same GGUF)")  # fmt: skip
    p.add_argument("--llama-cpp-threads", type=int, default=os.cpu_count(),
                   help="llama-server's -t (default: every CPU, as jaxpaged uses)")  # fmt: skip
    p.add_argument("--llama-cpp-log", default=None, help="llama-server's output goes here")
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                   help="--launch: everything after this goes to jaxpaged.serve")  # fmt: skip
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.sweep:
        try:
            levels = [int(x) for x in args.sweep.split(",") if x.strip()]
        except ValueError:
            print(f"--sweep: not a list of integers: {args.sweep!r}", file=sys.stderr)
            return 2
        if not levels or min(levels) < 1:
            print("--sweep: concurrencies must be >= 1", file=sys.stderr)
            return 2
    if args.num_prompts < 1:
        print("--num-prompts must be >= 1", file=sys.stderr)
        return 2

    if args.vllm_python and not args.launch:
        print("--vllm-python needs --launch (both servers are launched alike)", file=sys.stderr)
        return 2
    if args.vllm_client and not args.vllm_python:
        print("--vllm-client needs --vllm-python PATH", file=sys.stderr)
        return 2
    llama_model = None
    if args.llama_cpp_server:
        try:
            check_llama_server(args.llama_cpp_server)
            llama_model = gguf_file(args.model)
        except ValueError as e:
            print(e, file=sys.stderr)
            return 2
        if not args.launch or args.backend != "http":
            print("--llama-cpp-server needs --launch and --backend http", file=sys.stderr)
            return 2
    if args.vllm_python:
        if args.backend != "http":
            print("--vllm-python compares over HTTP; leave --backend at http", file=sys.stderr)
            return 2
        try:
            print(f"vLLM {check_vllm_python(args.vllm_python)} from {args.vllm_python}")
        except ValueError as e:
            print(e, file=sys.stderr)
            return 2
        if args.dtype is None:
            args.dtype = "float32"  # the same on both; their own defaults differ

    from jaxpaged.models import load_tokenizer
    from jaxpaged.models.resolve import resolve_model_folder

    folder = str(resolve_model_folder(args.model))
    tokenizer = load_tokenizer(folder)
    lo, hi = (
        (args.equal_length, args.equal_length)
        if args.equal_length
        else (args.min_output, args.max_output)
    )
    work = make_workload(tokenizer, num_prompts=args.num_prompts, seed=args.seed,
                         max_prompt_words=args.max_prompt_words, min_output=lo, max_output=hi)  # fmt: skip
    if args.sweep:
        plan = [(c, None) for c in levels]
    elif args.request_rate:
        plan = [(args.max_concurrency, args.request_rate)]
    else:
        plan = [(args.concurrency or 16, None)]

    rows_by_server: dict[str, list[dict[str, Any]]] = {}
    bench_serve: dict[str, dict[str, Any]] = {}

    def measure(name: str, target: argparse.Namespace) -> None:
        rows = rows_by_server.setdefault(name, [])
        for conc, rate in plan:
            row = asyncio.run(run_load(target, work, concurrency=conc, request_rate=rate))
            row["load_avg"] = os.getloadavg()[0]
            row["server"] = name
            print(f"[{name}]")
            print_row(row)
            rows.append(row)
        if args.vllm_client:
            print(f"[{name}] vllm bench serve ...", flush=True)
            bench_serve[name] = run_vllm_bench_serve(
                args.vllm_python, base_url=f"http://{target.host}:{target.port}",
                model=target.served_model_name, tokenizer=folder,
                num_prompts=args.num_prompts, input_len=args.vllm_input_len,
                output_len=args.vllm_output_len, concurrency=plan[0][0] or 16, seed=args.seed,
            )  # fmt: skip

    server = launched_server(args) if args.launch else contextlib.nullcontext()
    with server:
        if args.backend == "http" and not args.served_model_name:
            args.served_model_name = _served_name(args)
        measure("jaxpaged", args)
    if args.vllm_python:
        with _vllm_target(args, folder) as target:
            measure("vllm", target)
        _print_ratios(rows_by_server, "vllm")
    if llama_model is not None:
        slots = max(c or len(work) for c, _ in plan)
        with launched_llama_server(args.llama_cpp_server, model=llama_model, host=args.host,
                                   parallel=slots, ctx_per_slot=args.max_model_len or 2048,
                                   threads=args.llama_cpp_threads,
                                   log_path=args.llama_cpp_log) as port:  # fmt: skip
            target = copy.copy(args)
            target.port = port
            measure("llama.cpp", target)
        _print_ratios(rows_by_server, "llama.cpp")
    if bench_serve:
        print_vllm_bench_table(bench_serve)
    rows = [r for rs in rows_by_server.values() for r in rs]
    if args.sweep:
        csv_path, png_path = write_sweep(rows_by_server["jaxpaged"], args.out_prefix,
                                         peer=rows_by_server.get("vllm"))  # fmt: skip
        print(f"wrote {csv_path} and {png_path}")
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump({"rows": rows, "vllm_bench_serve": bench_serve} if bench_serve else rows,
                      f, indent=2)  # fmt: skip
    return 1 if any(r["failed"] for r in rows) else 0


def _print_ratios(rows_by_server: dict[str, list[dict[str, Any]]], peer: str) -> None:
    """jaxpaged over ``peer``, load by load: throughput (higher is better) and latencies."""
    keys = (("output tok/s", "output_tok_s"), ("TTFT p50", "ttft_p50_ms"),
            ("TPOT p50", "tpot_p50_ms"), ("ITL p99", "itl_p99_ms"), ("E2E p50", "e2e_p50_ms"))  # fmt: skip
    for ours, theirs in zip(rows_by_server["jaxpaged"], rows_by_server[peer], strict=True):
        parts = [f"{label} {ours[k] / theirs[k]:.2f}x" for label, k in keys if theirs[k]]
        print(f"jaxpaged / {peer} at concurrency {ours['concurrency']}: " + ", ".join(parts))


if __name__ == "__main__":
    raise SystemExit(main())
