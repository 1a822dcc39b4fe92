"""The accelerator check run by bench/accelerator_check.sh: one prioritized pass over the GPU
(or TPU) paths, each result written as a line to stdout and to ``$OUT/accelerator_check.md``
the moment it is known, so a crash or the deadline loses nothing already measured.

Stages, most important first: versions -> compile one decode and one prefill shape (full
traceback on failure) -> correctness against the jnp reference (bfloat16 first, then float16,
float32, head_dim 256 last; decode-only calls; engine-like table widths) -> decode timing at
batch 1/16/64/256 x context 2k/8k against the measured device copy bandwidth and JAX's own
GPU ``paged_attention`` -> a short engine run (tok/s; greedy tokens against the CPU engine's,
shipped in accelerator_expected.json), with n-gram speculation, then with a tiny random EAGLE-3
head; per-row causal limits run right after correctness (bench/accelerator_features.py has
the newer stages). A stage starts only while the deadline leaves room.

``--dry-run`` runs every stage on the CPU with tiny shapes and the kernels in interpret mode
(tests/bench checks the script that way); ``--write-expected`` records the CPU engine's tokens.
Needs only jax, numpy, ml_dtypes and tqdm (all on the lent GPU machine); jaxpaged is imported
from this checkout, nothing is installed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from accelerator_features import causal_limits_stage, eagle3_stage  # noqa: E402
from accelerator_kernels import (  # noqa: E402
    HERE,
    Report,
    attention,
    compile_stage,
    correctness_stage,
    import_jaxpaged,
    kernel_backend,
    versions,
)

EXPECTED = os.path.join(HERE, "accelerator_expected.json")


# ---------------------------------------------------------------- stage 3: decode timing
def loop_time(fn: Any, args: tuple, n: int, reps: int = 3) -> float:
    """Seconds per call of fn(*args), n calls chained in one jit (each call's query depends on
    the previous output times zero, so XLA can neither hoist nor drop calls)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    def many(*a):
        def body(i, carry):
            return fn(a[0] + (carry * 0).astype(a[0].dtype), *a[1:]).astype(carry.dtype)

        return lax.fori_loop(0, n, body, jnp.zeros(a[0].shape, jnp.float32))

    f = jax.jit(many)
    jax.block_until_ready(f(*args))
    best = math.inf
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        best = min(best, (time.perf_counter() - t) / n)
    return best


def copy_bandwidth(small: bool) -> float:
    """Read + write bytes per second of a donated elementwise pass over a large array."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones(((1 << 18) if small else (1 << 30),), jnp.bfloat16)
    step = jax.jit(lambda a: a * 1.0001, donate_argnums=0)
    x = jax.block_until_ready(step(x))
    best = math.inf
    for _ in range(5):
        t = time.perf_counter()
        x = jax.block_until_ready(step(x))
        best = min(best, time.perf_counter() - t)
    return 2 * x.nbytes / best


def timing_stage(rep: Report, platform: str, interpret: bool, small: bool) -> None:
    import jax
    import jax.numpy as jnp

    rep.stage("Decode attention timing (bf16, 32 q / 8 KV heads, head_dim 128, block 16)")
    bw = copy_bandwidth(small)
    rep.line(f"device copy bandwidth (read + write): {bw / 1e9:.0f} GB/s\n")
    rep.line("GB/s counts K, V and q read once; '% copy' is that over the copy bandwidth.\n")
    rep.line("| batch | context | impl | us/call | GB/s | % copy |\n|---|---|---|---|---|---|")
    hq, hkv, d, bs = (4, 1, 128, 16) if small else (32, 8, 128, 16)
    jax_paged = None
    if platform == "gpu":
        try:
            from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged
        except Exception as e:
            rep.line(f"(JAX's GPU paged_attention does not import: {e})")
    ours = attention(kernel_backend(platform), interpret)
    scale = 1 / math.sqrt(d)
    for ctx in (32,) if small else (2048, 8192):
        for batch in (2,) if small else (1, 16, 64, 256):
            if rep.left() < rep.reserve:
                rep.line(f"| {batch} | {ctx} | skipped: deadline | | | |")
                continue
            pages = ctx // bs
            nb = batch * pages + 8
            k1, k2, k3, k4 = jax.random.split(jax.random.key(batch * 7919 + ctx), 4)
            kp = jax.random.normal(k1, (nb, bs, hkv, d), jnp.bfloat16)
            vp = jax.random.normal(k2, (nb, bs, hkv, d), jnp.bfloat16)
            perm = jax.random.permutation(k3, nb)[: batch * pages]
            tables = perm.reshape(batch, pages).astype(jnp.int32)
            q = jax.random.normal(k4, (batch, hq, d), jnp.bfloat16)
            lens = jnp.full((batch,), ctx, jnp.int32)
            cu = jnp.arange(batch + 1, dtype=jnp.int32)
            ns = jnp.array([batch], jnp.int32)
            nbytes = 2 * batch * ctx * hkv * d * 2 + q.size * 2
            impls = {
                f"jaxpaged {kernel_backend(platform)}": (
                    lambda q, kp, vp, lens, t, cu, ns: ours(
                        q, kp, vp, lens, t, cu, ns, sm_scale=scale, max_q_len=1),
                    (q, kp, vp, lens, tables, cu, ns)),
            }  # fmt: skip
            if jax_paged is not None:  # JAX's layout: [kv_heads, pages, page_size, head_dim]
                splits = min(16, pages)
                per_block = max(1, min(8, pages // splits))
                impls["jax paged_attention"] = (
                    lambda q, kj, vj, t, lens, k=splits, p=per_block: jax_paged.paged_attention(
                        q * scale, kj, vj, t, lens, k_splits=k, pages_per_compute_block=p,
                        interpret=interpret),
                    (q, kp.transpose(2, 0, 1, 3), vp.transpose(2, 0, 1, 3), tables, lens),
                )  # fmt: skip
            for name, (fn, args) in impls.items():
                try:
                    sec = loop_time(fn, args, n=2 if small else 10)
                except Exception as e:
                    rep.fail(f"timing {name} batch {batch} context {ctx}", e)
                    continue
                gbs = nbytes / sec / 1e9
                rep.line(f"| {batch} | {ctx} | {name} | {sec * 1e6:.1f} | {gbs:.0f} | "
                         f"{100 * gbs * 1e9 / bw:.0f}% |")  # fmt: skip


# ---------------------------------------------------------------- stage 4: engine
def model_and_params():
    """A small random-weight model, the same on every machine (numpy's seeded generator)."""
    import jax
    import jax.numpy as jnp

    from jaxpaged.models.testing import random_params, tiny_config

    config = tiny_config(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=4,
                         num_heads=8, num_kv_heads=2, head_dim=32)  # fmt: skip
    return config, jax.tree.map(jnp.asarray, random_params(config, seed=23, scale=0.2))


PROMPTS = [[(7 * i + 3 * j) % 256 for j in range(5 + 3 * i)] for i in range(4)]


def greedy_tokens(
    attention_backend: str | None,
    max_tokens: int,
    *,
    eager: bool = False,
    speculative_config: dict | None = None,
) -> tuple[list, float, Any]:
    """Greedy tokens of PROMPTS, tokens per second of the whole run (warm-up excluded;
    ``eager`` skips the warm-up, so compiling is included: dry runs) and the engine's
    stats at the end."""
    import jax

    from jaxpaged.engine import LLMEngine
    from jaxpaged.sampling_params import SamplingParams

    config, params = model_and_params()
    with jax.default_matmul_precision("highest"):  # TF32 would change float32 greedy picks
        engine = LLMEngine.from_params(
            config, params, attention_backend=attention_backend, max_model_len=128,
            max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=48, block_size=16,
            enforce_eager=eager, speculative_config=speculative_config,
        )  # fmt: skip
        start = time.perf_counter()
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
        tokens: dict[str, list[int]] = {}
        while len(tokens) < len(PROMPTS) or engine.has_unfinished_requests():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        seconds = time.perf_counter() - start
    ordered = [tokens[str(i)] for i in range(len(PROMPTS))]
    return ordered, sum(map(len, ordered)) / seconds, engine.get_stats()


def engine_stage(rep: Report, *, eager: bool) -> None:
    rep.stage("Engine run (4-layer random-weight model, float32, greedy)")
    if rep.left() < rep.reserve:
        rep.line("skipped: deadline")
        return
    with open(EXPECTED) as f:
        expected = json.load(f)
    try:  # the platform's default attention backend (Pallas on GPUs, JAX's kernel on TPUs)
        # a dry run checks the first 3 tokens (compiling the eager engine's shapes dominates)
        max_tokens = 3 if eager else expected["max_tokens"]
        want = [t[:max_tokens] for t in expected["tokens"]]
        tokens, tok_s, _ = greedy_tokens(None, max_tokens, eager=eager)
    except Exception as e:
        rep.fail("engine run", e)
        return
    same = tokens == want
    rep.failures += not same
    rep.line(
        f"- {sum(map(len, tokens))} tokens at {tok_s:.0f} tok/s (4 requests, warm-up excluded)"
    )
    rep.line(f"- greedy tokens {'equal' if same else 'DIFFER FROM'} the CPU engine's"
             + ("" if same else f": got {tokens}, CPU {want}"))  # fmt: skip


SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}  # fmt: skip


def spec_stage(rep: Report, *, eager: bool) -> None:
    rep.stage("Speculative decoding (n-gram drafts verified in the step, same model)")
    if rep.left() < rep.reserve:
        rep.line("skipped: deadline")
        return
    with open(EXPECTED) as f:
        expected = json.load(f)
    try:
        max_tokens = 3 if eager else expected["max_tokens"]
        want = [t[:max_tokens] for t in expected["tokens"]]
        tokens, tok_s, stats = greedy_tokens(None, max_tokens, eager=eager, speculative_config=SPEC)
    except Exception as e:
        rep.fail("speculative run", e)
        return
    same = tokens == want
    rep.failures += not same
    drafted = stats.spec_decode_num_draft_tokens
    rep.line(f"- {sum(map(len, tokens))} tokens at {tok_s:.0f} tok/s, "
             f"{stats.spec_decode_num_accepted_tokens} of {drafted} drafts accepted")  # fmt: skip
    rep.line(f"- greedy tokens {'equal' if same else 'DIFFER FROM'} the CPU engine's"
             + ("" if same else f" (speculative): got {tokens}, CPU {want}"))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, interpret mode")
    parser.add_argument("--as", dest="as_platform", choices=("gpu", "tpu"), default="gpu",
                        help="with --dry-run: which half to exercise")  # fmt: skip
    parser.add_argument("--deadline", type=float, default=float(os.environ.get(
        "ACCELERATOR_CHECK_DEADLINE_S", 400)), help="seconds for all stages")  # fmt: skip
    parser.add_argument("--write-expected", action="store_true",
                        help="record the CPU engine's greedy tokens, then exit")  # fmt: skip
    args = parser.parse_args(argv)
    import_jaxpaged()
    if args.write_expected:
        tokens, _, _ = greedy_tokens(None, 8)
        with open(EXPECTED, "w") as f:
            json.dump({"max_tokens": 8, "tokens": tokens}, f)
            f.write("\n")
        return 0
    # a stage or case starts only with this much time left (a dry run's are quick)
    reserve = 3.0 if args.dry_run else 45.0
    rep = Report(os.environ.get("OUT"), args.deadline, reserve=reserve)
    platform = versions(rep)
    interpret = args.dry_run
    if args.dry_run:
        platform = args.as_platform
    elif platform not in ("gpu", "tpu"):
        rep.line(f"no GPU or TPU visible to JAX (platform {platform}): stopping")
        return 1
    compile_stage(rep, kernel_backend(platform), interpret, small=args.dry_run)
    correctness_stage(rep, platform, interpret, small=args.dry_run)
    causal_limits_stage(rep, platform, interpret, small=args.dry_run)
    timing_stage(rep, platform, interpret, small=args.dry_run)
    engine_stage(rep, eager=args.dry_run)
    spec_stage(rep, eager=args.dry_run)
    with open(EXPECTED) as f:
        expected = json.load(f)
    # drafts need room for k + 1 more tokens: a dry run makes 4 tokens per request
    want = [t[: 4 if args.dry_run else expected["max_tokens"]] for t in expected["tokens"]]
    eagle3_stage(rep, greedy_tokens, model_and_params()[0], want, eager=args.dry_run)
    rep.line(f"\nfailures: {rep.failures}; total {time.monotonic() - rep.start:.0f} s")
    return 1 if rep.failures else 0


if __name__ == "__main__":
    sys.exit(main())
