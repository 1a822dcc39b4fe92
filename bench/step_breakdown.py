"""Where one pure-decode step of jaxpaged goes: host scheduling, padding, device compute (split
into matmuls, attention, lm_head and sampler by timing each part alone, jitted, on the very
step's inputs), device->host copy and scheduler/detokenizer update.

    python bench/step_breakdown.py [--model M] [--batch 32] [--steps 16] [--trace DIR]

``--trace DIR`` also writes a ``jax.profiler`` trace of the timed steps (open it in Perfetto
or TensorBoard). :func:`prepare_decode` and :func:`time_decode_steps` are reused by
throughput.py for its "decode step at batch 32" line.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["DecodeTiming", "prepare_decode", "time_decode_steps", "breakdown"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeTiming:
    step_seconds: list[float]  # wall time of each engine.step()
    context_lens: list[int]  # per sequence, at the middle of the timed steps
    batch: int

    @property
    def median(self) -> float:
        return statistics.median(self.step_seconds)


def prepare_decode(
    llm: Any, prompts: Sequence[Sequence[int]], *, batch: int, steps: int, warm_steps: int = 2
) -> list[str]:
    """Adds ``batch`` greedy requests (prompts cycled) long enough for ``steps`` more decode
    steps, and steps the engine until all of them are prefilled (each has >= 1 token), so the
    next steps are pure decode at ``batch`` sequences. Returns the request ids."""
    from jaxpaged import SamplingParams

    engine = llm.engine
    if engine.has_unfinished_requests():
        raise ValueError("prepare_decode needs an idle engine")
    if batch > engine.scheduler_config.max_num_seqs:
        raise ValueError(
            f"batch {batch} exceeds max_num_seqs={engine.scheduler_config.max_num_seqs}"
        )
    params = SamplingParams(temperature=0.0, max_tokens=steps + warm_steps + 64, ignore_eos=True)
    ids = [f"decode-probe-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, list(prompts[i % len(prompts)]), params)
    started: set[str] = set()
    for _ in range(10_000):
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids:
                started.add(out.request_id)
        if len(started) == batch:
            for _ in range(warm_steps):  # untimed: compiles the decode bucket if eager
                engine.step()
            return ids
    raise RuntimeError("requests never all reached decode")


def _abort(llm: Any, ids: Sequence[str]) -> None:
    for rid in ids:
        llm.engine.abort(rid)


def time_decode_steps(
    llm: Any,
    prompts: Sequence[Sequence[int]],
    *,
    batch: int = 32,
    steps: int = 16,
    rounds: int = 1,
    after_round: Callable[[], None] | None = None,
) -> list[DecodeTiming]:
    """Wall time of ``steps`` pure-decode engine.step() calls at ``batch`` sequences, for each
    of ``rounds`` rounds on the same requests; ``after_round()`` runs between them (untimed),
    so throughput.py can measure the machine's peaks next to each round's steps."""
    ids = prepare_decode(llm, prompts, batch=batch, steps=steps * rounds)
    engine = llm.engine
    timings = []
    try:
        for _ in range(rounds):
            times = []
            ctx: list[int] = []
            for i in range(steps):
                t0 = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t0)
                if i == steps // 2:
                    ctx = [r.num_tokens for r in engine.scheduler.running]
                if len(engine.scheduler.running) != batch:
                    raise RuntimeError(f"batch fell to {len(engine.scheduler.running)} sequences")
            timings.append(DecodeTiming(step_seconds=times, context_lens=ctx, batch=batch))
            if after_round is not None:
                after_round()
    finally:
        _abort(llm, ids)
    return timings


def _timed(fn: Callable[..., Any], *args: Any, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def _reference_points(llm: Any, num_tokens: int, *, repeats: int) -> dict[str, float]:
    """Floors to compare the parts with: the layers' matmuls alone (same FLOPs, each layer's
    weights as separate 2-D arrays, layers unrolled: no scan, no einsum layouts), and one read
    of every weight (a jitted sum)."""
    import jax
    import jax.numpy as jnp

    runner = llm.engine.runner
    lay = runner.params["layers"]  # (in panel layout under the native matmul: same FLOPs, bytes)

    @jax.jit
    def read_all(tree):
        return sum(jnp.sum(leaf) for leaf in jax.tree_util.tree_leaves(tree))

    read = {"read every weight once (jitted sum)": _timed(read_all, runner.params, repeats=repeats)}
    if not isinstance(lay["wqkv"], jax.Array):  # group-wise quantized: no 2-D float dots
        return read
    n = runner.model_config.num_layers
    d = lay["wqkv"].shape[-1]
    w2d = [  # [out, in], as the params
        (
            lay["wqkv"][i].reshape(-1, d),
            lay["wo"][i].reshape(d, -1),
            lay["w_gate_up"][i].reshape(-1, d),
            lay["w_down"][i],
        )
        for i in range(n)
    ]
    jax.block_until_ready(w2d)
    q_width = w2d[0][1].shape[1]
    f = w2d[0][3].shape[1]

    @jax.jit
    def matmuls(ws, x):  # [T, D]
        for wqkv, wo, wgu, wd in ws:
            x = x + (x @ wqkv.T)[:, :q_width] @ wo.T
            gu = x @ wgu.T
            x = x + (gu[:, :f] * gu[:, f:]) @ wd.T
        return x

    x = jnp.ones((num_tokens, d), w2d[0][0].dtype) * 1e-3
    return {
        "layers' matmuls alone (2-D weights, unrolled)": _timed(matmuls, w2d, x, repeats=repeats),
        **read,
    }


def _device_parts(llm: Any, batch: Any, bucket: Any, *, repeats: int) -> dict[str, float]:
    """Each part of the jitted step alone on the same inputs (best of ``repeats``)."""
    import jax
    import jax.numpy as jnp

    from jaxpaged.kernels import ragged_paged_attention, write_kv
    from jaxpaged.models.llama import compute_logits, forward
    from jaxpaged.worker import sampler

    runner = llm.engine.runner
    cfg = runner.model_config
    params = runner.params
    max_kv = bucket.max_blocks * runner.layout.block_size
    nb, bs = runner.layout.num_blocks, runner.layout.block_size

    # the kernels the steps use (the params hold their weight layout)
    kernels = runner.kernels

    def no_attention(q, k, v, layer, cache):
        return q, cache

    @jax.jit
    def layers_without_attention(params, batch):
        h, _ = forward(
            params, batch.tokens, batch.positions, config=cfg, attention_fn=no_attention,
            linear_fn=kernels.linear_fn(batch.tokens.shape[0]),
        )  # fmt: skip
        return h

    @jax.jit
    def lm_head(params, h, rows):
        logits_fn = kernels.logits_fn(rows.shape[0])
        return compute_logits(params, h[rows], config=cfg, linear_fn=logits_fn)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def attention_all_layers(pool, batch, q, k, v):
        def body(pool, layer):
            kp, vp = pool
            slots = jnp.where(batch.slot_mapping >= 0, batch.slot_mapping + layer * nb * bs, -1)
            kp, vp = write_kv(kp, vp, k, v, slots)
            o = ragged_paged_attention(
                q, kp, vp, batch.kv_lens, batch.block_tables + layer * nb, batch.cu_q_lens,
                batch.num_seqs, sm_scale=cfg.head_dim**-0.5, backend=runner.backend,
                max_q_len=1, max_kv_len=max_kv,
            )  # fmt: skip
            return (kp, vp), o.sum()

        pool, sums = jax.lax.scan(body, pool, jnp.arange(cfg.num_layers, dtype=jnp.int32))
        return pool, sums

    # the greedy argmax the step uses (the native one on CPU)
    argmax = kernels.argmax

    @jax.jit
    def sample(logits, tensors, penalties):
        return sampler.sample(logits, tensors, penalties, num_logprobs=20, argmax=argmax)

    t = batch.tokens.shape[0]
    dtype = runner.pool[0].dtype
    key = jax.random.PRNGKey(0)
    q = jax.random.normal(key, (t, cfg.num_heads, cfg.head_dim), dtype)
    k = jax.random.normal(key, (t, cfg.num_kv_heads, cfg.head_dim), dtype)
    dev_batch = jax.device_put(batch)
    h = layers_without_attention(params, dev_batch)
    logits = lm_head(params, h, dev_batch.sample_rows)

    out = {
        "layers without attention (matmuls, norms, rope)": _timed(
            layers_without_attention, params, dev_batch, repeats=repeats
        ),
        "lm_head (tied embedding) on sampled rows": _timed(
            lm_head, params, h, dev_batch.sample_rows, repeats=repeats
        ),
        "sampler (greedy)": _timed(
            sample, logits, dev_batch.sampling, runner.seq_state, repeats=repeats
        ),
    }
    # attention: the pool is donated, so thread it through and hand it back to the runner
    pool = runner.pool
    pool, s = attention_all_layers(pool, dev_batch, q, k, k)
    jax.block_until_ready(s)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        pool, s = attention_all_layers(pool, dev_batch, q, k, k)
        jax.block_until_ready(s)
        best = min(best, time.perf_counter() - t0)
    runner.pool = pool
    out["write_kv + paged attention, all layers"] = best
    return out


def breakdown(
    llm: Any,
    prompts: Sequence[Sequence[int]],
    *,
    batch: int = 32,
    steps: int = 16,
    repeats: int = 5,
    trace_dir: str | None = None,
) -> dict[str, Any]:
    """Times the phases of ``steps`` pure-decode steps at ``batch`` sequences (median per
    phase), then the device parts alone. Note: the scheduler and runner objects of the engine
    are wrapped for the duration (timing wrappers), then restored."""
    import jax

    engine = llm.engine
    sched, runner = engine.scheduler, engine.runner
    ids = prepare_decode(llm, prompts, batch=batch, steps=steps + 2)
    phases: dict[str, list[float]] = {k: [] for k in
              ("schedule", "build_batch (pad)", "device step", "dispatch (rest)",
               "collect (device->host copy)", "scheduler.update + detokenize + outputs",
               "engine.step total")}  # fmt: skip
    captured: dict[str, Any] = {}
    orig_schedule, orig_build, orig_run, orig_dispatch, orig_collect = (
        sched.schedule, runner.build_batch, runner._run, runner.dispatch, runner.collect)  # fmt: skip
    clock: dict[str, float] = {}

    def schedule():
        t0 = time.perf_counter()
        plan = orig_schedule()
        phases["schedule"].append(time.perf_counter() - t0)
        return plan

    def build_batch(seqs, bucket, *rest):
        t0 = time.perf_counter()
        b = orig_build(seqs, bucket, *rest)
        phases["build_batch (pad)"].append(time.perf_counter() - t0)
        captured["batch"], captured["bucket"] = b[0], bucket
        return b

    def run(b, bucket):  # waits for the step: the parts are timed one after another here
        t0 = time.perf_counter()
        out = jax.block_until_ready(orig_run(b, bucket))
        phases["device step"].append(time.perf_counter() - t0)
        return out

    def dispatch(plan):
        t0 = time.perf_counter()
        out = orig_dispatch(plan)
        clock["dispatch"] = time.perf_counter() - t0
        return out

    def collect(pending):
        t0 = time.perf_counter()
        out = orig_collect(pending)
        clock["collect"] = time.perf_counter() - t0
        return out

    sched.schedule, runner.build_batch, runner._run, runner.dispatch, runner.collect = (
        schedule, build_batch, run, dispatch, collect)  # fmt: skip
    try:
        if trace_dir:
            jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            total = time.perf_counter() - t0
            phases["engine.step total"].append(total)
            dispatch_s, collect_s = clock["dispatch"], clock["collect"]
            phases["dispatch (rest)"].append(
                dispatch_s - phases["build_batch (pad)"][-1] - phases["device step"][-1]
            )
            phases["collect (device->host copy)"].append(collect_s)
            phases["scheduler.update + detokenize + outputs"].append(
                total - dispatch_s - collect_s - phases["schedule"][-1]
            )
        if trace_dir:
            jax.profiler.stop_trace()
    finally:
        del sched.schedule, runner.build_batch, runner._run, runner.dispatch, runner.collect
    try:
        if not captured["bucket"].decode_only:
            raise RuntimeError(f"expected a decode-only bucket, got {captured['bucket']}")
        parts = _device_parts(llm, captured["batch"], captured["bucket"], repeats=repeats)
        refs = _reference_points(llm, captured["bucket"].num_tokens, repeats=repeats)
    finally:
        _abort(llm, ids)
    return {
        "batch": batch,
        "bucket": dataclasses.asdict(captured["bucket"]),
        "host_and_step_ms": {k: 1e3 * statistics.median(v) for k, v in phases.items()},
        "device_parts_ms": {k: 1e3 * v for k, v in parts.items()},
        "reference_ms": {k: 1e3 * v for k, v in refs.items()},
    }


def format_breakdown(b: dict[str, Any]) -> str:
    lines = [f"decode step at batch {b['batch']} (bucket {b['bucket']}), medians:"]
    for k, v in b["host_and_step_ms"].items():
        lines.append(f"  {k:45s} {v:8.2f} ms")
    lines.append("device step parts, each jitted alone (best of repeats):")
    total = 0.0
    for k, v in b["device_parts_ms"].items():
        lines.append(f"  {k:45s} {v:8.2f} ms")
        total += v
    lines.append(f"  {'sum of parts':45s} {total:8.2f} ms")
    lines.append("reference points (not part of the step):")
    for k, v in b.get("reference_ms", {}).items():
        lines.append(f"  {k:45s} {v:8.2f} ms")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    import json

    from common import make_workload

    from jaxpaged import LLM
    from jaxpaged.engine import process_owner_args

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-prompt-words", type=int, default=300)
    p.add_argument("--enforce-eager", action="store_true", help="no warm-up (smoke tests)")
    p.add_argument("--trace", default=None, metavar="DIR", help="write a jax.profiler trace here")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        enforce_eager=args.enforce_eager,
        show_progress=False,
        **process_owner_args(),  # measured as served: malloc tuned, compiled programs cached
    )
    work = make_workload(
        llm.tokenizer, num_prompts=args.batch, seed=0, max_prompt_words=args.max_prompt_words
    )
    b = breakdown(llm, [r.prompt_token_ids for r in work], batch=args.batch, steps=args.steps,
                  trace_dir=args.trace)  # fmt: skip
    print(format_breakdown(b))
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(b, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
