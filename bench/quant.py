"""Weight quantization side by side on one model, in one process (noisy machines: compare
the ratios, not the absolute figures).

    python bench/quant.py [--methods float32,bfloat16,int8,gguf] [--steps 8] [--rounds 3]
        [--batches 1,4,16,32]

For each method (a float dtype, or a ``quantization`` over float32; "gguf": a GGUF model's
own group-wise weights, the bundled SmolLM2's Q4_1 layers and Q8_0 embedding): the bytes of
the weights a decode step streams, the KV tokens that fit in ``--kv-budget`` of cache, and
the pure-decode tok/s at each of ``--batches`` (default 1 and ``--batch``), timed in
alternating rounds so every
method runs in the same minutes. Each method's speed-up is against the first method's
median. The float methods read a GGUF model's float expansion (quantization="none").
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from common import make_workload
from step_breakdown import time_decode_steps

FLOAT_DTYPES = ("float32", "bfloat16")


def _engine(args: argparse.Namespace, method: str) -> Any:
    from jaxpaged import LLM
    from jaxpaged.engine import process_owner_args

    # a dtype would read a GGUF model's float expansion: "gguf" keeps the loader's default
    dtype = method if method in FLOAT_DTYPES else None if method == "gguf" else "float32"
    quantization = "none" if method in FLOAT_DTYPES else method
    return LLM(args.model, dtype=dtype, quantization=quantization,
               max_model_len=args.max_model_len, max_num_seqs=args.batch,
               kv_cache_memory=args.kv_memory, enforce_eager=args.enforce_eager,
               show_progress=False, **process_owner_args())  # fmt: skip


def _streamed_bytes(llm: Any) -> int:
    import jax

    runner = llm.engine.runner
    return sum(int(a.nbytes) for a in jax.tree.leaves(runner._hooks.streamed(runner.params)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2")
    p.add_argument("--methods", default="float32,bfloat16,int8,gguf")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--batches", default=None,
                   help="comma-separated batch sizes (default: 1 and --batch)")  # fmt: skip
    p.add_argument("--steps", type=int, default=8, help="decode steps per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds per method, alternated")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--kv-memory", default="400MiB", help="each engine's KV cache")
    p.add_argument("--kv-budget", default="1GiB", help="the budget KV tokens are counted in")
    p.add_argument("--enforce-eager", action="store_true", help="no warm-up (smoke tests)")
    args = p.parse_args()

    from jaxpaged.args import parse_size
    from jaxpaged.models import load_tokenizer
    from jaxpaged.models.resolve import resolve_model_folder

    methods = args.methods.split(",")
    batches = sorted({int(b) for b in args.batches.split(",")}) if args.batches else [1, args.batch]
    if min(batches) < 1:
        p.error("--batches must be >= 1")
    args.batch = max(batches)  # each engine runs up to the largest
    folder = str(resolve_model_folder(args.model))
    work = make_workload(load_tokenizer(folder), num_prompts=args.batch, seed=0,
                         max_prompt_words=100)  # fmt: skip
    prompts = [r.prompt_token_ids for r in work]
    engines = {m: _engine(args, m) for m in methods}
    budget = parse_size(args.kv_budget)
    for m, llm in engines.items():
        layout = llm.engine.layout
        tokens = budget // layout.bytes_per_block * layout.block_size
        print(f"{m}: streamed weights {_streamed_bytes(llm) / 2**20:.1f} MiB, KV tokens in "
              f"{args.kv_budget}: {tokens}, kernels: {llm.engine.runner.kernels}", flush=True)  # fmt: skip
    for batch in batches:
        medians: dict[str, list[float]] = {m: [] for m in methods}
        for rnd in range(args.rounds):
            for m in methods:
                (timing,) = time_decode_steps(engines[m], prompts[:batch], batch=batch,
                                              steps=args.steps)  # fmt: skip
                medians[m].append(timing.median)
            print(f"round {rnd + 1}, batch {batch}: " + ", ".join(
                f"{m} {medians[m][-1] * 1e3:.1f} ms" for m in methods), flush=True)  # fmt: skip
        base = statistics.median(medians[methods[0]])
        for m in methods:
            med = statistics.median(medians[m])
            print(f"batch {batch} {m}: {batch / med:.1f} tok/s, {base / med:.2f}x {methods[0]} "
                  f"(step {med * 1e3:.1f} ms)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
