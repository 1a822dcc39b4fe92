"""The scheduler under overlapped steps (plan step k before step k-1's tokens are known) and
its penalty rows, against the hand-computable FakeRunner."""

from __future__ import annotations

import pytest
from fake_runner import reference_output, run
from test_scheduler import assert_all_free, make, make_request


def test_overlapped_decodes_read_the_unseen_token_from_the_device():
    """Planned before the previous step's tokens are known, each decode feeds the previous
    step's sampled row; the outputs are the reference's, and no step is planned past
    max_tokens (the last token in flight already ends the request)."""
    sched, runner = make()
    prompt = [3, 1, 4, 1, 5]
    sched.add_request(make_request("a", prompt, max_tokens=6))
    plans = []
    done = run(sched, runner, overlap=True, on_step=lambda plan, ups: plans.append(plan))
    assert done == {"a": reference_output(prompt, 6)}
    seqs = [s for p in plans for s in p.seqs]
    assert sum(s.do_sample for s in seqs) == 6
    assert seqs[0].prev_row == -1 and seqs[0].token_ids == tuple(prompt)
    for s in seqs[1:]:  # every decode: the host had not seen its input yet
        assert s.prev_row == 0 and s.token_ids == (0,) and s.num_tokens == 1
    assert_all_free(sched)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_stop_token_ends_the_request_exactly_under_overlap(overlap):
    prompt = [4, 5, 6]
    ref = reference_output(prompt, 10)
    sched, runner = make()
    sched.add_request(make_request("s", prompt, max_tokens=10, stop_token_ids=[ref[2]]))
    sched.add_request(make_request("other", prompt, max_tokens=10))
    plans = []
    done = run(sched, runner, overlap=overlap, on_step=lambda plan, ups: plans.append(plan))
    assert done == {"s": ref[:3], "other": ref}
    sampled = sum(s.do_sample for p in plans for s in p.seqs if s.request_id == "s")
    # overlapped, the step after the stop token was already planned: its token is dropped
    assert sampled == (4 if overlap else 3)
    assert_all_free(sched)


def test_penalty_rows_are_handed_out_filled_and_reused():
    sched, runner = make(max_num_seqs=2, num_blocks=6, block_size=4, budget=64)
    pen = dict(repetition_penalty=1.2)
    sched.add_request(make_request("p0", [1, 2, 3, 4, 5], max_tokens=8, **pen))
    sched.add_request(make_request("plain", [6, 7], max_tokens=2))
    sched.add_request(make_request("p1", [8, 9], max_tokens=3, frequency_penalty=0.5))
    inits, rows_in_use = [], []
    state_row = {}  # request id -> its state row, as the plan that brought it in said

    def on_step(plan, ups):
        inits.extend(plan.state_rows_to_init)
        state_row.update((d.request_id, d.state_row) for d in plan.new_requests)
        rows = [state_row[s.request_id] for s in plan.seqs if s.do_sample]
        rows_in_use.append(sorted(r for r in rows if r >= 0))
        for s in plan.seqs:
            if s.do_sample and s.request_id == "plain":
                assert state_row[s.request_id] == -1

    done = run(sched, runner, on_step=on_step)
    assert set(done) == {"p0", "plain", "p1"}
    assert all(0 <= i.row < 2 for i in inits)
    by_prompt = {i.prompt_token_ids: i for i in inits}
    assert by_prompt[(1, 2, 3, 4, 5)].output_token_ids == ()
    assert (8, 9) in by_prompt  # p1 got a row once "plain" left
    assert all(len(set(r)) == len(r) for r in rows_in_use)  # never two requests on one row
    assert sorted(sched._free_state_rows) == [0, 1]
    assert_all_free(sched)


def test_a_preempted_request_gets_its_penalty_row_back_with_its_output():
    sched, runner = make(num_blocks=4, block_size=4, max_num_seqs=2, budget=64)
    sched.add_request(make_request("a", [1, 2, 3, 4, 5, 6], max_tokens=9))
    sched.add_request(make_request("b", [7, 8, 9], max_tokens=9, presence_penalty=0.3))
    inits = []
    done = run(sched, runner, on_step=lambda plan, ups: inits.extend(plan.state_rows_to_init))
    assert sched.stats.num_preemptions > 0
    assert done == {
        "a": reference_output([1, 2, 3, 4, 5, 6], 9),
        "b": reference_output([7, 8, 9], 9),
    }
    b_inits = [i for i in inits if i.prompt_token_ids == (7, 8, 9)]
    assert len(b_inits) >= 2 and b_inits[0].output_token_ids == ()
    resumed = b_inits[1]
    assert resumed.output_token_ids == tuple(
        reference_output([7, 8, 9], len(resumed.output_token_ids))
    )
    assert len(resumed.output_token_ids) > 0
    assert_all_free(sched)


def test_min_tokens_alone_takes_a_state_row_with_its_held_back_ids():
    sched, runner = make()
    r = make_request("m", [1, 2, 3], max_tokens=6, min_tokens=2, stop_token_ids=[9, 4])
    r.eos_token_ids = (4, 5)
    sched.add_request(r)
    sched.add_request(make_request("i", [1, 2], max_tokens=3, min_tokens=1, ignore_eos=True))
    inits = []
    run(sched, runner, on_step=lambda plan, ups: inits.extend(plan.state_rows_to_init))
    by_prompt = {i.prompt_token_ids: i for i in inits}
    m, i = by_prompt[(1, 2, 3)], by_prompt[(1, 2)]
    assert m.min_tokens == 2 and m.banned_ids == (4, 5, 9)  # EOS and stop ids, sorted
    assert i.min_tokens == 1 and i.banned_ids == ()  # ignore_eos, no stop ids
    assert_all_free(sched)
