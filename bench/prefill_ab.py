"""Prefill stalls under `vllm bench serve`: jaxpaged's server in two or more configurations
(by default the prefill cap of steps with decodes off, and the default cap), each driven in
turn by vLLM's own client at the same load, in alternating rounds, side by side.

    python bench/prefill_ab.py --vllm-python VENV/bin/python [--rounds 2] [--num-prompts 64]
        [--variant NAME="[ENV=VALUE ...] --flag value ..."] ... [--step-log DIR]

Every variant's server is launched once and stays up (idle between its turns); the rounds
alternate A, B, A, B so that both see the same minutes of this shared machine. Printed per
run: output tok/s, TTFT p50/p99, ITL p50/p99 and the ITL p99 / p50 ratio, and the machine's
load average; at the end the medians over rounds and each variant against the first.
(Prefill alone against the matmul peak: bench/prefill_peak.py.) ``--step-log DIR``
has each server write its steps to DIR/NAME.jsonl ($JAXPAGED_STEP_LOG) and prints, per
variant, the step times by kind (decodes only, prefill with decodes, prefill alone) and what
the steps slower than 3x the median decode step carried.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import os
import re
import statistics
import sys
from typing import Any

from vllm_peer import check_vllm_python, run_vllm_bench_serve

from serving import launched_server

KEYS = (("output tok/s", "output_throughput"), ("TTFT p50", "median_ttft_ms"),
        ("TTFT p99", "p99_ttft_ms"), ("ITL p50", "median_itl_ms"), ("ITL p99", "p99_itl_ms"))  # fmt: skip
DEFAULT_VARIANTS = ("uncapped=--max-prefill-tokens-with-decodes 512", "default=")


def _variant(text: str) -> tuple[str, list[str]]:
    name, sep, flags = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--variant wants NAME=FLAGS, got {text!r}")
    return name, flags.split()


def _split_env(flags: list[str]) -> tuple[dict[str, str], list[str]]:
    """Leading ``NAME=VALUE`` words (upper-case names) are the server's environment, e.g.
    ``PYTHONPATH=DIR`` to serve another checkout's code; the rest are its flags."""
    env = {}
    while flags and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", flags[0]):
        key, _, value = flags[0].partition("=")
        env[key] = value
        flags = flags[1:]
    return env, flags


def summarize_steps(path: str) -> str:
    """Step times by kind from a $JAXPAGED_STEP_LOG file, and the slow steps' shapes."""
    import json

    with open(path) as f:
        steps = [json.loads(line) for line in f if line.strip()]
    steps = [s for s in steps if s["seqs"]]
    kinds = {"decode": [s for s in steps if not s["prefill"]],
             "prefill+decode": [s for s in steps if s["prefill"] and s["decodes"]],
             "prefill": [s for s in steps if s["prefill"] and not s["decodes"]]}  # fmt: skip
    out = []
    for kind, group in kinds.items():
        if group:
            ms = sorted(s["ms"] for s in group)
            out.append(f"{kind} {len(ms)} steps p50 {ms[len(ms) // 2]:.0f} "
                       f"p99 {ms[min(len(ms) - 1, int(len(ms) * 0.99))]:.0f} ms")  # fmt: skip
    decode_ms = statistics.median(s["ms"] for s in kinds["decode"] or steps)
    slow = [s for s in steps if s["ms"] > 3 * decode_ms]
    shapes = collections.Counter(
        f"{s['decodes']}d+{s['prefill']}p" + (" gc" if s["gc_ms"] > 0.2 * s["ms"] else "")
        for s in slow
    )
    gc_ms = [s["gc_ms"] for s in steps]
    out.append(step_itl(steps))
    out.append(ttft_split(steps))
    out.append(f"{len(slow)} of {len(steps)} steps > 3x the median decode step "
               f"({decode_ms:.0f} ms): {dict(shapes.most_common(6))}; "
               f"gc {sum(gc_ms):.0f} ms in all, at most {max(gc_ms):.0f} ms")  # fmt: skip
    return "; ".join(out)


def step_itl(steps: list[dict[str, Any]]) -> str:
    """The inter-token latency as the engine makes it: each step's time once per decode it
    carried (what the client would see if every token reached it at its step's end)."""
    itl = sorted(s["ms"] for s in steps for _ in range(s.get("decodes", 0)))
    if not itl:
        return "no decodes"
    p50, p99 = (itl[min(len(itl) - 1, int(len(itl) * q))] for q in (0.5, 0.99))
    return f"engine ITL p50 {p50:.0f} p99 {p99:.0f} ms ({p99 / p50:.1f}x)"


def ttft_split(steps: list[dict[str, Any]]) -> str:
    """The server's time to first token, per request, split into the wait for its first
    chunk and the steps from there to its first token (step-log lines in order)."""
    arrived, started, ttft, wait, chunks = {}, {}, [], [], []
    for i, s in enumerate(steps):
        for rid, w in s.get("waits", {}).items():
            arrived[rid], started[rid] = s["t"] - w, i
        for rid in s.get("first_tokens", []):
            if rid in arrived:
                ttft.append(s["t"] + s["ms"] / 1e3 - arrived[rid])
                wait.append(steps[started[rid]]["t"] - arrived[rid])
                chunks.append(i - started[rid])
    if not ttft:
        return "no per-request lines"
    med = statistics.median
    return (f"server TTFT p50 {med(ttft) * 1e3:.0f} ms = wait p50 {med(wait) * 1e3:.0f} + "
            f"from first chunk p50 {med(map(float.__sub__, ttft, wait)) * 1e3:.0f} "
            f"({med(chunks):.0f} steps)")  # fmt: skip


def plot(results: dict[str, list[dict[str, Any]]], path: str, title: str) -> None:
    """Bars of each variant's TTFT and ITL p50 / p99 (medians over rounds), one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, (what, p50, p99) in zip(
        axes,
        (("TTFT", "median_ttft_ms", "p99_ttft_ms"), ("ITL", "median_itl_ms", "p99_itl_ms")),
        strict=True,
    ):
        xs = range(len(names))
        for off, key, label in ((-0.2, p50, "p50"), (0.2, p99, "p99")):
            vals = [statistics.median(r[key] for r in results[n]) for n in names]
            bars = ax.bar([x + off for x in xs], vals, width=0.4, label=label)
            ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.set_xticks(list(xs), names)
        ax.set_ylabel(f"{what} ms")
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--vllm-python", required=True, metavar="PATH")
    p.add_argument("--model", default=None)
    p.add_argument("--variant", type=_variant, action="append", default=None,
                   help=f"NAME=FLAGS for jaxpaged.serve (default: {DEFAULT_VARIANTS})")  # fmt: skip
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--step-log", default=None, metavar="DIR",
                   help="per-step times of each server in DIR/NAME.jsonl, summarized")  # fmt: skip
    p.add_argument("--plot", default=None, metavar="PNG", help="TTFT and ITL bars per variant")
    args = p.parse_args(argv)
    variants = args.variant or [_variant(v) for v in DEFAULT_VARIANTS]
    print(f"vLLM {check_vllm_python(args.vllm_python)} client from {args.vllm_python}")

    from jaxpaged.models.resolve import resolve_model_folder

    folder = str(resolve_model_folder(args.model))
    results: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in variants}
    with contextlib.ExitStack() as stack:
        targets = {}
        for name, words in variants:
            env, flags = _split_env(words)
            ns = argparse.Namespace(
                model=args.model, host="127.0.0.1", server_log=None, launch_timeout=900.0,
                served_model_name="m", dtype=args.dtype, max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs, server_args=flags,
            )  # fmt: skip
            if args.step_log:
                os.makedirs(args.step_log, exist_ok=True)
                log = os.path.join(args.step_log, f"{name}.jsonl")
                with contextlib.suppress(FileNotFoundError):
                    os.remove(log)
                env["JAXPAGED_STEP_LOG"] = log
            ns.env = env
            stack.enter_context(launched_server(ns))
            targets[name] = copy.copy(ns)
        for rnd in range(args.rounds):
            for name, ns in targets.items():
                load = os.getloadavg()[0]
                r = run_vllm_bench_serve(
                    args.vllm_python, base_url=f"http://{ns.host}:{ns.port}", model="m",
                    tokenizer=folder, num_prompts=args.num_prompts, input_len=args.input_len,
                    output_len=args.output_len, concurrency=args.concurrency, seed=rnd,
                )  # fmt: skip
                r["load_avg"] = (load + os.getloadavg()[0]) / 2
                results[name].append(r)
                figs = ", ".join(f"{label} {r[k]:.1f}" for label, k in KEYS)
                print(f"round {rnd + 1} {name}: {figs}, ITL p99/p50 "
                      f"{r['p99_itl_ms'] / r['median_itl_ms']:.1f}x, load {r['load_avg']:.1f}",
                      flush=True)  # fmt: skip
    if args.plot:
        plot(results, args.plot, f"vllm bench serve: {args.num_prompts} requests, "
             f"{args.input_len} in / {args.output_len} out, {args.concurrency} in flight "
             f"({args.rounds} rounds, medians)")  # fmt: skip
        print(f"wrote {args.plot}")
    if args.step_log:
        for name, _ in variants:
            print(f"steps of {name}: "
                  f"{summarize_steps(os.path.join(args.step_log, name + '.jsonl'))}")  # fmt: skip
    base = variants[0][0]
    for name, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for _, k in KEYS}
        ratio = statistics.median(r["p99_itl_ms"] / r["median_itl_ms"] for r in runs)
        line = ", ".join(f"{label} {med[k]:.1f}" for label, k in KEYS)
        print(f"median {name}: {line}, ITL p99/p50 {ratio:.1f}x")
        if name != base:
            pairs = list(zip(runs, results[base], strict=True))
            vs = ", ".join(
                f"{label} {statistics.median(a[k] / b[k] for a, b in pairs):.2f}x"
                for label, k in KEYS
            )
            print(f"{name} / {base} (median of paired rounds): {vs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
