"""Sleep and wake on the bundled SmolLM2, with the memory each level gives back.

    .venv/bin/python examples/sleep_wake.py [--num-kv-blocks 512]

``llm.sleep(level=1)`` frees the KV pool (and the sampler's per-request state), level 2 also
drops the engine's weights; ``llm.wake_up()`` restores them (after level 2 from params you pass,
or by reloading the model). While asleep, ``generate`` raises EngineAsleepError. Printed: the
process's resident memory (RSS, from /proc) and the bytes of live JAX arrays at each stage.
"""

from __future__ import annotations

import argparse
import gc

import jax

from jaxpaged import LLM, SamplingParams
from jaxpaged.engine import EngineAsleepError


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def live_mib() -> float:
    return sum(a.nbytes for a in jax.live_arrays()) / 2**20


def report(stage: str) -> None:
    gc.collect()
    stats = jax.local_devices()[0].memory_stats() or {}
    in_use = stats.get("bytes_in_use")
    device = "" if in_use is None else f", device bytes in use {in_use / 2**20:8.1f} MiB"
    print(f"{stage:28s} RSS {rss_mib():8.1f} MiB, live JAX arrays {live_mib():8.1f} MiB{device}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-kv-blocks", type=int, default=512)
    cli = parser.parse_args()
    llm = LLM(
        max_model_len=256, max_num_seqs=8, num_kv_blocks=cli.num_kv_blocks, show_progress=False
    )
    sp = SamplingParams(temperature=0, max_tokens=8)
    before = llm.generate(["The capital of France is"], sp, use_tqdm=False)[0].outputs[0].text
    report("awake")
    freed = llm.sleep(level=1)
    print(f"sleep(level=1) freed {freed / 2**20:.1f} MiB of device arrays")
    report("asleep, level 1")
    try:
        llm.generate(["Hello"], sp, use_tqdm=False)
    except EngineAsleepError as e:
        print(f"generate while asleep: EngineAsleepError: {e}")
    llm.wake_up()
    report("awake again")
    llm.sleep(level=2)
    report("asleep, level 2")
    llm.wake_up()  # reloads the bundled model (or pass params)
    report("awake again (reloaded)")
    after = llm.generate(["The capital of France is"], sp, use_tqdm=False)[0].outputs[0].text
    print(f"same greedy output after the cycle: {before == after} ({after!r})")


if __name__ == "__main__":
    main()
