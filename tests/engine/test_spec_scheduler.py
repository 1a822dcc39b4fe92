"""Speculative decoding on the host: the n-gram proposer against a brute-force search, and
the scheduler's drafting, verification bookkeeping and rollback against a hand-computable
fake model (no JAX). The fake verifies drafts as the step does (the target's token after
each fed token; the longest matching prefix plus one), checks that every fed token's K/V
sits in its slot, and outputs must equal the model run one token at a time: batched, with
chunked prefill, prefix caching, both preemption modes, stop tokens and max_tokens inside
an accepted run. After every step the block pool holds exactly the blocks of the computed
tokens (rejected drafts' slots are given back); after the last, nothing."""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import pytest
from fake_runner import check_invariants, make_request

from jaxpaged.config import CacheConfig, SchedulerConfig
from jaxpaged.engine.testing import FakeDeviceAdmin
from jaxpaged.sched.output import RunnerOutput, SchedulerOutput
from jaxpaged.sched.scheduler import Scheduler
from jaxpaged.spec import NgramProposer, SpeculativeConfig
from jaxpaged.worker.input_batch import PersistentBatch

K = 3
VOCAB = 50


def model(tokens: Sequence[int]) -> int:
    """The fake target: mostly copies the token 5 back (n-gram lookup guesses it), every
    7th position something else (drafts get rejected)."""
    n = len(tokens)
    return tokens[-5] if n % 7 and n >= 5 else (sum(tokens) + n) % VOCAB


def reference(prompt, max_tokens, stop_ids=()) -> list[int]:
    seq, out = list(prompt), []
    while len(out) < max_tokens:
        t = model(seq)
        seq.append(t)
        out.append(t)
        if t in stop_ids:
            break
    return out


def brute_force_propose(tokens, lo, hi, k):
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        tail = tokens[-n:]
        starts = [i for i in range(len(tokens) - n) if tokens[i : i + n] == tail]
        full = [i for i in starts if i + n + k <= len(tokens)]
        if starts:
            s = (full[-1] if full else starts[0]) + n
            return tuple(tokens[s : s + k])
    return ()


def test_ngram_proposer_matches_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        k = rng.randint(1, 5)
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 40))]
        got = NgramProposer(min_n=lo, max_n=hi, k=k).propose(tokens)
        assert got == brute_force_propose(tokens, lo, hi, k), (tokens, lo, hi, k)
    assert NgramProposer(min_n=2, max_n=3, k=4).propose([1, 2, 3, 9, 1, 2]) == (3, 9, 1, 2)
    assert NgramProposer(min_n=2, max_n=3, k=4).propose([1, 2, 3, 4]) == ()


class SpecFakeRunner(FakeDeviceAdmin):
    """Runs plans at once on a token-id "KV cache" (one slot per block offset), verifying
    drafts with :func:`model`."""

    def __init__(self, sched: Scheduler, num_blocks: int, num_host_blocks: int) -> None:
        self.sched = sched
        bs = self.bs = sched.block_size
        self.dev = np.full((num_blocks, bs), -1, np.int64)
        self.host = np.full((max(num_host_blocks, 1), bs), -1, np.int64)
        cfg = sched.config
        self.batch = PersistentBatch(
            max_rows=cfg.max_num_seqs, max_blocks=-(-cfg.max_model_len // bs)
        )

    def dispatch(self, plan: SchedulerOutput, allowed=None) -> RunnerOutput:
        for d, h in plan.blocks_to_swap_out:
            self.host[h] = self.dev[d]
        for h, d in plan.blocks_to_swap_in:
            self.dev[d] = self.host[h]
        srcs, dsts = [s for s, _ in plan.blocks_to_copy], [d for _, d in plan.blocks_to_copy]
        self.dev[dsts] = self.dev[srcs]
        self.batch.update(plan)
        flat, bs = self.dev.reshape(-1), self.bs
        sampled, spec = [], []
        for s in plan.seqs:
            table = self.batch.block_table(s.request_id)
            assert tuple(table.tolist()) == self.sched.pool.block_table(s.request_id)
            assert len(table) == -(-s.kv_len // bs)
            assert s.prev_row < 0 or not s.num_draft_tokens
            pos = np.arange(s.kv_len)
            slots = table[pos // bs] * bs + pos % bs
            flat[slots[s.start_pos :]] = s.token_ids
            cached = flat[slots].tolist()
            req = self.sched.requests[s.request_id]
            known = req.all_token_ids
            assert cached[: len(known)] == known[: s.kv_len], f"{s.request_id}: wrong K/V"
            if not s.do_sample:
                sampled.append(-1)
                spec.append(None)
                continue
            d = s.num_draft_tokens
            base = cached[: s.kv_len - d]
            drafts = cached[s.kv_len - d :]
            targets = [model(base + drafts[:j]) for j in range(d + 1)]
            a = 0
            while a < d and drafts[a] == targets[a]:
                a += 1
            sampled.append(targets[0])
            spec.append(targets[: a + 1] if d else None)
        return RunnerOutput(sampled_token_ids=sampled, spec_token_ids=spec)

    def collect(self, pending):
        return pending or RunnerOutput(sampled_token_ids=())

    def execute(self, plan):
        return self.dispatch(plan)


def _run(sched, runner, *, overlap: bool) -> dict[str, list[int]]:
    done, in_flight = {}, None

    def finish(plan, out):
        updates = sched.update(plan, out)
        check_invariants(sched)  # running requests hold exactly their computed tokens' blocks
        for u in updates:
            done.setdefault(u.request_id, []).extend(u.new_token_ids)

    for _ in range(2000):
        if not sched.has_unfinished_requests() and in_flight is None:
            return done
        plan = sched.schedule()
        out = runner.dispatch(plan)
        if not overlap:
            finish(plan, out)
            continue
        if in_flight is not None:
            finish(*in_flight)
        in_flight = (plan, out) if plan.seqs else None
    raise AssertionError("did not finish")


@pytest.mark.parametrize(
    ("mode", "num_blocks", "prefix", "overlap"),
    [
        ("recompute", 200, True, True),  # roomy pool, prefix caching
        ("recompute", 18, False, True),  # preempts, recomputes
        ("swap", 18, True, False),  # preempts to host slots
    ],
)
def test_speculative_outputs_equal_one_token_at_a_time(mode, num_blocks, prefix, overlap):
    rng = random.Random(num_blocks)
    cfg = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=16, max_model_len=96, preemption_mode=mode
    )
    sched = Scheduler(
        cfg,
        CacheConfig(block_size=4, enable_prefix_caching=prefix),
        num_blocks=num_blocks,
        num_host_blocks=64,
        speculative_config=SpeculativeConfig(
            num_speculative_tokens=K, prompt_lookup_min=1, prompt_lookup_max=3
        ),
    )
    runner = SpecFakeRunner(sched, num_blocks, 64)
    shared = [rng.randrange(VOCAB) for _ in range(12)]  # a common prefix: cache hits
    cases = {}
    for i in range(8):
        prompt = shared + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 14))]
        max_tokens = rng.randint(5, 30)
        out = reference(prompt, max_tokens)
        # a stop token met inside the output: it may end a run of accepted drafts
        stop = (out[len(out) // 2],) if i % 3 == 0 else ()
        cases[f"r{i}"] = (prompt, max_tokens, stop)
        sched.add_request(
            make_request(f"r{i}", prompt, max_tokens, stop_token_ids=list(stop), ignore_eos=True)
        )
    got = _run(sched, runner, overlap=overlap)
    for rid, (prompt, max_tokens, stop) in cases.items():
        assert got[rid] == reference(prompt, max_tokens, stop), rid
    st = sched.stats
    assert 0 < st.spec_num_accepted_tokens < st.spec_num_draft_tokens  # accepts and rejects
    assert sum(st.spec_accepted_per_pos) == st.spec_num_accepted_tokens
    assert st.spec_accepted_per_pos[0] >= st.spec_accepted_per_pos[-1]
    if num_blocks < 20:
        assert st.num_preemptions > 0
    if prefix:
        assert st.prefix_cache_hits > 0
    assert sched.pool.num_free_blocks == num_blocks and not sched.pool.tracked_request_ids()


def test_stop_and_max_tokens_inside_an_accepted_run():
    """The runner may return more tokens than the request may keep: those after a stop
    token, or past max_tokens, are dropped and the request ends there, its blocks freed."""
    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64)
    sched = Scheduler(
        cfg,
        CacheConfig(block_size=4),
        num_blocks=32,
        speculative_config=SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1),
    )
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    sched.add_request(make_request("eos", prompt, 20, stop_token_ids=[9], ignore_eos=True))
    sched.add_request(make_request("len", prompt, 3, ignore_eos=True))
    prefill = sched.schedule()
    sched.update(prefill, RunnerOutput(sampled_token_ids=[3, 3]))
    plan = sched.schedule()
    assert [s.num_draft_tokens for s in plan.seqs] == [4, 1]  # max_tokens caps the drafts
    spec = [[1, 9, 3, 1, 2], [1, 2]]  # eos: 2 drafts accepted, then the stop token
    updates = sched.update(plan, RunnerOutput(sampled_token_ids=[1, 1], spec_token_ids=spec))
    by_id = {u.request_id: u for u in updates}
    assert by_id["eos"].new_token_ids == (1, 9) and by_id["eos"].finish_reason == "stop"
    assert by_id["len"].new_token_ids == (1, 2) and by_id["len"].finish_reason == "length"
    assert not sched.has_unfinished_requests()
    assert sched.pool.num_free_blocks == 32 and not sched.pool.tracked_request_ids()
    # a runner's longer run is cut at max_tokens too (not only capped by the drafts)
    sched.add_request(make_request("cut", prompt, 2, ignore_eos=True))
    plan = sched.schedule()
    sched.update(plan, RunnerOutput(sampled_token_ids=[3]))
    plan = sched.schedule()
    out = RunnerOutput(sampled_token_ids=[1], spec_token_ids=[[1, 2, 3]])
    (u,) = sched.update(plan, out)
    assert u.new_token_ids == (1,) and u.finish_reason == "length"
    assert sched.pool.num_free_blocks == 32


def test_verify_buckets():
    """Steps of decodes with drafts run in S * (K + 1)-row buckets (max_q_len K + 1), not in
    the mixed ladder's; one with a prefill chunk does not."""
    from jaxpaged.sched.output import ScheduledSeq
    from jaxpaged.worker.buckets import BucketSet

    buckets = BucketSet(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64,
                        block_size=4, num_speculative_tokens=3)  # fmt: skip

    def seq(i, n, d, sample=True):
        return ScheduledSeq(request_id=f"r{i}", seq_id=i, token_ids=(1,) * n, prev_row=-1,
                            start_pos=0, key_counter=0 if sample else -1, num_draft_tokens=d)  # fmt: skip

    assert buckets.verify_seqs == (1, 2, 4, 8)
    b = buckets.pick([seq(0, 4, 3)])
    assert (b.num_tokens, b.num_seqs, b.max_q_len, b.decode_only) == (4, 1, 4, False)
    b = buckets.pick([seq(0, 4, 3), seq(1, 1, 0), seq(2, 3, 2)])
    assert (b.num_tokens, b.num_seqs, b.max_q_len) == (16, 4, 4)
    assert buckets.pick([seq(0, 1, 0), seq(1, 1, 0)]).decode_only  # no drafts: decode bucket
    b = buckets.pick([seq(0, 4, 3), seq(1, 4, 0, sample=False)])  # a prefill chunk: mixed
    assert b.max_q_len is None and b.num_tokens == 16
    assert set(buckets.all()) >= {buckets.pick([seq(i, 4, 3) for i in range(n)]) for n in (1, 3, 8)}


def test_disable_by_batch_size():
    """No drafts while more requests than disable_by_batch_size run (they overlap as
    without speculation); drafts again once fewer run."""
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    spec = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=1, disable_by_batch_size=1)
    sched = Scheduler(cfg, CacheConfig(block_size=4), num_blocks=64, speculative_config=spec)
    prompt = [1, 2, 1, 2, 1]
    sched.add_request(make_request("a", prompt, 20, ignore_eos=True))
    sched.add_request(make_request("b", prompt, 2, ignore_eos=True))
    sched.update(sched.schedule(), RunnerOutput(sampled_token_ids=[2, 2]))
    plan = sched.schedule()  # two running: plain decodes
    assert [s.num_draft_tokens for s in plan.seqs] == [0, 0]
    sched.update(plan, RunnerOutput(sampled_token_ids=[1, 1]))  # b reaches max_tokens
    plan = sched.schedule()
    assert [s.num_draft_tokens for s in plan.seqs] == [2]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_structured_output_requests_draft(method):
    """A structured-output request drafts with n-gram (its tokens are on the host, where the
    engine's grammar masks each verified position) and with drafts made on the device (the
    runner reads them back for the masks: jaxpaged.worker.spec_grammar), once its last
    token is no longer in flight."""
    from jaxpaged.sampling_params import StructuredOutput

    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    spec = SpeculativeConfig(method=method, num_speculative_tokens=2, disable_by_batch_size=4,
                             **({"prompt_lookup_min": 1} if method == "ngram" else {"model": "d"}))  # fmt: skip
    sched = Scheduler(cfg, CacheConfig(block_size=4), num_blocks=64, speculative_config=spec)
    so = StructuredOutput(regex="[0-9]+")
    sched.add_request(make_request("g", [1, 2, 1, 2, 1], 20, structured_output=so))
    sched.update(sched.schedule(), RunnerOutput(sampled_token_ids=[2]))
    (seq,) = sched.schedule().seqs
    assert seq.num_draft_tokens == 2
