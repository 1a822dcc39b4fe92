"""One offline workload through vLLM's ``LLM.generate``, run by vLLM's own Python.

    VLLM_PYTHON bench/vllm_offline.py --spec SPEC.json --out OUT.json

bench/vllm_peer.py starts this in the virtual environment given as ``--vllm-python`` (vLLM is a
benchmark peer, never a dependency: this file imports nothing of jaxpaged's). SPEC.json holds
the model folder, dtype, engine limits and the requests as token ids with their output
lengths; OUT.json gets the load time, the timed generate's seconds and every request's
greedy token ids. Greedy, EOS ignored, as jaxpaged's run of the same workload. A short
generate before the timed one keeps vLLM's first-use compilation out of the timing, as
jaxpaged's warm-up is kept out of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# bench/ (this script's folder, first on sys.path) holds modules named like ones vLLM imports
# (common.py, serving.py): vLLM must see only its own environment.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--spec", required=True, help="JSON written by bench/vllm_peer.py")
    p.add_argument("--out", required=True, help="where the result JSON goes")
    args = p.parse_args()
    with open(args.spec, encoding="utf-8") as f:
        spec = json.load(f)

    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        max_model_len=spec["max_model_len"],
        max_num_seqs=spec["max_num_seqs"],
        seed=0,
    )
    load_seconds = time.perf_counter() - t0
    requests = spec["requests"]
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True,
                             detokenize=False) for r in requests]  # fmt: skip
    t0 = time.perf_counter()
    llm.generate(prompts[:2], params[:2], use_tqdm=False)
    warmup_seconds = time.perf_counter() - t0
    llm.reset_prefix_cache()  # the timed run must not reuse the warm-up's prompts
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    import vllm

    result = {
        "version": vllm.__version__,
        "load_seconds": load_seconds,
        "warmup_seconds": warmup_seconds,
        "seconds": seconds,
        "token_ids": [list(o.outputs[0].token_ids) for o in outs],
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":  # vLLM starts its engine in a subprocess that re-imports this file
    raise SystemExit(main())
