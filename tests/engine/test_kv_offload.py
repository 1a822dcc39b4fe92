"""The prefix cache's host tier (``kv_offloading_size``) on a real engine: a tiny random Qwen2
whose device pool holds one max_model_len sequence, and a multi-turn agent replay of three
conversations that together need about twice that. The tiered engine's greedy tokens equal
those of the same engine without a tier, some prompt tokens come back from the tier, the tier
stays within its size, and no device block or host slot is left held after any test."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.config import GiB
from jaxpaged.engine import LLMEngine
from jaxpaged.models.testing import random_params, tiny_config

CFG = tiny_config(head_dim=16)
BLOCK = 8
NUM_BLOCKS = 16  # one sequence of max_model_len
TIER_BLOCKS = 12  # fewer than the replay offloads: the tier must evict
OPTS = dict(
    attention_backend="xla", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
    num_kv_blocks=NUM_BLOCKS, block_size=BLOCK, show_progress=False,
    max_prefill_tokens_with_decodes=32,  # the whole budget: no prefill cap to time at start
)  # fmt: skip
# the sampled token's logprob too: a wrong K/V block changes it even where the argmax of
# this tiny random model survives
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)


def _block_bytes() -> int:
    # float32 K and V of every layer
    return 2 * CFG.num_layers * BLOCK * CFG.num_kv_heads * CFG.head_dim * 4


@pytest.fixture(scope="module")
def params():
    return jax.tree.map(jnp.asarray, random_params(CFG))


@pytest.fixture(scope="module")
def plain(params):
    engine = LLMEngine.from_params(CFG, params, enforce_eager=True, **OPTS)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def tiered(params):
    """Warmed up (the tier's block moves included), so serving must not compile; preempted
    requests swap (the same host-copy path as the tier's), the plain engine's recompute."""
    size = TIER_BLOCKS * _block_bytes() / GiB
    engine = LLMEngine.from_params(
        CFG, params, kv_offloading_size=size, preemption_mode="swap", swap_space=size, **OPTS
    )
    assert engine.scheduler.pool.tier.num_slots == TIER_BLOCKS
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def disk(params, tmp_path_factory):
    """A 4-block host tier with a 64-block disk tier behind it (eager: cheap to build)."""
    engine = LLMEngine.from_params(
        CFG,
        params,
        enforce_eager=True,
        kv_offloading_size=4 * _block_bytes() / GiB,
        kv_offloading_disk_dir=str(tmp_path_factory.mktemp("kv-disk")),
        kv_offloading_disk_size=64 * _block_bytes() / GiB,
        **OPTS,
    )
    yield engine
    engine.close()


@pytest.fixture(autouse=True)
def _nothing_held(request):
    """After every test: every device block free, no request id left in the pool, no swap
    slot in use, and the runner's tier copies exactly the slots the tier maps (<= its size)."""
    yield
    for name in ("plain", "tiered", "disk"):
        if name not in request.fixturenames:
            continue
        engine = request.getfixturevalue(name)
        assert not engine.has_unfinished_requests()
        pool, runner = engine.scheduler.pool, engine.runner
        stats = engine.get_stats()
        assert stats.num_free_blocks == stats.num_kv_blocks == NUM_BLOCKS
        assert pool.tracked_request_ids() == set()
        assert runner.num_host_blocks_in_use == 0
        if pool.tier is not None:
            slots = {pool.tier.slot(k) for k in pool.tier.keys()}
            assert len(slots) == len(pool.tier) <= pool.tier.num_slots
            assert set(runner.moves.tier_blocks) == slots
        if pool.disk is not None:
            assert len(pool.disk) <= pool.disk.num_slots
            files = {f"block-{pool.disk.slot(k)}.kv" for k in pool.disk.keys()}
            assert files <= set(os.listdir(runner.moves.disk_dir))


def _run(engine, prompts: dict[str, list[int]], logprobs: dict | None = None) -> dict:
    """Runs the prompts together; returns their tokens (and adds their logprobs to
    ``logprobs``)."""
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, GREEDY)
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    while engine.has_unfinished_requests():
        for out in engine.step():  # deltas
            tokens[out.request_id] += out.outputs[0].token_ids
            if logprobs is not None:
                lps = logprobs.setdefault(out.request_id, [])
                lps += [lp.logprob for lp in out.outputs[0].logprobs]
    assert all(len(t) == GREEDY.max_tokens for t in tokens.values())
    return tokens


def _assert_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for rid in want:
        np.testing.assert_allclose(got[rid], want[rid], rtol=0, atol=1e-4, err_msg=rid)


def _replay(engine, *, turns=4, convs=3, logprobs: dict | None = None) -> dict:
    """Each round resends every conversation's whole history plus a new user message."""
    rng = np.random.default_rng(7)
    history = {c: rng.integers(1, CFG.vocab_size, 20).tolist() for c in range(convs)}
    outputs = {}
    for t in range(turns):
        done = _run(engine, {f"c{c}t{t}": history[c] for c in range(convs)}, logprobs)
        for c in range(convs):
            out = done[f"c{c}t{t}"]
            outputs[f"c{c}t{t}"] = out
            history[c] = history[c] + out + rng.integers(1, CFG.vocab_size, 10).tolist()
    return outputs


def test_replay_is_token_identical_and_hits_the_tier(plain, tiered):
    """(The device pool holds 16 blocks; the three conversations reach ~27.) The tier is
    LRU-bounded to 12 blocks, evicts, and still gives back prompt tokens: more prefix hits
    than without it, with no compilation after warm-up."""
    got_lp, want_lp = {}, {}
    got = _replay(tiered, logprobs=got_lp)
    # read before the plain engine runs: its lazy compilations count process-wide
    assert tiered.get_stats().num_compilations_after_warmup == 0
    want = _replay(plain, logprobs=want_lp)
    assert got == want
    _assert_close(got_lp, want_lp)
    s, base = tiered.get_stats(), plain.get_stats()
    assert s.kv_offload_hits > 0 and s.kv_offload_blocks_loaded * BLOCK == s.kv_offload_hits
    assert s.kv_offload_blocks_stored > TIER_BLOCKS and tiered.scheduler.pool.tier.num_evictions
    assert s.kv_offload_bytes_stored == s.kv_offload_blocks_stored * _block_bytes()
    assert s.kv_offload_bytes_loaded == s.kv_offload_blocks_loaded * _block_bytes()
    assert s.kv_offload_num_blocks == s.kv_offload_capacity_blocks == TIER_BLOCKS
    assert s.prefix_cache_hits > base.prefix_cache_hits
    m = LLM.from_engine(tiered).get_metrics()
    assert m["kv_offload_hits"] == s.kv_offload_hits
    assert m["kv_offload_bytes_loaded"] == s.kv_offload_bytes_loaded
    assert m["kv_offload_capacity_blocks"] == TIER_BLOCKS
    assert base.kv_offload_hits == base.kv_offload_capacity_blocks == 0


def test_disk_tier_behind_the_host_tier(plain, disk):
    """The host tier holds 4 blocks: most evicted blocks go on to disk files and come back
    from there, with the same tokens and logprobs as the plain engine."""
    got_lp, want_lp = {}, {}
    assert _replay(disk, logprobs=got_lp) == _replay(plain, logprobs=want_lp)
    _assert_close(got_lp, want_lp)
    s = disk.get_stats()
    assert s.kv_offload_disk_blocks_stored > 0 and s.kv_offload_disk_blocks_loaded > 0
    assert s.kv_offload_blocks_loaded > s.kv_offload_disk_blocks_loaded  # both tiers hit


def test_swap_preemption_beside_the_tier(plain, tiered):
    """Two 60-token prompts fill the 16 blocks; the first decode past them preempts one:
    swapped out and in by the tiered engine (the same host-copy path as the tier's),
    recomputed by the plain one, the same tokens."""
    rng = np.random.default_rng(5)
    prompts = {f"p{i}": rng.integers(1, CFG.vocab_size, 60).tolist() for i in range(2)}
    swaps = tiered.scheduler.stats.num_swap_outs
    got_lp, want_lp = {}, {}
    assert _run(tiered, prompts, got_lp) == _run(plain, prompts, want_lp)
    _assert_close(got_lp, want_lp)
    assert tiered.scheduler.stats.num_swap_outs > swaps


def test_tier_copies_are_bit_exact(tiered):
    """An offload then a load writes the same bytes back into another block."""
    runner = tiered.runner
    rng = np.random.default_rng(0)
    runner.pool = tuple(jnp.asarray(rng.standard_normal(p.shape), p.dtype) for p in runner.pool)
    before = [np.asarray(p) for p in runner.pool]
    runner.moves.offload(runner.pool, [(3, 0), (5, 1)])
    runner.pool = runner.moves.load(
        runner.pool, [(1, 6), (0, 2)]
    )  # read before the gathers are fetched: fetched on demand
    rows = tiered.layout.num_blocks
    for old, new in zip(before, (np.asarray(p) for p in runner.pool), strict=True):
        for layer in range(CFG.num_layers):
            np.testing.assert_array_equal(new[layer * rows + 2], old[layer * rows + 3])
            np.testing.assert_array_equal(new[layer * rows + 6], old[layer * rows + 5])
    tiered.reset_prefix_cache()  # the pool's contents are garbage now: forget every key
    runner.moves.tier_blocks.clear()


def test_abort_mid_load_leaks_nothing(tiered):
    """A's blocks go to the tier when B fills the whole pool; three requests that start
    with A's prompt load them back and are aborted a step later: every block comes back."""
    rng = np.random.default_rng(3)
    a = rng.integers(1, CFG.vocab_size, 60).tolist()
    _run(tiered, {"a": a})
    _run(tiered, {"b": rng.integers(1, CFG.vocab_size, 120).tolist()})  # 16 blocks: all
    loaded = tiered.get_stats().kv_offload_blocks_loaded
    for i in range(3):
        tiered.add_request(f"x{i}", a + [i + 1] * 10, GREEDY)
    tiered.step()
    tiered.step()
    assert tiered.get_stats().kv_offload_blocks_loaded == loaded + 7  # A's full prompt blocks
    for i in range(3):
        tiered.abort(f"x{i}")
    while tiered.has_unfinished_requests():
        tiered.step()
    tiered.step()  # the aborts reach the runner


def test_offloading_settings_are_checked(params):
    with pytest.raises(ValueError, match="kv_offloading_backend 'lmcache' is not supported"):
        LLMEngine.from_params(CFG, params, kv_offloading_backend="lmcache", **OPTS)
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        LLMEngine.from_params(
            CFG, params, kv_offloading_size=1, enable_prefix_caching=False, **OPTS
        )
    with pytest.raises(ValueError, match="go together"):
        LLMEngine.from_params(CFG, params, kv_offloading_disk_dir="/tmp/kv", **OPTS)
