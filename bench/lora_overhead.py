"""What multi-LoRA costs: generation throughput with LoRA off, on with no adapter used, and on
with every request running a random adapter, side by side in one process.

    python bench/lora_overhead.py [--prompts 8] [--max-tokens 32] [--rounds 3] [--rank 16]

Three engines over the bundled SmolLM2 (or --model): ``enable_lora`` off; on (``max_loras``
2, ``max_lora_rank`` --rank) with requests that use no adapter; and the same engine with
every request on a random PEFT adapter of rank --rank on all seven projections. Rounds
alternate between the three (this VM's speed drifts over minutes), each round one
``LLM.generate`` of --prompts greedy requests of --max-tokens tokens after a first untimed
round. Prints tokens per second per round, the medians and the ratios to LoRA off.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time


def _random_adapter(folder: str, out: str, rank: int) -> None:
    import peft
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = peft.get_peft_model(model, peft.LoraConfig(r=rank, target_modules=targets))
    for name, p in model.named_parameters():
        if "lora_" in name:
            torch.nn.init.normal_(p, std=0.02)
    model.save_pretrained(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rank", type=int, default=16)
    args = p.parse_args()

    from jaxpaged import LLM, LoRARequest, SamplingParams
    from jaxpaged.models import default_model_path

    folder = args.model or default_model_path()
    adapter = tempfile.mkdtemp(prefix="lora-bench-")
    _random_adapter(folder, adapter, args.rank)
    common = dict(max_model_len=256, max_num_seqs=args.prompts, enforce_eager=True,
                  show_progress=False)  # fmt: skip
    off = LLM(folder, **common)
    on = LLM(folder, enable_lora=True, max_loras=2, max_lora_rank=args.rank, **common)
    prompts = [[1 + (7 * i + j) % 1000 for j in range(24)] for i in range(args.prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    lora = LoRARequest("bench", 1, adapter)
    runs = {
        "lora off": lambda: off.generate(prompts, params, use_tqdm=False),
        "lora on, no adapter": lambda: on.generate(prompts, params, use_tqdm=False),
        "lora on, adapter": lambda: on.generate(prompts, params, lora_request=lora, use_tqdm=False),
    }
    for run in runs.values():
        run()  # compiles the shapes this workload uses
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(args.rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            rates[name].append(args.prompts * args.max_tokens / (time.perf_counter() - start))
        print(f"round {r}: " + ", ".join(f"{n} {v[-1]:.1f} tok/s" for n, v in rates.items()))
    medians = {n: statistics.median(v) for n, v in rates.items()}
    base = medians["lora off"]
    print(json.dumps({n: {"tok_s": round(m, 1), "vs_off": round(m / base, 3)}
                      for n, m in medians.items()}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
