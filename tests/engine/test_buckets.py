"""Shape buckets: every step fits the smallest compiled shape that holds it, and the set of
shapes is small and known before serving (warm-up compiles exactly these)."""

from __future__ import annotations

import random

import pytest

from jaxpaged.sched.scheduler import ScheduledSeq
from jaxpaged.worker.buckets import Bucket, BucketSet

BUCKETS = BucketSet(max_num_seqs=48, max_num_batched_tokens=300, max_model_len=1000, block_size=16)


def _seq(n_tokens: int) -> ScheduledSeq:
    return ScheduledSeq(
        request_id="r",
        seq_id=0,
        token_ids=(1,) * n_tokens,
        prev_row=-1,
        start_pos=0,
    )


def test_ladders_end_at_the_limits():
    assert BUCKETS.decode_seqs == (1, 2, 4, 8, 16, 32, 48)
    assert BUCKETS.mixed_tokens == (16, 32, 64, 128, 256, 300)
    assert BUCKETS.full_blocks == 63  # ceil(1000 / 16)
    assert len(BUCKETS.all()) == 7 + 6


def test_decode_steps_pick_the_smallest_sequence_bucket():
    for n, want in [(1, 1), (3, 4), (8, 8), (9, 16), (33, 48), (48, 48)]:
        assert BUCKETS.pick([_seq(1)] * n) == Bucket(want, want, 63, True)


def test_mixed_steps_hold_all_tokens_and_sequences():
    rng = random.Random()
    for _ in range(200):
        seqs = [_seq(rng.randint(1, 40)) for _ in range(rng.randint(1, 12))]
        if all(s.num_tokens == 1 for s in seqs) or sum(s.num_tokens for s in seqs) > 300:
            continue
        b = BUCKETS.pick(seqs)
        assert not b.decode_only and b in BUCKETS.all()
        assert b.num_tokens >= sum(s.num_tokens for s in seqs) and b.num_seqs >= len(seqs)
        smaller = [t for t in BUCKETS.mixed_tokens if t < b.num_tokens]
        assert not smaller or smaller[-1] < sum(s.num_tokens for s in seqs)


def test_more_tokens_than_the_budget_is_an_error():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        BUCKETS.pick([_seq(200), _seq(101)])
