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


def resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def num_mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def write_model(path: str, i: int) -> None:
    """A random Llama checkpoint whose shapes differ from every other i's (vocabulary),
    with hidden size and depth varying too."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = transformers.LlamaConfig(
        hidden_size=32 + 16 * (i % 4),
        intermediate_size=64,
        num_hidden_layers=1 + i % 2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=128 + 8 * i,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(i)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    vocab = {f"t{j}": j for j in range(config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1").save_pretrained(path)


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
