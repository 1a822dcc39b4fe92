"""KV memory waste of the paged cache on a mixed workload, against contiguous reservation.

Waste is what the paged cache bounds (docs/architecture.md): 1 - tokens stored / slots of allocated blocks,
averaged over steps (the engine's ``kv_cache_waste`` metric). A contiguous cache reserves
``max_model_len`` slots per running request, so its waste is 1 - tokens / (n * max_model_len).
"""

from __future__ import annotations

import numpy as np
from fake_runner import FakeRunner, make_request

from jaxpaged.config import CacheConfig, SchedulerConfig
from jaxpaged.sched.scheduler import Scheduler

MAX_MODEL_LEN = 2048


def _mixed_workload(rng: np.random.Generator, n: int) -> list[tuple[list[int], int]]:
    """Chat-like: prompts of 100-800 tokens, outputs of 16-512 tokens."""
    return [
        (
            rng.integers(1, 1000, size=int(rng.integers(100, 800))).tolist(),
            int(rng.integers(16, 512)),
        )
        for _ in range(n)
    ]


def test_paged_waste_under_4_percent_against_contiguous_reservation():
    rng = np.random.default_rng()
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=2048, max_model_len=MAX_MODEL_LEN),
        CacheConfig(block_size=16, enable_prefix_caching=False),
        num_blocks=4096,
    )
    runner = FakeRunner(4096, 16, scheduler=sched)
    for i, (prompt, max_tokens) in enumerate(_mixed_workload(rng, 32)):
        sched.add_request(make_request(f"r{i}", prompt, max_tokens, ignore_eos=True))
    paged, contiguous = [], []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sched.update(out, runner.execute(out))
        if sched.running:
            paged.append(sched.kv_cache_waste())
            stored = sum(r.num_computed_tokens for r in sched.running)
            contiguous.append(1 - stored / (len(sched.running) * MAX_MODEL_LEN))
    paged_waste, contiguous_waste = float(np.mean(paged)), float(np.mean(contiguous))
    print(
        f"\nKV waste, mean over {len(paged)} steps: paged (block 16) {paged_waste:.2%}, "
        f"contiguous max_model_len={MAX_MODEL_LEN} reservation {contiguous_waste:.2%}"
    )
    assert paged_waste < 0.04
    assert contiguous_waste > 0.5
    assert sched.pool.num_free_blocks == 4096
