"""How the pooling runner cuts inputs into padded batches (hand-checked cases)."""

from __future__ import annotations

import random

from jaxpaged.worker.pooling_runner import PoolingBuckets, plan_batches


def test_buckets_and_batches():
    b = PoolingBuckets.for_limits(max_len=100, max_rows=16, max_tokens=512)
    assert b.lengths == (8, 16, 32, 64, 100)
    assert b.rows_for(8) == (1, 2, 4, 8, 16) and b.rows_for(64) == (1, 2, 4, 8)
    assert b.rows_for(100) == (1, 2, 4)  # 8 x 100 > 512
    # inputs of one length bucket batch together; a long one does not pad the short ones
    assert plan_batches([3, 40, 5], b) == [([1], 1, 64), ([2, 0], 2, 8)]
    # 3 rows: a 4-row batch would pad a third of them, so 2 + 1
    assert plan_batches([9, 10, 9], b) == [([1, 0], 2, 16), ([2], 1, 16)]
    # 7 rows pad one row of 8; 20 short ones fill 16, then 4
    assert plan_batches([5] * 7, b) == [(list(range(7)), 8, 8)]
    assert [(len(i), r) for i, r, _ in plan_batches([5] * 20, b)] == [(16, 16), (4, 4)]


def test_every_input_once_in_the_smallest_length_bucket():
    b = PoolingBuckets.for_limits(max_len=128, max_rows=256, max_tokens=8192)
    rng = random.Random(0)
    lengths = [rng.randint(1, 128) for _ in range(500)]
    plan = plan_batches(lengths, b)
    assert sorted(i for chosen, _, _ in plan for i in chosen) == list(range(500))
    for chosen, rows, length in plan:
        assert len(chosen) <= rows and rows * length <= b.max_tokens
        assert length == b.length_for(max(lengths[i] for i in chosen))
        assert rows - len(chosen) <= len(chosen) // 4
