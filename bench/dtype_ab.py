"""float32 against bfloat16 for one model on this machine, side by side in one process.

    python bench/dtype_ab.py [--batch 32] [--steps 8] [--rounds 9] [--compare-hf 8]
        [--require-speedup 1.0]

1. Decode steps: two engines (weights and KV cache in float32, and in bfloat16), their
   pure-decode steps at ``--batch`` sequences timed in alternating rounds (this VM's speed
   drifts over minutes; alternation puts both dtypes in the same minutes, and the order
   flips every round, A B, B A, so neither always runs first). Prints each round's medians
   and the bfloat16 speed-up (float32 step time / bfloat16 step time), then the median over
   rounds with its spread (quartiles, range). ``--require-speedup X`` makes it a check: exit
   status 1 when the median speed-up is below X (1.0: "bfloat16 never slower").
2. ``--compare-hf N``: N chat prompts decoded greedily (EOS ignored) by the bfloat16 engine
   and by transformers' own bfloat16 model, and where their tokens first part, request by
   request (bench/vllm_peer.py's compare_greedy).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Any

from common import make_workload
from step_breakdown import time_decode_steps
from vllm_peer import compare_greedy, describe_agreement

DTYPES = ("float32", "bfloat16")
# --bf16-activations: a third engine, bfloat16 with its activations rounded to bfloat16
# between layers (the CPU backend's choice before it kept them float32)
BF16_ACT = "bfloat16-act"


def _engine(args: argparse.Namespace, dtype: str) -> Any:
    import dataclasses

    from jaxpaged import LLM

    llm = LLM(args.model, dtype=dtype.split("-")[0], max_model_len=args.max_model_len,
              max_num_seqs=args.batch, enforce_eager=args.enforce_eager or dtype == BF16_ACT,
              kv_cache_memory=args.kv_cache_memory, show_progress=False)  # fmt: skip
    if dtype == BF16_ACT:  # eager: its steps compile at first use, before the timed ones
        runner = llm.engine.runner
        layers = dataclasses.replace(runner.platform.layers, activation_dtype=None)
        runner.platform = dataclasses.replace(runner.platform, layers=layers)
    return llm


def _hf_greedy(folder: str, work: list[Any]) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    out = []
    with torch.inference_mode():
        for r in work:
            ids = torch.tensor([list(r.prompt_token_ids)])
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 do_sample=False, max_new_tokens=r.max_tokens,
                                 min_new_tokens=r.max_tokens)  # fmt: skip
            out.append(gen[0, ids.shape[1] :].tolist())
    return out


def spread(ratios: list[float]) -> dict[str, float]:
    """Median, quartiles and range of per-round ratios (quartiles: statistics' inclusive
    method, so 1 or 2 rounds still give figures)."""
    if len(ratios) == 1:
        q1 = q3 = ratios[0]
    else:
        q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return {"median": statistics.median(ratios), "q1": q1, "q3": q3,
            "min": min(ratios), "max": max(ratios), "rounds": len(ratios)}  # fmt: skip


def describe_spread(s: dict[str, float]) -> str:
    return (f"median {s['median']:.2f}x (quartiles {s['q1']:.2f}-{s['q3']:.2f}x, range "
            f"{s['min']:.2f}-{s['max']:.2f}x, {s['rounds']} rounds)")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=8, help="decode steps per round")
    p.add_argument("--rounds", type=int, default=9, help="rounds per dtype, alternated")
    p.add_argument("--require-speedup", type=float, default=None, metavar="X",
                   help="exit 1 when bfloat16's median speed-up is below X")  # fmt: skip
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--enforce-eager", action="store_true", help="no warm-up (smoke tests)")
    p.add_argument("--kv-cache-memory", default=None,
                   help="each engine's KV cache (e.g. 768MiB; default: the engine's)")  # fmt: skip
    p.add_argument("--bf16-activations", action="store_true",
                   help="also time bfloat16 with bfloat16 activations between layers")  # fmt: skip
    p.add_argument("--compare-hf", type=int, default=0, metavar="N")
    p.add_argument("--compare-tokens", type=int, default=64, help="tokens per compared prompt")
    p.add_argument("--json-out", default=None, help="with --compare-hf: the figures as JSON")
    args = p.parse_args()

    from jaxpaged.models import load_tokenizer
    from jaxpaged.models.resolve import resolve_model_folder

    folder = str(resolve_model_folder(args.model))
    tokenizer = load_tokenizer(folder)
    work = make_workload(tokenizer, num_prompts=args.batch, seed=0, max_prompt_words=200)
    prompts = [r.prompt_token_ids for r in work]
    from jaxpaged.kernels.cpu.features import bf16_dot_flags

    print(f"CPU bfloat16 dot products: {', '.join(bf16_dot_flags()) or 'none'}; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    dtypes = DTYPES + ((BF16_ACT,) if args.bf16_activations else ())
    engines = {d: _engine(args, d) for d in dtypes}
    medians: dict[str, list[float]] = {d: [] for d in dtypes}
    for rnd in range(args.rounds):
        for d in dtypes if rnd % 2 == 0 else dtypes[::-1]:
            (timing,) = time_decode_steps(engines[d], prompts, batch=args.batch, steps=args.steps)
            medians[d].append(timing.median)
        f32 = medians["float32"][-1]
        parts = ", ".join(f"{d} {medians[d][-1] * 1e3:.1f} ms" for d in dtypes)
        ups = ", ".join(f"{d} {f32 / medians[d][-1]:.2f}x" for d in dtypes[1:])
        print(f"round {rnd + 1}: decode step at batch {args.batch}: {parts}; speed-up over "
              f"float32: {ups} (load {os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip
    for d in dtypes[1:]:
        per = [f / b for f, b in zip(medians["float32"], medians[d], strict=True)]
        print(f"{d} speed-up at batch {args.batch}: {describe_spread(spread(per))} "
              f"(rounds: {', '.join(f'{u:.2f}x' for u in per)})")  # fmt: skip
    ups = [f / b for f, b in zip(medians["float32"], medians["bfloat16"], strict=True)]
    status = 0
    if args.require_speedup is not None:
        ok = statistics.median(ups) >= args.require_speedup
        print(f"check: bfloat16 median speed-up {statistics.median(ups):.2f}x "
              f"{'>=' if ok else '<'} {args.require_speedup:.2f}x: {'PASS' if ok else 'FAIL'}")  # fmt: skip
        status = 0 if ok else 1

    if args.compare_hf:
        from jaxpaged import SamplingParams

        del engines["float32"]
        sub = make_workload(tokenizer, num_prompts=args.compare_hf, seed=1, max_prompt_words=120,
                            min_output=args.compare_tokens, max_output=args.compare_tokens)  # fmt: skip
        params = SamplingParams(temperature=0.0, max_tokens=args.compare_tokens, ignore_eos=True)
        outs = engines["bfloat16"].generate([list(r.prompt_token_ids) for r in sub], params,
                                            use_tqdm=False)  # fmt: skip
        ours = [list(o.outputs[0].token_ids) for o in outs]
        cmp = compare_greedy(ours, _hf_greedy(folder, sub))
        print(describe_agreement(cmp, ("jaxpaged bfloat16", "transformers bfloat16")))
        if args.json_out:
            with open(args.json_out, "w", encoding="utf-8") as f:
                json.dump({"speedups": ups, "medians_s": medians, "greedy_vs_hf": cmp}, f)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
