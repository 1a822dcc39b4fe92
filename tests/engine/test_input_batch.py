"""The runner's persistent batch (jaxpaged.worker.input_batch) against hand-computed rows:
adding a request, appending and replacing block ids, dropping it, preempting and resuming it,
and the padded step inputs it builds (checked against the per-step rebuild of the sampling
settings, build_sampling_tensors)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from jaxpaged.sampling_params import SamplingParams
from jaxpaged.sched.output import NewRequestData, ScheduledSeq, SchedulerOutput
from jaxpaged.worker import sampler
from jaxpaged.worker.buckets import Bucket
from jaxpaged.worker.input_batch import InputBatch, PersistentBatch

GREEDY = SamplingParams(temperature=0.0)


def new(rid: str, seq_id: int = 0, params: SamplingParams = GREEDY, **kw) -> NewRequestData:
    return NewRequestData(request_id=rid, seq_id=seq_id, params=params, key_stream=seq_id, **kw)


def seq(rid: str, start: int, tokens: tuple[int, ...], **kw) -> ScheduledSeq:
    return ScheduledSeq(
        request_id=rid, seq_id=0, token_ids=tokens, prev_row=-1, start_pos=start, **kw
    )


def new_row(params, key_stream, key_counter):
    return SimpleNamespace(
        params=params, key_stream=key_stream, key_counter=key_counter, state_row=-1
    )


def test_add_append_replace_and_remove():
    b = PersistentBatch(max_rows=3, max_blocks=4)
    assert b.add(new("a")) == 0 and b.add(new("b")) == 1
    b.set_blocks("a", 0, (5, 6))
    assert b.block_table("a").tolist() == [5, 6]
    b.set_blocks("a", 2, (9,))  # a new block appended
    assert b.block_table("a").tolist() == [5, 6, 9]
    b.set_blocks("a", 1, (7, 9))  # copy-on-write: entry 1 replaced, the rest resent
    assert b.block_table("a").tolist() == [5, 7, 9]
    assert b.block_tables[0].tolist() == [5, 7, 9, 0]
    assert b.block_tables[1].tolist() == [0, 0, 0, 0] and b.block_table("b").tolist() == []
    assert b.entries_written == 2 + 1 + 2
    b.remove("a")  # its row is cleared and free again
    assert "a" not in b and len(b) == 1
    assert b.block_tables[0].tolist() == [0, 0, 0, 0] and b.num_blocks[0] == 0
    assert b.entries_written == 5 + 3
    assert b.add(new("c")) == 0
    b.remove("unknown")  # ended while waiting: never joined, nothing to do
    assert b.block_tables[b.padding_row].tolist() == [0, 0, 0, 0]


def test_bad_changes_are_refused_by_name():
    b = PersistentBatch(max_rows=1, max_blocks=2)
    with pytest.raises(RuntimeError, match="not in the batch"):
        b.set_blocks("a", 0, (1,))
    b.add(new("a"))
    with pytest.raises(RuntimeError, match="do not extend"):
        b.set_blocks("a", 1, (1,))  # a gap: entry 0 was never set
    with pytest.raises(RuntimeError, match="do not extend"):
        b.set_blocks("a", 0, (1, 2, 3))  # wider than the table
    with pytest.raises(RuntimeError, match="batch is full"):
        b.add(new("b"))
    with pytest.raises(ValueError, match="max_rows"):
        PersistentBatch(max_rows=0, max_blocks=2)


def test_plans_preempt_and_resume():
    """update() drops, then adds, then applies the block changes: a request preempted in one
    plan and resumed in a later one (its whole, shorter table sent again) ends with exactly
    that table; a request that reuses a finished one's id in the same plan starts clean."""
    b = PersistentBatch(max_rows=2, max_blocks=4)
    b.update(
        SchedulerOutput(
            seqs=(
                seq("a", 0, (1,) * 9, new_block_ids=(4, 5, 6)),
                seq("b", 0, (2,), new_block_ids=(7,)),
            ),
            new_requests=(new("a"), new("b", 1)),
        )
    )
    assert b.block_table("a").tolist() == [4, 5, 6] and b.rows == {"a": 0, "b": 1}
    b.update(SchedulerOutput(seqs=(seq("b", 1, (3,)),)))  # no block change
    assert b.block_table("b").tolist() == [7]
    b.update(SchedulerOutput(preempted_request_ids=("a",)))
    assert "a" not in b and b.block_tables[0].tolist() == [0, 0, 0, 0]
    b.update(  # resumed (recompute): new blocks, whole table
        SchedulerOutput(
            seqs=(seq("a", 0, (1,) * 5, new_block_ids=(8, 9)),), new_requests=(new("a"),)
        )
    )
    assert b.block_table("a").tolist() == [8, 9] and b.block_tables[0].tolist() == [8, 9, 0, 0]
    b.update(
        SchedulerOutput(
            seqs=(seq("b", 0, (5,), new_block_ids=(3,)),),
            new_requests=(new("b", 7),),
            finished_request_ids=("b",),
        )
    )
    assert b.block_table("b").tolist() == [3] and b.requests["b"].seq_id == 7


def test_prepare_pads_a_mixed_step_by_hand():
    """A decode of "a" (block size 4, table [3, 8], position 5) beside a 3-token prefill chunk
    of "b" (table [5]) that does not sample, in a bucket of 8 tokens and 4 sequences."""
    key = sampler.seed_to_key_data(11)
    hot = SamplingParams(temperature=0.7, top_k=5, logprobs=2)
    batch = InputBatch(max_rows=3, max_blocks=4, block_size=4, vocab_size=50, engine_key_data=key)
    a = seq("a", 5, (42,), new_block_ids=(3, 8), key_counter=6)
    b = seq("b", 0, (1, 2, 3), new_block_ids=(5,), prompt_targets=(2, 3), prompt_top_k=1)
    batch.update(SchedulerOutput(seqs=(a, b), new_requests=(new("a", 4, hot), new("b", 5))))
    step, failed = batch.prepare([a, b], Bucket(8, 4, 4, False))
    assert failed == {}
    assert step.tokens.tolist() == [42, 1, 2, 3, 0, 0, 0, 0]
    assert step.positions.tolist() == [5, 0, 1, 2, 0, 0, 0, 0]
    assert step.slot_mapping.tolist() == [8 * 4 + 1, 20, 21, 22, -1, -1, -1, -1]
    assert step.prev_rows.tolist() == [-1] * 8
    assert step.kv_lens.tolist() == [6, 3, 0, 0]
    assert step.cu_q_lens.tolist() == [0, 1, 4, 4, 4]
    assert step.num_seqs.tolist() == [2] and step.sample_rows.tolist() == [0, 3, 0, 0]
    assert step.block_tables.tolist() == [[3, 8, 0, 0], [5, 0, 0, 0], [0] * 4, [0] * 4]
    assert step.prompt_targets.tolist() == [-1, 2, 3, -1, -1, -1, -1, -1]
    assert step.lora_slots is None
    assert batch.logprobs_wanted([a, b]) == (2, None)
    # the sampling rows equal a per-step rebuild from the same settings
    ref, _ = sampler.build_sampling_tensors(
        [new_row(hot, 4, 6), None], 4, vocab_size=50, engine_key_data=key
    )
    for name, got, want in zip(ref._fields, step.sampling, ref, strict=True):
        np.testing.assert_array_equal(got, want, err_msg=name)
    # every step array is the step's own: the persistent rows never reach a dispatched step
    for arr in (step.block_tables, *step.sampling[:-1]):
        assert not np.shares_memory(arr, batch.block_tables)
        assert not any(np.shares_memory(arr, p) for p in batch.sampling)


def test_prepare_decode_fed_from_the_device_and_lora_slots():
    batch = InputBatch(
        max_rows=2,
        max_blocks=2,
        block_size=2,
        vocab_size=8,
        engine_key_data=np.zeros(2, np.uint32),
        lora=True,
    )
    batch.update(
        SchedulerOutput(
            seqs=(seq("a", 0, (1, 2, 3), new_block_ids=(6, 1)),),
            new_requests=(new("a", lora_slot=2),),
        )
    )
    d = ScheduledSeq(
        request_id="a", seq_id=0, token_ids=(0,), prev_row=3, start_pos=3, key_counter=1
    )
    step, _ = batch.prepare([d], Bucket(1, 1, 2, True))
    assert (step.tokens.tolist(), step.prev_rows.tolist()) == ([0], [3])
    assert step.slot_mapping.tolist() == [1 * 2 + 1] and step.lora_slots.tolist() == [2]
    assert step.sampling.key_counter.tolist() == [1]


def test_a_refused_row_samples_as_padding_and_fails_alone():
    """Settings that cannot be filled (min_tokens without a sampler-state row) are refused
    once, when the request joins; each step it samples in names it as failed and rides as a
    padding row, the others unaffected."""
    batch = InputBatch(
        max_rows=2,
        max_blocks=2,
        block_size=4,
        vocab_size=10,
        engine_key_data=np.zeros(2, np.uint32),
    )
    bad = SamplingParams(temperature=0.5, min_tokens=2, stop_token_ids=[3])
    good = SamplingParams(temperature=0.25)
    a = seq("a", 0, (1,), new_block_ids=(0,), key_counter=0)
    b = seq("b", 0, (2,), new_block_ids=(1,), key_counter=0)
    batch.update(SchedulerOutput(seqs=(a, b), new_requests=(new("a", 0, bad), new("b", 1, good))))
    mask = np.zeros(1, np.int32)
    step, failed = batch.prepare([a, b], Bucket(2, 2, 2, True), {0: mask, 1: mask})
    assert set(failed) == {0} and "no state row" in failed[0]
    assert step.sampling.temperature.tolist() == [0.0, 0.25]
    assert step.sampling.allowed.tolist() == [[-1], [0]]  # the refused row's mask is dropped
    # a later request in the same row starts clean
    batch.update(SchedulerOutput(finished_request_ids=("a",)))
    batch.update(SchedulerOutput(seqs=(a,), new_requests=(new("a", 2, good),)))
    assert batch.prepare([a], Bucket(1, 1, 2, True))[1] == {}
