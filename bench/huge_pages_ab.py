"""Paired A/B of jaxpaged's decode step with its weights on 4 KiB pages and on 2 MiB pages.

    python bench/huge_pages_ab.py [--model M] [--batch 32] [--pairs 100]

One engine, two copies of its (packed) weights, one moved onto huge pages
(jaxpaged.kernels.cpu.huge_pages); the steps alternate between them in ABBA order on the same requests,
so both see the same contexts and the same minute of this shared machine, and the paired
differences carry the comparison (absolute step times drift by 10 % within minutes here).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder / .gguf (default: bundled SmolLM2)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--pairs", type=int, default=100)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--prompt-len", type=int, default=200, help="mean prompt tokens (+-25%%)")
    p.add_argument("--enforce-eager", action="store_true", help="skip the warm-up (smoke runs)")
    args = p.parse_args(argv)
    if args.pairs < 2:
        p.error("--pairs must be at least 2")

    import jax
    import jax.numpy as jnp
    import numpy as np
    from step_breakdown import prepare_decode

    from jaxpaged import LLM
    from jaxpaged.engine import process_owner_args
    from jaxpaged.kernels.cpu.huge_pages import back_with_huge_pages
    from jaxpaged.models.llama import streamed_weights

    os.environ["JAXPAGED_HUGE_PAGES"] = "0"  # the engine's own copy stays on small pages
    llm = LLM(args.model, max_model_len=args.max_model_len, max_num_seqs=max(args.batch, 1),
              enforce_eager=args.enforce_eager, show_progress=False,
              **process_owner_args())  # fmt: skip
    runner = llm.engine.runner
    small, huge = (jax.tree.map(lambda a: jnp.array(a, copy=True), runner.params) for _ in "ab")
    del os.environ["JAXPAGED_HUGE_PAGES"]
    t0 = time.perf_counter()
    moved = back_with_huge_pages(streamed_weights(huge))
    print(f"moved {moved / 2**20:.0f} MiB of weights onto 2 MiB pages in "
          f"{time.perf_counter() - t0:.2f} s")  # fmt: skip

    rng = np.random.default_rng(0)
    vocab = llm.engine.model_config.vocab_size
    prompts = [rng.integers(0, vocab, size=int(n)).tolist()
               for n in rng.integers(args.prompt_len * 3 // 4, args.prompt_len * 5 // 4 + 1,
                                     size=args.batch)]  # fmt: skip
    ids = prepare_decode(llm, prompts, batch=args.batch, steps=2 * args.pairs)
    times: dict[str, list[float]] = {"4 KiB": [], "2 MiB": []}
    try:
        for i in range(args.pairs):
            order = (("4 KiB", small), ("2 MiB", huge))
            for name, params in order if i % 2 == 0 else order[::-1]:
                runner.params = params
                t = time.perf_counter()
                llm.engine.step()
                jax.block_until_ready(runner.sampled)  # this step's device work, not the last's
                times[name].append(time.perf_counter() - t)
    finally:
        for rid in ids:
            llm.engine.abort(rid)
    diffs = [h - s for s, h in zip(times["4 KiB"], times["2 MiB"], strict=True)]
    for name, ts in times.items():
        print(f"weights on {name} pages: decode step median {statistics.median(ts) * 1e3:.1f} ms")
    faster = sum(d < 0 for d in diffs)
    print(f"paired difference (2 MiB - 4 KiB): median {statistics.median(diffs) * 1e3:+.2f} ms; "
          f"2 MiB faster in {faster} of {len(diffs)} pairs")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
