"""Offline throughput: one workload through jaxpaged and Hugging Face transformers, side by side.

    python bench/throughput.py [--model M] [--dtype float32] [--num-prompts 32]
        [--batch-size 8] [--seed 0] [--systems jaxpaged,hf-static,hf-cb] [--jsonl FILE]
        [--rounds 1] [--vllm-python VENV/bin/python] [--prefill-lengths 256 1024]

Systems, all greedy, EOS ignored, the same token ids:
  jaxpaged   LLM.generate (continuous batching over the paged KV pool)
  vllm       vLLM's LLM.generate, from the environment of --vllm-python PATH (bench/vllm_peer.py;
             added to the systems when given): ratios against it, and its greedy tokens
             compared with jaxpaged's (the first divergence of each request)
  hf-static  transformers model.generate() over static, left-padded batches of --batch-size;
             each batch runs to its longest request, only the requested tokens count as useful
  hf-cb      transformers' own continuous batching (init_continuous_batching, paged attention)
             with per-request max_new_tokens
  llama.cpp  llama.cpp's llama-server (--llama-cpp-server BIN, bench/llamacpp_peer.py; added
             to the systems when given) on the same GGUF file (the bundled one by default),
             one slot per sequence jaxpaged may run (up to --max-num-seqs), the same threads;
             then llama-bench's batch-1 generation (tg) beside jaxpaged's pure-decode steps
             at batch 1, in one run. With it jaxpaged keeps the GGUF's own quantized weights
             (as --keep-gguf), as llama.cpp does

Each system must produce exactly the requested number of tokens per request (else the run
fails). Useful output tokens/s excludes model loading and jaxpaged's warm-up (compilation),
which is reported on its own. ``--rounds N`` runs the systems in turn N times (jaxpaged's
prefix cache reset before each round) and quotes the median of the per-round ratios: this
machine's speed drifts over minutes, for every system alike. With jaxpaged in --systems it
also times pure-decode steps at batch 32 inside the engine and prints them next to this
machine's roofline, in --decode-rounds rounds with the peaks measured right after each
round's steps (the ratio quoted is the median of the rounds').

``--prefill-lengths L ...`` then prefills, for each L, ``--prefill-repeats`` fresh random
L-token prompts alone (``max_tokens=1``) and prints the time to the first token against the
matmul peak measured before and after (useful FLOPs: roofline.prefill_flops). A prompt longer
than the step budget (``--max-num-batched-tokens``) is prefilled in chunks, one step each:
the figure is what a request sees, chunking included.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from common import BenchRequest, load_jsonl_workload, make_workload
from llamacpp_peer import check_llama_server, gguf_file, llama_bench
from roofline import MachinePeaks, decode_step_cost, measure_peaks, param_count, prefill_flops
from throughput_peers import (
    SystemResult,
    check_counts,
    run_hf_cb,
    run_hf_static,
    run_llama_cpp,
    run_vllm,
)
from vllm_peer import check_vllm_python, compare_greedy, describe_agreement

SYSTEMS = ("jaxpaged", "hf-static", "hf-cb", "vllm", "llama.cpp")
PEERS = ("hf-static", "hf-cb", "vllm", "llama.cpp")
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def build_jaxpaged(args: argparse.Namespace) -> tuple[Any, float]:
    """The LLM (warmed up unless --enforce-eager) and its load time, warm-up excluded."""
    from jaxpaged import LLM
    from jaxpaged.engine import process_owner_args

    t0 = time.perf_counter()
    llm = LLM(
        args.model,
        dtype=None if args.keep_gguf else args.dtype,  # None: a GGUF's weights kept quantized
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager,
        show_progress=False,
        **process_owner_args(),  # measured as served: malloc tuned, compiled programs cached
    )
    return llm, time.perf_counter() - t0 - llm.engine.warmup_seconds


def run_jaxpaged(llm: Any, load_seconds: float, work: list[BenchRequest]) -> SystemResult:
    from jaxpaged import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
              for r in work]  # fmt: skip
    t0 = time.perf_counter()
    outs = llm.generate([list(r.prompt_token_ids) for r in work], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    produced = [len(o.outputs[0].token_ids) for o in outs]
    check_counts("jaxpaged", produced, work)
    m = llm.get_metrics()
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs
            if o.metrics is not None and o.metrics.first_token_time is not None]  # fmt: skip
    return SystemResult(
        system="jaxpaged",
        num_requests=len(work),
        useful_tokens=sum(produced),
        generated_tokens=sum(produced),
        seconds=seconds,
        load_seconds=load_seconds,
        warmup_seconds=llm.engine.warmup_seconds,
        extra={
            "warmup_programs": llm.engine.warmup_programs,
            "compilations_after_warmup": m["num_compilations_after_warmup"],
            "kv_cache_waste": m["kv_cache_waste"],
            "num_preemptions": m["num_preemptions"],
            "mean_ttft_s": sum(ttft) / len(ttft) if ttft else None,
        },
        token_ids=[list(o.outputs[0].token_ids) for o in outs],
    )


# --------------------------------------------------------------------------- transformers
def _batch1_report(llm: Any, work: Sequence[BenchRequest], args: argparse.Namespace) -> dict:
    """Batch-1 decode: llama-bench's tg figure and jaxpaged's pure-decode steps at batch 1,
    in alternating rounds (--decode-rounds), medians compared."""
    from step_breakdown import time_decode_steps

    model = gguf_file(args.model)
    ours: list[float] = []
    theirs: list[float] = []
    for _ in range(args.decode_rounds):
        (timing,) = time_decode_steps(llm, [work[0].prompt_token_ids], batch=1,
                                      steps=args.llama_bench_gen // 4)  # fmt: skip
        ours.append(1.0 / timing.median)
        theirs.append(llama_bench(args.llama_cpp_server, model=model,
                                  threads=args.llama_cpp_threads, prompt=0,
                                  gen=args.llama_bench_gen, repeats=1)["tg"])  # fmt: skip
    a, b = statistics.median(ours), statistics.median(theirs)
    print(f"batch-1 decode ({args.decode_rounds} alternating rounds, medians): jaxpaged "
          f"{a:.1f} tok/s ({', '.join(f'{x:.1f}' for x in ours)}), llama.cpp llama-bench "
          f"tg{args.llama_bench_gen} {b:.1f} tok/s ({', '.join(f'{x:.1f}' for x in theirs)}): "
          f"{a / b:.2f}x", flush=True)  # fmt: skip
    pp = llama_bench(args.llama_cpp_server, model=model, threads=args.llama_cpp_threads,
                     prompt=256, gen=0, repeats=3)["pp"]  # fmt: skip
    print(f"llama.cpp llama-bench pp256: {pp:.1f} tok/s (jaxpaged's: --prefill-lengths 256)")
    return {"jaxpaged_tok_s": ours, "llama_bench_tg_tok_s": theirs, "ratio": a / b,
            "llama_bench_pp256_tok_s": pp}  # fmt: skip


# ---------------------------------------------------------------------------------- main
def _decode_step_report(
    llm: Any, work: Sequence[BenchRequest], args: argparse.Namespace
) -> dict[str, Any]:
    """Times pure-decode steps at ``--decode-batch`` sequences against the roofline, in
    ``--decode-rounds`` rounds, measuring the machine's peaks right after each round's steps:
    this VM's speed drifts by 15-30 % over minutes, so each round's ratio compares the step
    with the machine as it was then; the reported ratio is their median."""
    from step_breakdown import time_decode_steps

    batch = min(args.decode_batch, args.max_num_seqs)
    peaks: list[MachinePeaks] = []

    def measure() -> None:
        peaks.append(measure_peaks(matmul_n=256, bandwidth_mib=16, repeats=2) if args.peaks_small
                     else measure_peaks(dtype="float32"))  # fmt: skip

    timings = time_decode_steps(llm, [r.prompt_token_ids for r in work], batch=batch,
                                steps=args.decode_steps, rounds=args.decode_rounds,
                                after_round=measure)  # fmt: skip
    cfg = llm.engine.model_config
    rounds: list[dict[str, Any]] = []
    print(f"decode step at batch {batch} ({len(timings)} rounds of {args.decode_steps} "
          "engine.step(), the machine's peaks measured after each):")  # fmt: skip
    for i, (timing, pk) in enumerate(zip(timings, peaks, strict=True), 1):
        # (with --keep-gguf the weights stream fewer bytes than this float dtype's)
        cost = decode_step_cost(cfg, timing.context_lens, dtype_bytes=_DTYPE_BYTES[args.dtype])
        r = {
            "median_s": timing.median,
            "step_seconds": timing.step_seconds,
            "mean_context": sum(timing.context_lens) / batch,
            "roofline_s": cost.roofline_seconds(pk),
            "bound": cost.bound(pk),
            "flops": cost.flops,
            "bytes": cost.bytes,
            "peaks": dataclasses.asdict(pk),
            "serial_s": cost.serial_seconds(pk),
        }
        r["ratio"] = r["median_s"] / r["roofline_s"]
        r["serial_ratio"] = r["median_s"] / r["serial_s"]
        rounds.append(r)
        print(f"  round {i}: measured {r['median_s'] * 1e3:.1f} ms (median, mean context "
              f"{r['mean_context']:.0f} tokens); roofline {r['roofline_s'] * 1e3:.1f} ms "
              f"({r['bound']}-bound): {cost.bytes / 1e6:.0f} MB (weights "
              f"{cost.weight_bytes / 1e6:.0f} + KV {cost.kv_bytes / 1e6:.0f}) / "
              f"{pk.mem_bandwidth / 1e9:.1f} GB/s = {cost.bytes / pk.mem_bandwidth * 1e3:.1f} ms; "
              f"{cost.flops / 1e9:.2f} GFLOP / {pk.matmul_flops / 1e9:.0f} GFLOP/s = "
              f"{cost.flops / pk.matmul_flops * 1e3:.1f} ms; {r['ratio']:.2f}x; matmuls then "
              f"attention {r['serial_s'] * 1e3:.1f} ms: {r['serial_ratio']:.2f}x")  # fmt: skip

    def median_of_rounds(key: str, label: str) -> float:
        values = [r[key] for r in rounds]
        print(f"  measured / {label} = {statistics.median(values):.2f}x (median of rounds: "
              f"{', '.join(f'{x:.2f}x' for x in values)})")  # fmt: skip
        return statistics.median(values)

    ratio = median_of_rounds("ratio", "roofline")
    serial_ratio = median_of_rounds(
        "serial_ratio", "(matmuls, then attention: the floor when they run one after the other)"
    )
    middle = sorted(rounds, key=lambda r: r["ratio"])[(len(rounds) - 1) // 2]
    return {
        "batch": batch,
        "median_s": middle["median_s"],
        "roofline_s": middle["roofline_s"],
        "ratio": ratio,
        "serial_ratio": serial_ratio,
        "rounds": rounds,
    }


def time_prefills(llm: Any, prompt_len: int, repeats: int, seed: int) -> list[float]:
    """Seconds from add_request to the first token of ``repeats`` fresh random prompts."""
    import numpy as np

    from jaxpaged import SamplingParams

    engine = llm.engine
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for i in range(repeats):
        prompt = rng.integers(100, vocab - 100, prompt_len).tolist()  # no prefix-cache hits
        engine.add_request(f"p{prompt_len}-{i}-{seed}", prompt, params)
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        times.append(time.perf_counter() - t0)
    return times


def _prefill_report(llm: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each of ``--prefill-lengths`` prefilled alone against the matmul peak (the larger of
    the peaks measured before and after: this VM's speed drifts)."""

    def peak() -> float:
        if args.peaks_small:
            return measure_peaks(matmul_n=256, bandwidth_mib=16, repeats=2).matmul_flops
        return measure_peaks(matmul_n=2048, repeats=3).matmul_flops

    cfg = llm.engine.model_config
    budget = llm.engine.scheduler_config.max_num_batched_tokens
    peak_before = peak()
    time_prefills(llm, min(args.prefill_lengths), 1, seed=99)  # first-use costs out
    timed = [(n, time_prefills(llm, n, args.prefill_repeats, seed=n)) for n in args.prefill_lengths]
    peak_after = peak()
    top = max(peak_before, peak_after)
    print(f"prefill alone: {cfg.num_layers} layers, {param_count(cfg)['total'] / 1e6:.0f}M "
          f"parameters, {args.dtype}; step budget {budget} tokens; matmul peak "
          f"{peak_before / 1e9:.0f} GFLOP/s before, {peak_after / 1e9:.0f} after")  # fmt: skip
    print("| prompt | steps | time ms (median, range) | tok/s | GFLOP per token | GFLOP/s "
          "| share of the matmul peak |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    rows = []
    for length, times in timed:
        t = statistics.median(times)
        flops = prefill_flops(cfg, length)
        row = {"prompt_len": length, "steps": -(-length // budget), "median_s": t,
               "seconds": times, "flops": flops, "peak_flops": top, "share": flops / t / top}  # fmt: skip
        rows.append(row)
        print(f"| {length} | {row['steps']} | {t * 1e3:.0f} ({min(times) * 1e3:.0f}-"
              f"{max(times) * 1e3:.0f}) | {length / t:.0f} | {flops / length / 1e9:.3f} | "
              f"{flops / t / 1e9:.1f} | {row['share']:.0%} |")  # fmt: skip
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model", default=None, help="HF folder / hub id / .gguf (default: bundled SmolLM2)"
    )
    p.add_argument("--dtype", default="float32", choices=sorted(_DTYPE_BYTES))
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8, help="hf-static batch size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--max-prompt-words", type=int, default=300)
    p.add_argument("--systems", default="jaxpaged,hf-static,hf-cb",
                   help=f"subset of {','.join(SYSTEMS)}")  # fmt: skip
    p.add_argument("--jsonl", default=None, help="prompts from a JSONL file instead")
    p.add_argument("--max-model-len", type=int, default=None, help="jaxpaged (default: model's)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="jaxpaged")
    p.add_argument(
        "--decode-batch", type=int, default=32, help="decode step timing batch (0 = skip)"
    )
    p.add_argument("--decode-steps", type=int, default=16, help="decode steps per round")
    p.add_argument("--decode-rounds", type=int, default=5,
                   help="decode step timing rounds, each with its own peak measurement")  # fmt: skip
    p.add_argument("--prefill-lengths", type=int, nargs="+", default=[], metavar="L",
                   help="also time L-token prompts prefilled alone against the matmul peak")  # fmt: skip
    p.add_argument("--prefill-repeats", type=int, default=5, help="prompts per prefill length")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="jaxpaged's step token budget (default: the engine's)")  # fmt: skip
    p.add_argument("--torch-threads", type=int, default=None, help="torch.set_num_threads for HF")
    p.add_argument("--enforce-eager", action="store_true", help="jaxpaged: no warm-up (smoke)")
    p.add_argument("--hf-cb-warmup", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--peaks-small", action="store_true", help="quick, rough peak measurement")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the systems in turn this many times; ratios are per-round medians")  # fmt: skip
    p.add_argument("--json-out", default=None, help="write all results as JSON here")
    p.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="the Python of a vLLM environment: adds vLLM to the systems")  # fmt: skip
    p.add_argument("--vllm-log", default=None, help="vLLM's output goes here")
    p.add_argument("--keep-gguf", action="store_true",
                   help="jaxpaged keeps a GGUF model's quantized weights (the peers read "
                        "--dtype's float expansion)")  # fmt: skip
    p.add_argument(
        "--llama-cpp-server",
        default=None,
        metavar="BIN",
        help="add llama.cpp (llama-server BIN, llama-bench beside it) as a system",
    )
    p.add_argument("--llama-cpp-threads", type=int, default=os.cpu_count(),
                   help="llama.cpp's -t (default: every CPU, as jaxpaged uses)")  # fmt: skip
    p.add_argument("--llama-cpp-log", default=None, help="llama-server's output goes here")
    p.add_argument(
        "--llama-bench-gen",
        type=int,
        default=128,
        help="tokens of llama-bench's tg run (jaxpaged times a quarter as many steps)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if args.vllm_python and "vllm" not in systems:
        systems.append("vllm")
    if args.llama_cpp_server and "llama.cpp" not in systems:
        systems.append("llama.cpp")
    if "llama.cpp" in systems:
        if not args.llama_cpp_server:
            print("--systems llama.cpp needs --llama-cpp-server BIN", file=sys.stderr)
            return 2
        try:
            check_llama_server(args.llama_cpp_server)
            gguf_file(args.model)
        except ValueError as e:
            print(e, file=sys.stderr)
            return 2
        args.keep_gguf = True  # the same weights as llama.cpp's
    if "vllm" in systems and not args.vllm_python:
        print("--systems vllm needs --vllm-python PATH (a vLLM environment's Python)",
              file=sys.stderr)  # fmt: skip
        return 2
    unknown = set(systems) - set(SYSTEMS)
    if unknown or not systems:
        print(
            f"--systems: unknown {sorted(unknown)}; choose from {','.join(SYSTEMS)}",
            file=sys.stderr,
        )
        return 2
    if min(args.num_prompts, args.batch_size, args.rounds, args.decode_rounds) < 1:
        print("--num-prompts, --batch-size, --rounds and --decode-rounds must be >= 1",
              file=sys.stderr)  # fmt: skip
        return 2

    if args.prefill_lengths and "jaxpaged" not in systems:
        print("--prefill-lengths times jaxpaged: add it to --systems", file=sys.stderr)
        return 2
    if args.prefill_lengths and (
        min(args.prefill_lengths) < 1
        or args.prefill_repeats < 1
        or (args.max_model_len and max(args.prefill_lengths) >= args.max_model_len)
    ):
        print("--prefill-lengths must be >= 1 and below --max-model-len, --prefill-repeats >= 1",
              file=sys.stderr)  # fmt: skip
        return 2

    if args.vllm_python:
        try:
            print(f"vLLM {check_vllm_python(args.vllm_python)} from {args.vllm_python}")
        except ValueError as e:
            print(e, file=sys.stderr)
            return 2

    from jaxpaged.models import load_tokenizer
    from jaxpaged.models.resolve import resolve_model_folder

    folder = resolve_model_folder(args.model)
    tokenizer = load_tokenizer(folder)
    if args.jsonl:
        work = load_jsonl_workload(args.jsonl, tokenizer, seed=args.seed,
                                   min_output=args.min_output, max_output=args.max_output)  # fmt: skip
    else:
        work = make_workload(tokenizer, num_prompts=args.num_prompts, seed=args.seed,
                             max_prompt_words=args.max_prompt_words,
                             min_output=args.min_output, max_output=args.max_output)  # fmt: skip
    plens = [len(r.prompt_token_ids) for r in work]
    print(f"workload: {len(work)} requests, prompt tokens {min(plens)}..{max(plens)} "
          f"(total {sum(plens)}), output tokens {min(r.max_tokens for r in work)}.."
          f"{max(r.max_tokens for r in work)} (total {sum(r.max_tokens for r in work)}), "
          f"dtype {args.dtype}{' (jaxpaged: the GGUF kept)' if args.keep_gguf else ''}, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip

    if args.torch_threads and any(s.startswith("hf") for s in systems):
        import torch

        torch.set_num_threads(args.torch_threads)
    rounds: list[dict[str, SystemResult]] = []
    report: dict[str, Any] = {"args": vars(args), "load_avg_start": os.getloadavg()}
    llm = None
    for rnd in range(args.rounds):
        results: dict[str, SystemResult] = {}
        for s in systems:
            print(f"running {s} (round {rnd + 1} of {args.rounds}) ...", flush=True)
            if s == "jaxpaged":
                if llm is None:
                    llm, jax_load_s = build_jaxpaged(args)
                llm.reset_prefix_cache()  # a later round must not reuse the last one's prompts
                results[s] = run_jaxpaged(llm, jax_load_s, work)
            elif s == "vllm":
                try:
                    results[s] = run_vllm(args, work, folder)
                except RuntimeError as e:  # a peer's failure must not lose the others' figures
                    print(f"  vllm: {e}", flush=True)
                    continue
            elif s == "llama.cpp":
                try:
                    results[s] = run_llama_cpp(args, work)
                except RuntimeError as e:  # a peer's failure must not lose the others' figures
                    print(f"  llama.cpp: {e}", flush=True)
                    continue
            elif s == "hf-static":
                results[s] = run_hf_static(args, work, folder, tokenizer)
            else:
                results[s] = run_hf_cb(args, work, folder, tokenizer)
            r = results[s]
            print(f"  {s}: {r.useful_tokens} useful tokens in {r.seconds:.1f} s = "
                  f"{r.tok_per_s:.1f} tok/s", flush=True)  # fmt: skip
        rounds.append(results)

    print()
    print(f"{'system':12s} {'round':>5s} {'requests':>8s} {'useful tok':>10s} {'generated':>10s} "
          f"{'seconds':>8s} {'useful tok/s':>12s} {'load s':>7s} {'warm-up s':>9s}")  # fmt: skip
    for s in systems:
        for rnd, results in enumerate(rounds):
            if s not in results:
                continue
            r = results[s]
            print(f"{r.system:12s} {rnd + 1:5d} {r.num_requests:8d} {r.useful_tokens:10d} "
                  f"{r.generated_tokens:10d} {r.seconds:8.1f} {r.tok_per_s:12.1f} "
                  f"{r.load_seconds:7.1f} {r.warmup_seconds:9.1f}")  # fmt: skip
    results = rounds[-1]
    if "jaxpaged" in results:
        e = results["jaxpaged"].extra
        print(f"jaxpaged warm-up: {results['jaxpaged'].warmup_seconds:.1f} s for "
              f"{e['warmup_programs']} programs; compilations after warm-up: "
              f"{e['compilations_after_warmup']}; KV waste {e['kv_cache_waste']:.1%}; "
              f"preemptions {e['num_preemptions']}")  # fmt: skip
        for other in PEERS:
            if other in results:
                # per round: the two systems ran minutes apart, not hours; the median of the
                # rounds is the figure to quote on a machine whose speed drifts
                per_round = [
                    r["jaxpaged"].tok_per_s / r[other].tok_per_s for r in rounds if other in r
                ]
                ratio = statistics.median(per_round)
                report[f"ratio_vs_{other}"] = ratio
                report[f"ratios_vs_{other}"] = per_round
                detail = (f" (median of rounds: {', '.join(f'{x:.2f}x' for x in per_round)})"
                          if len(per_round) > 1 else "")  # fmt: skip
                print(f"ratio jaxpaged / {other}: {ratio:.2f}x{detail}")
    if "jaxpaged" in results and "vllm" in results:
        cmp = compare_greedy(results["jaxpaged"].token_ids, results["vllm"].token_ids)
        report["greedy_vs_vllm"] = cmp
        print(describe_agreement(cmp, ("jaxpaged", "vllm")))
    report["results"] = {k: v.to_json() for k, v in results.items()}
    report["rounds"] = [{k: v.to_json() for k, v in r.items()} for r in rounds]

    if llm is not None and args.llama_cpp_server:
        report["batch1_vs_llama_cpp"] = _batch1_report(llm, work, args)
    if llm is not None and args.decode_batch > 0:
        report["decode_step"] = _decode_step_report(llm, work, args)
    if llm is not None and args.prefill_lengths:
        report["prefill"] = _prefill_report(llm, args)
    report["load_avg_end"] = os.getloadavg()
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
