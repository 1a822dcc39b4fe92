"""KV cache dtypes side by side in one process: the model's own (auto), int8 and fp8.

    python bench/kv_cache_dtype.py [--batch 32] [--steps 8] [--rounds 3] [--prompts 8]

For each --kv-cache-dtype, one engine over the same weights (the bundled SmolLM2 unless
--model) with the same KV memory budget (--kv-cache-memory), and:

1. the KV blocks (and tokens) that fit in that budget;
2. pure-decode step time at --batch sequences, rounds alternated between the engines (this
   VM's speed drifts over minutes), as tokens per second;
3. greedy agreement with the auto engine over --prompts chat prompts (EOS ignored): requests
   identical and the first divergence of each (bench/vllm_peer.py's compare_greedy);
4. perplexity of a fixed text (the repository's docs/architecture.md, its first
   --ppl-tokens tokens) from prompt logprobs, so every token attends over the KV cache as
   stored. A stand-in until the weights' perplexity harness lands.
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path
from typing import Any

from common import make_workload
from step_breakdown import time_decode_steps
from vllm_peer import compare_greedy, describe_agreement

KV_DTYPES = ("auto", "int8", "fp8")
TEXT = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"


def _engine(args: argparse.Namespace, kv: str) -> Any:
    from jaxpaged import LLM

    return LLM(args.model, kv_cache_dtype=kv, kv_cache_memory=args.kv_cache_memory,
               max_model_len=args.max_model_len, max_num_seqs=args.batch,
               enforce_eager=args.enforce_eager, show_progress=False)  # fmt: skip


def _perplexity(llm: Any, ids: list[int]) -> float:
    from jaxpaged import SamplingParams

    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    lps = [lp.logprob for lp in out[0].prompt_logprobs if lp is not None]
    return math.exp(-sum(lps) / len(lps))


def _quality(args: argparse.Namespace, engines: dict[str, Any], tokenizer: Any) -> None:
    """Perplexity of the fixed text, and greedy agreement with the auto engine."""
    from jaxpaged import SamplingParams

    ids = tokenizer.encode(TEXT.read_text(encoding="utf-8"))[: args.ppl_tokens]
    ppl = {kv: _perplexity(llm, list(ids)) for kv, llm in engines.items()}
    print("perplexity over", len(ids), "tokens of docs/architecture.md: "
          + ", ".join(f"{kv} {v:.4f} ({100 * (v / ppl['auto'] - 1):+.2f}%)"
                      for kv, v in ppl.items()), flush=True)  # fmt: skip

    sub = make_workload(tokenizer, num_prompts=args.prompts, seed=1, max_prompt_words=120,
                        min_output=args.tokens, max_output=args.tokens)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    greedy = {}
    for kv, llm in engines.items():
        outs = llm.generate([list(r.prompt_token_ids) for r in sub], params, use_tqdm=False)
        greedy[kv] = [list(o.outputs[0].token_ids) for o in outs]
    for kv in KV_DTYPES[1:]:
        cmp = compare_greedy(greedy[kv], greedy["auto"])
        print(describe_agreement(cmp, (f"kv {kv}", "kv auto")), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=8, help="decode steps per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds per dtype, alternated")
    p.add_argument("--prompts", type=int, default=8, help="greedy prompts compared")
    p.add_argument("--tokens", type=int, default=64, help="tokens per compared prompt")
    p.add_argument("--ppl-tokens", type=int, default=500)
    p.add_argument("--kv-cache-memory", default="512MiB")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no warm-up: programs compile on first use, in untimed steps (faster start)",
    )
    p.add_argument("--no-quality", action="store_true", help="sizes and speed only")
    args = p.parse_args()

    from jaxpaged.models import load_tokenizer
    from jaxpaged.models.resolve import resolve_model_folder

    folder = str(resolve_model_folder(args.model))
    tokenizer = load_tokenizer(folder)
    engines = {kv: _engine(args, kv) for kv in KV_DTYPES}
    for kv, llm in engines.items():
        layout = llm.engine.layout
        print(f"{kv}: pool {layout.dtype}, {layout.bytes_per_block} bytes per block, "
              f"{layout.num_blocks} blocks = {layout.num_blocks * layout.block_size} tokens in "
              f"{args.kv_cache_memory}", flush=True)  # fmt: skip
    if not args.no_quality:
        _quality(args, engines, tokenizer)

    work = make_workload(tokenizer, num_prompts=args.batch, seed=0, max_prompt_words=200)
    prompts = [r.prompt_token_ids for r in work]
    medians: dict[str, list[float]] = {kv: [] for kv in KV_DTYPES}
    for rnd in range(args.rounds):
        for kv, llm in engines.items():
            (timing,) = time_decode_steps(llm, prompts, batch=args.batch, steps=args.steps)
            medians[kv].append(timing.median)
        print(f"round {rnd + 1}: decode tok/s at batch {args.batch}: "
              + ", ".join(f"{kv} {args.batch / medians[kv][-1]:.0f}" for kv in KV_DTYPES),
              flush=True)  # fmt: skip
    base = statistics.median(medians["auto"])
    print(f"median decode tok/s at batch {args.batch}: "
          + ", ".join(f"{kv} {args.batch / statistics.median(m):.0f} "
                      f"({base / statistics.median(m):.2f}x auto)" for kv, m in medians.items()))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
