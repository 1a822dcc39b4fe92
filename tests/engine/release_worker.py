"""Builds, uses and closes (or drops) tiny engines of distinct shapes one after another in this
process, printing one JSON line per engine with the process's resident memory and its number
of memory mappings (lines of /proc/self/maps) after the engine is gone. Run by
test_engine_release.py in a process of its own, so nothing else's programs are counted."""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def num_mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def write_model(path: str, i: int) -> None:
    """A random Llama checkpoint whose shapes differ from every other i's (its word-level
    vocabulary: 128 + 8 i tokens), written with numpy (tests/tiny_llama.py: importing torch
    and transformers would cost this process seconds of CPU)."""
    from tiny_llama import write_tiny_llama

    write_tiny_llama(path, max_position_embeddings=64, seed=i, words=128 + 8 * i)


def main(num_engines: int) -> None:
    from jaxpaged import LLM, SamplingParams

    root = tempfile.mkdtemp(prefix="jaxpaged-release-")
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for i in range(num_engines):
        path = os.path.join(root, f"m{i}")
        write_model(path, i)
        # warmed up (two step programs: one decode bucket, one mixed), then used
        llm = LLM(
            path,
            max_model_len=32,
            max_num_seqs=1,
            max_num_batched_tokens=16,
            num_kv_blocks=4,
            block_size=16,
            show_progress=False,
            tokenizer_mode="tokenizers",  # no transformers import
        )
        out = llm.generate([[5, 6, 7]], params, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
        programs = llm.engine.warmup_programs
        if i % 2 == 0:
            llm.close()  # the odd ones are only dropped
        del llm, out
        gc.collect()
        line = {"i": i, "rss_mib": resident_mib(), "maps": num_mappings(), "programs": programs}
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
