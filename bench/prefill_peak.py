"""Prefill throughput against the machine's matmul peak: prompts of a few lengths prefilled
alone (``max_tokens=1``), their useful FLOPs per token, and the n^3 matmul peak measured in
the same process before and after (bench/roofline.py).

    python bench/prefill_peak.py [--lengths 256 1024] [--repeats 5] [--dtype float32]

FLOPs of a prompt of L tokens: 2 x (matmul parameters of every layer) per token, the
lm_head once (only the last position is sampled), and causal attention, q.k and p.v over
the L(L+1)/2 visible pairs: 2 x layers x heads x head_dim x L(L+1) in all. A prompt longer
than the step budget (``--max-num-batched-tokens``) is prefilled in chunks, one step each:
the figure is what a request sees, chunking included.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from roofline import measure_peaks, param_count


def prefill_flops(config: Any, prompt_len: int) -> float:
    """Useful FLOPs of prefilling one ``prompt_len``-token prompt (see the module docstring)."""
    c = config
    n = param_count(c)
    matmuls = 2.0 * (prompt_len * c.num_layers * n["layer_matmul"] + n["lm_head"])
    attention = 2.0 * c.num_layers * c.num_heads * c.head_dim * prompt_len * (prompt_len + 1)
    return matmuls + attention


def time_prefills(llm: Any, prompt_len: int, repeats: int, seed: int) -> list[float]:
    """Seconds from add_request to the first token of ``repeats`` fresh random prompts."""
    from jaxpaged import SamplingParams

    engine = llm.engine
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for i in range(repeats):
        prompt = rng.integers(100, vocab - 100, prompt_len).tolist()  # no prefix-cache hits
        engine.add_request(f"p{prompt_len}-{i}", prompt, params)
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        times.append(time.perf_counter() - t0)
    return times


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default=None)
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--matmul-n", type=int, default=2048, help="size of the peak's n^3 matmul")
    p.add_argument("--enforce-eager", action="store_true", help="no warm-up (smoke tests)")
    args = p.parse_args(argv)

    from jaxpaged import LLM

    peak_before = measure_peaks(matmul_n=args.matmul_n, repeats=3).matmul_flops
    llm = LLM(args.model, dtype=args.dtype, max_model_len=max(args.lengths) + 16,
              max_num_seqs=16, max_num_batched_tokens=args.max_num_batched_tokens,
              enforce_eager=args.enforce_eager, show_progress=False)  # fmt: skip
    cfg = llm.engine.model_config
    budget = llm.engine.scheduler_config.max_num_batched_tokens
    time_prefills(llm, min(args.lengths), 1, seed=99)  # first-use costs out of the figures
    rows = []
    for length in args.lengths:
        times = time_prefills(llm, length, args.repeats, seed=length)
        rows.append((length, statistics.median(times), min(times), max(times)))
    llm.engine.close()
    del llm
    peak_after = measure_peaks(matmul_n=args.matmul_n, repeats=3).matmul_flops
    peak = max(peak_before, peak_after)
    print(f"model {cfg.num_layers} layers, {param_count(cfg)['total'] / 1e6:.0f}M parameters, "
          f"{args.dtype}; step budget {budget} tokens; matmul peak {peak_before / 1e9:.0f} "
          f"GFLOP/s before, {peak_after / 1e9:.0f} after")  # fmt: skip
    print(
        "| prompt | steps | time ms (median, range) | tok/s | GFLOP per token | GFLOP/s "
        "| share of the matmul peak |"
    )
    print("|---|---|---|---|---|---|---|")
    for length, t, lo, hi in rows:
        flops = prefill_flops(cfg, length)
        print(f"| {length} | {-(-length // budget)} | {t * 1e3:.0f} ({lo * 1e3:.0f}-"
              f"{hi * 1e3:.0f}) | {length / t:.0f} | {flops / length / 1e9:.3f} | "
              f"{flops / t / 1e9:.1f} | {flops / t / peak:.0%} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
