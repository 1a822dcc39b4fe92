"""Time to first token of later agent turns with and without the prefix cache's host tier.

    python bench/kv_offload.py [--conversations 4] [--turns 5] [--tool-words 160]
                               [--kv-offloading-size 1] [--max-model-len 1024]

A multi-turn agent replay on the bundled SmolLM2: each conversation starts with a system
prompt and a task, then every turn appends the model's reply (16 tokens, greedy) and a tool
result of ``tool-words`` words, and resends the whole conversation. The conversations take
turns one request at a time, as agents waiting on their tools do. The device pool is the
smallest the engine accepts (one max_model_len sequence), so by the time a conversation comes
back its prefix has been evicted by the others: without the tier its whole history is
recomputed, with it (``--kv-offloading-size`` GiB) the evicted blocks are copied back.

Two engines, one with the tier and one without, run side by side in one process, each turn on
one then the other (alternating which goes first), so machine load falls on both alike. It
prints the TTFT of every turn after the first, per engine, their medians and ratio, and
checks that both produced the same tokens.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from jaxpaged import LLM, SamplingParams

_WORDS = (
    "error trace file line value result status request function module return call token "
    "table block cache memory test output input config path user agent tool search found "
    "missing update patch diff commit branch build step queue kernel device host"
).split()


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _conversations(tokenizer, n: int, turns: int, tool_words: int, seed: int) -> list[list]:
    """Per conversation: its first prompt's ids, then each later turn's appended ids
    (before the reply is known: the reply's ids go in between at run time)."""
    rng = random.Random(seed)
    convs = []
    for c in range(n):
        task = " ".join(rng.choice(_WORDS) for _ in range(tool_words))
        first = _ids(
            tokenizer,
            "<|im_start|>system\nYou are a coding agent. Use the tools.<|im_end|>\n"
            f"<|im_start|>user\nTask {c}: fix the failing build. Context: {task}<|im_end|>\n"
            "<|im_start|>assistant\n",
        )
        later = []
        for t in range(1, turns):
            result = " ".join(rng.choice(_WORDS) for _ in range(tool_words))
            later.append(
                _ids(
                    tokenizer,
                    f"<|im_end|>\n<|im_start|>user\nTool result {t}: {result}<|im_end|>\n"
                    "<|im_start|>assistant\n",
                )
            )
        convs.append([first, *later])
    return convs


def _turn(llm: LLM, rid: str, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """Runs one request alone; returns (seconds to its first token, its tokens)."""
    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(rid, prompt, params)
    ttft = None
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            new = [t for c in out.outputs for t in c.token_ids]
            if new and ttft is None:
                ttft = time.perf_counter() - start
            tokens += new
    return ttft, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--tool-words", type=int, default=160)
    p.add_argument("--reply-tokens", type=int, default=16)
    p.add_argument("--kv-offloading-size", type=float, default=1.0, help="GiB")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    opts = dict(
        model=a.model,
        max_model_len=a.max_model_len,
        block_size=a.block_size,
        num_kv_blocks=-(-a.max_model_len // a.block_size),  # one sequence: the least allowed
        max_num_seqs=4,
        show_progress=False,
    )
    engines = {
        "no tier": LLM(**opts),
        "host tier": LLM(kv_offloading_size=a.kv_offloading_size, **opts),
    }
    tok = engines["no tier"].engine.tokenizer
    convs = _conversations(tok, a.conversations, a.turns, a.tool_words, a.seed)
    history = {name: [list(c[0]) for c in convs] for name in engines}
    ttfts: dict[str, list[float]] = {name: [] for name in engines}
    by_turn: dict[tuple[str, int], list[float]] = {}
    order = list(engines)
    print(f"{'turn':>6} {'conv':>4} {'prompt':>6} " + " ".join(f"{n:>12}" for n in order))
    for t in range(a.turns):
        for c in range(a.conversations):
            row, outs = {}, {}
            for name in order:
                h = history[name][c]
                if t:
                    h += convs[c][t]
                ttft, out = _turn(engines[name], f"c{c}t{t}", h, a.reply_tokens)
                h += out
                row[name], outs[name] = ttft, out
                by_turn.setdefault((name, t), []).append(ttft)
                if t:
                    ttfts[name].append(ttft)
            assert outs["no tier"] == outs["host tier"], f"outputs differ at c{c}t{t}"
            order.reverse()  # alternate which engine goes first
            n = len(history["no tier"][c]) - a.reply_tokens
            print(
                f"{t:>6} {c:>4} {n:>6} "
                + " ".join(f"{row[name] * 1e3:>10.0f}ms" for name in engines)
            )
    med = {name: statistics.median(v) for name, v in ttfts.items()}
    m = engines["host tier"].get_metrics()
    base = engines["no tier"].get_metrics()
    print(
        f"\nTTFT of turns 1..{a.turns - 1}, median: no tier {med['no tier'] * 1e3:.0f} ms, "
        f"host tier {med['host tier'] * 1e3:.0f} ms ({med['no tier'] / med['host tier']:.2f}x)"
    )
    for t in range(a.turns):
        no, yes = (statistics.median(by_turn[name, t]) for name in engines)
        print(f"turn {t}: median TTFT no tier {no * 1e3:.0f} ms, host tier {yes * 1e3:.0f} ms "
              f"({no / yes:.2f}x)")  # fmt: skip
    print(
        f"host tier: {m['kv_offload_hits']} prompt tokens loaded back "
        f"({m['kv_offload_blocks_loaded']} blocks, {m['kv_offload_bytes_loaded'] / 2**20:.0f} "
        f"MiB), {m['kv_offload_blocks_stored']} blocks stored "
        f"({m['kv_offload_bytes_stored'] / 2**20:.0f} MiB); prefix-cache hits "
        f"{m['prefix_cache_hits']} tokens vs {base['prefix_cache_hits']} without; "
        f"compilations after the tiered engine's warm-up {m['num_compilations_after_warmup']}; "
        "outputs identical"
    )


if __name__ == "__main__":
    main()
