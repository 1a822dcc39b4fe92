"""Speculative decoding: n-gram prompt lookup against none, side by side in one run.

    python bench/speculative.py [--model M] [--batch-sizes 1 8 32] [--max-tokens 96]
        [--num-speculative-tokens 4] [--prompt-lookup-min 2] [--prompt-lookup-max 4]
        [--workloads copy chat] [--draft-model PATH|bundled-gguf] [--eagle3 HEAD] [--rounds N]
        [--json FILE]

Engines over the same model: one without speculation, one with
``speculative_config={"method": "ngram", ...}`` and, with ``--draft-model``, one with that
draft model (``bundled-gguf``: the bundled SmolLM2's own Q4_1 GGUF kept 4-bit) and, with
``--eagle3``, one with that EAGLE-3 head (a folder or hub id trained for ``--model``); every
workload at every batch size through each, in turn: B requests at once,
greedy, EOS ignored, the same token ids. Workloads:
  copy  edit / repeat / rewrite a given paragraph (the reply copies much of the prompt:
        where n-gram lookup pays)
  chat  ordinary questions (bench/common.py's essays: little to copy)

Printed per (workload, batch, config): output tokens/s (wall time of the batch), TPOT
(per request: (finish - first token) / (tokens - 1), mean), and with n-gram the mean
acceptance length (1 + accepted drafts per verification) and the acceptance rate. Greedy
outputs of the two engines are compared (they must be identical). The machine's speed moves
with its load: compare the two configs of one run, not runs of different days.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from common import make_workload

PARAGRAPHS = (
    "The river runs through the old town, past the market and the stone bridge, and then "
    "turns north toward the hills. In spring the water is high and fast, and the children "
    "watch the boats from the bridge. In summer the water is low and warm, and the same "
    "children swim near the mill, where the river is slow and the bank is soft with grass.",
    "A paged KV cache stores the keys and values of every request in fixed-size blocks. "
    "Each request owns a block table that maps its logical blocks to physical blocks, so "
    "memory is taken only when tokens need it. Blocks with the same prefix are shared "
    "between requests, and a shared block is copied only when someone must write into it.",
    "To bake bread, mix the flour, the water, the salt and the yeast in a large bowl. Knead "
    "the dough for ten minutes, until it is smooth and elastic. Let it rise for two hours "
    "in a warm place, shape it into a loaf, let it rise again for one hour, and bake it in "
    "a hot oven for forty minutes, until the crust is golden and the loaf sounds hollow.",
    "The committee met on Tuesday to review the budget for the next year. The chair opened "
    "the meeting, the treasurer presented the figures, and the members discussed each line. "
    "They agreed to raise the library fund, to keep the park fund as it is, and to cut the "
    "travel fund by a third. The next meeting will be held on the first Monday of March.",
)
TASKS = (
    "Repeat the following text exactly, word for word:\n\n{p}",
    "Correct any mistakes in the following text and return the whole corrected text:\n\n{p}",
    "Rewrite the following text in the past tense, keeping everything else the same:\n\n{p}",
)


def copy_workload(tokenizer: Any, n: int) -> list[list[int]]:
    from common import _chat_ids

    out = []
    for i in range(n):
        text = TASKS[i % len(TASKS)].format(p=PARAGRAPHS[(i // len(TASKS)) % len(PARAGRAPHS)])
        out.append(_chat_ids(tokenizer, [{"role": "user", "content": text}]))
    return out


def chat_workload(tokenizer: Any, n: int) -> list[list[int]]:
    reqs = make_workload(tokenizer, num_prompts=n, seed=0, max_prompt_words=40)
    return [list(r.prompt_token_ids) for r in reqs]


def run_batch(llm: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    from jaxpaged import SamplingParams

    before = llm.get_metrics()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = llm.get_metrics()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    tpots = [
        (o.metrics.finished_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
        for o in outs
        if len(o.outputs[0].token_ids) > 1
    ]
    drafts = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
    drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tok_s": tokens / seconds,
        "tpot_ms": 1000 * statistics.mean(tpots) if tpots else float("nan"),
        "acceptance_length": 1 + accepted / drafts if drafts else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "token_ids": [list(o.outputs[0].token_ids) for o in outs],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="model (default: the bundled SmolLM2)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--workloads", nargs="+", default=["copy", "chat"], choices=["copy", "chat"])
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument(
        "--disable-by-batch-size",
        type=int,
        default=None,
        help="speculative_config's disable_by_batch_size (default: the engine's; on a CPU it "
        "drafts for one running request only)",
    )
    p.add_argument(
        "--draft-model",
        default=None,
        help="also a draft_model engine over this checkpoint (bundled-gguf: SmolLM2's Q4_1)",
    )
    p.add_argument(
        "--eagle3",
        default=None,
        help="also an eagle3 engine with this EAGLE-3 head (a folder or hub id for --model)",
    )
    p.add_argument("--rounds", type=int, default=1,
                   help="measure each batch this many times, alternating the engines' order")  # fmt: skip
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    args = p.parse_args(argv)

    from jaxpaged import LLM

    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_min": args.prompt_lookup_min,
        "prompt_lookup_max": args.prompt_lookup_max,
    }
    if args.disable_by_batch_size is not None:
        spec["disable_by_batch_size"] = args.disable_by_batch_size
    kw = dict(
        max_model_len=args.max_model_len,
        max_num_seqs=max(args.batch_sizes),
        show_progress=False,
    )
    engines = {
        "off": LLM(args.model, **kw),
        "ngram": LLM(args.model, speculative_config=spec, **kw),
    }
    if args.draft_model:
        path = args.draft_model
        if path == "bundled-gguf":
            from jaxpaged.models.bundled import bundled_gguf_path

            path = str(bundled_gguf_path())
        draft = {"model": path, "num_speculative_tokens": args.num_speculative_tokens}
        if args.disable_by_batch_size is not None:
            draft["disable_by_batch_size"] = args.disable_by_batch_size
        if path.endswith(".gguf"):
            draft["quantization"] = "gguf"
        engines["draft"] = LLM(args.model, speculative_config=draft, **kw)
    if args.eagle3:
        head = {"method": "eagle3", "model": args.eagle3,
                "num_speculative_tokens": args.num_speculative_tokens}  # fmt: skip
        if args.disable_by_batch_size is not None:
            head["disable_by_batch_size"] = args.disable_by_batch_size
        engines["eagle3"] = LLM(args.model, speculative_config=head, **kw)
    tokenizer = engines["off"].engine.tokenizer
    makers = {"copy": copy_workload, "chat": chat_workload}
    rows = []
    print(
        f"speculative_config={json.dumps(spec)}; greedy, EOS ignored, {args.max_tokens} tokens",
        flush=True,
    )
    print(
        "| workload | batch | config | tok/s | TPOT ms | acceptance length | accepted | same tokens |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for workload in args.workloads:
        for b in args.batch_sizes:
            prompts = makers[workload](tokenizer, b)
            speedups: dict[str, list[float]] = {}
            for rnd in range(args.rounds):
                # alternate which engine goes first: the machine's load drifts
                order = list(engines.items())
                results = {
                    name: run_batch(llm, prompts, args.max_tokens)
                    for name, llm in (order if rnd % 2 == 0 else order[::-1])
                }
                same = all(r["token_ids"] == results["off"]["token_ids"] for r in results.values())
                for name, r in results.items():
                    length = r["acceptance_length"]
                    rate = r["acceptance_rate"]
                    print(
                        f"| {workload} | {b} | {name} | {r['tok_s']:.1f} | {r['tpot_ms']:.1f} | "
                        f"{'' if length is None else f'{length:.2f}'} | "
                        f"{'' if rate is None else f'{100 * rate:.0f} %'} | {same} |",
                        flush=True,
                    )
                    rows.append({"workload": workload, "batch": b, "config": name, "same": same,
                                 "round": rnd,
                                 **{k: v for k, v in r.items() if k != "token_ids"}})  # fmt: skip
                for name in results:
                    if name != "off":
                        speedup = results[name]["tok_s"] / results["off"]["tok_s"]
                        speedups.setdefault(name, []).append(speedup)
                        print(f"|  |  | {name} / off | **{speedup:.2f}x** |  |  |  |  |",
                              flush=True)  # fmt: skip
            if args.rounds > 1:
                for name, xs in speedups.items():
                    print(f"|  |  | {name} / off, median of {len(xs)} rounds | "
                          f"**{statistics.median(xs):.2f}x** (min {min(xs):.2f}, max "
                          f"{max(xs):.2f}) |  |  |  |  |", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"speculative_config": spec, "rows": rows}, f, indent=1)
    for llm in engines.values():
        llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
