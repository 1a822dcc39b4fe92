"""What a prefill chunk riding beside decodes costs: step times of D decodes alone and of D
decodes + a P-token chunk, for a few P, in alternating rounds in one process.

    python bench/mixed_steps.py [--decodes 15] [--chunks 64 49 17] [--rounds 8]

D requests decode throughout; each round adds, for every P in turn, a P-token prompt with
``max_tokens=1`` (prefilled in one step: the prefill cap is set out of the way) and times the
steps with $JAXPAGED_STEP_LOG. Printed: the median step time per shape and its ratio to the
decode-only step, the ratio the inter-token latency's tail follows (bench/prefill_ab.py).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Sequence

import numpy as np


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default=None)
    p.add_argument("--decodes", type=int, default=15)
    p.add_argument("--chunks", type=int, nargs="+", default=[64, 49, 17])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--enforce-eager", action="store_true", help="no warm-up (smoke tests)")
    p.add_argument("--cap", type=int, default=512,
                   help="max_prefill_tokens_with_decodes (512: no chunk is cut)")  # fmt: skip
    p.add_argument("--kv-cache-memory", default=None,
                   help="the servers' value, to reuse their compiled programs")  # fmt: skip
    p.add_argument("--compile-cache-dir", default=None, metavar="DIR")
    args = p.parse_args(argv)
    log = os.path.join(tempfile.mkdtemp(), "steps.jsonl")
    os.environ["JAXPAGED_STEP_LOG"] = log

    from jaxpaged import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, max_model_len=1024, max_num_seqs=args.decodes + 1,
              max_prefill_tokens_with_decodes=args.cap, enforce_eager=args.enforce_eager,
              kv_cache_memory=args.kv_cache_memory, compile_cache_dir=args.compile_cache_dir,
              show_progress=False)  # fmt: skip
    print(f"mixed sizes {llm.engine.runner.buckets.mixed_tokens}")
    engine = llm.engine
    rng = np.random.default_rng(0)
    vocab = engine.model_config.vocab_size
    steps_needed = 3 * len(args.chunks) * args.rounds + 8
    long = SamplingParams(temperature=0.0, max_tokens=steps_needed, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for i in range(args.decodes):
        engine.add_request(f"d{i}", rng.integers(100, vocab - 100, 8).tolist(), long)
    for _ in range(4):
        engine.step()
    for rnd in range(args.rounds):
        for chunk in args.chunks:
            prompt = rng.integers(100, vocab - 100, chunk).tolist()
            engine.add_request(f"p{rnd}-{chunk}", prompt, one)
            for _ in range(3):  # the chunk's step, then decodes alone
                engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    engine.close()
    with open(log) as f:
        steps = [json.loads(line) for line in f]
    times = collections.defaultdict(list)
    for s in steps[6:]:  # past the first prompts and the decodes' start
        if s["seqs"] and s["decodes"] == args.decodes:
            times[s["prefill"]].append(s["ms"])
    base = statistics.median(times[0])
    print(f"load {os.getloadavg()[0]:.1f}; {args.decodes} decodes alone: {base:.1f} ms "
          f"({len(times[0])} steps)")  # fmt: skip
    for chunk in args.chunks:
        if times[chunk]:
            t = statistics.median(times[chunk])
            print(f"{args.decodes} decodes + {chunk} prompt tokens ({args.decodes + chunk} rows):"
                  f" {t:.1f} ms = {t / base:.2f}x ({len(times[chunk])} steps)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
