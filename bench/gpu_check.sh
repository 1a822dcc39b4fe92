#!/usr/bin/env bash
# GPU check of the jaxpaged attention kernels (run on a CUDA machine, no internet needed):
#   bash bench/gpu_check.sh            # from the repository root
# 1. correctness: Pallas (Triton) and XLA backends against the jnp reference on the GPU;
# 2. decode timing: batch 1/16/64/256 x context 512/2048/8192, 32 q heads / 8 KV heads,
#    head_dim 128, bf16, block 16, against JAX's own Pallas paged_attention (where it
#    still imports) and dense XLA attention over a contiguous cache; achieved HBM
#    bandwidth (KV + q bytes read once / time) against a measured device copy;
# 3. prefill timing against dense causal attention.
# Needs only jax[cuda] (0.10 or 0.11) and numpy; imports jaxpaged.kernels straight from
# kernels/ without installing the package. Stops starting new cases after
# GPU_CHECK_BUDGET_S seconds (default 300) so the whole run stays under 6 minutes.
# Writes the table to stdout and, if $OUT is set, to $OUT/gpu_check.md.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
SHIM="$(mktemp -d)"
mkdir -p "$SHIM/jaxpaged"
: > "$SHIM/jaxpaged/__init__.py"
ln -s "$REPO/kernels" "$SHIM/jaxpaged/kernels"
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

"$PY" - <<'PY'
import functools
import math
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpaged.kernels import ragged_paged_attention
from jaxpaged.kernels.testing import make_case, rel_err

START = time.time()
BUDGET = float(os.environ.get("GPU_CHECK_BUDGET_S", "270"))
# GPU_CHECK_SMOKE=1: tiny shapes, Pallas in interpret mode, runs on CPU (tests this script).
SMOKE = os.environ.get("GPU_CHECK_SMOKE") == "1"
INTERPRET = True if SMOKE else None
LINES = []


def emit(line=""):
    print(line, flush=True)
    LINES.append(line)


def over_budget():
    return time.time() - START > BUDGET


dev = jax.devices()[0]
emit(f"# jaxpaged kernel GPU check\n\njax {jax.__version__}, device {dev.device_kind} ({dev.platform})")
if dev.platform != "gpu" and not SMOKE:
    emit("no GPU visible to JAX: stopping")
    sys.exit(1)


def loop_time(fn, args, n=20, reps=3):
    """Seconds per call of fn(*args) -> q-shaped output, n calls chained in one jit.

    Each call's query depends on the previous output (times zero), so XLA can neither
    hoist nor drop calls, and Python dispatch is paid once per n calls.
    """
    def many(*a):
        def body(i, carry):
            q = a[0] + (carry * 0).astype(a[0].dtype)
            return fn(q, *a[1:]).astype(carry.dtype)
        return lax.fori_loop(0, n, body, jnp.zeros(a[0].shape, jnp.float32))

    f = jax.jit(many)
    jax.block_until_ready(f(*args))
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        best = min(best, (time.perf_counter() - t) / n)
    return best


# ---- 0. device copy bandwidth ---------------------------------------------------------
x = jnp.ones(((1 << 20) if SMOKE else (1 << 30),), jnp.bfloat16)  # 2 GiB
copy = jax.jit(lambda a: a * 1.0001, donate_argnums=0)
x = jax.block_until_ready(copy(x))
times = []
for _ in range(5):
    t = time.perf_counter()
    x = jax.block_until_ready(copy(x))
    times.append(time.perf_counter() - t)
COPY_BW = 2 * x.nbytes / min(times)
del x
emit(f"device copy bandwidth (read + write): {COPY_BW / 1e12:.2f} TB/s\n")

# ---- 1. correctness -------------------------------------------------------------------
emit("## Correctness against the reference (relative error, fresh random inputs)\n")
emit("| case | dtype | pallas | xla | limit |")
emit("|---|---|---|---|---|")
seed = int.from_bytes(os.urandom(4), "little")
rng = np.random.default_rng(seed)
emit(f"(seed {seed})\n")
import ml_dtypes  # noqa: E402

CHECKS = [
    ("mixed 32q/8kv d128 bs16", dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16), {}),
    ("mixed 9q/3kv d64 bs16", dict(num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16), {}),
    ("mixed 8q/1kv d128 bs64 window+cap", dict(num_q_heads=8, num_kv_heads=1, head_dim=128, block_size=64), dict(sliding_window=100, soft_cap=30.0)),
    ("mixed 16q/16kv d256 bs8", dict(num_q_heads=16, num_kv_heads=16, head_dim=256, block_size=8), {}),
]
failures = 0
with jax.default_matmul_precision("highest"):
    for name, shape, extra in CHECKS:
        for dtype, limit in (("float32", 1e-5), ("bfloat16", 1e-2)):
            seqs = [(1, 1000), (1, 37), (120, 120), (40, 700), (1, 1500), (5, 5)]
            if SMOKE:
                seqs = [(1, 40), (9, 9), (5, 30)]
            case = make_case(
                rng, seqs, **shape, dtype=getattr(ml_dtypes, dtype, np.float32),
                max_seqs=8, pad_tokens=5,
            )
            args = tuple(map(jnp.asarray, case.args()))
            opts = dict(sm_scale=case.sm_scale, **extra)
            try:
                ref = ragged_paged_attention(*args, **opts, backend="reference")
                errs = []
                for backend in ("pallas", "xla"):
                    out = ragged_paged_attention(
                        *args, **opts, backend=backend, interpret=INTERPRET if backend == "pallas" else None
                    )
                    err = rel_err(out, ref)
                    pad = np.asarray(out.astype(jnp.float32))[sum(q for q, _ in seqs):]
                    ok = err < limit and np.all(pad == 0)
                    failures += not ok
                    errs.append(f"{err:.1e}" + ("" if ok else " FAIL"))
                emit(f"| {name} | {dtype} | {errs[0]} | {errs[1]} | {limit:g} |")
            except Exception as e:  # report and go on: the timing table is still useful
                failures += 1
                emit(f"| {name} | {dtype} | ERROR {type(e).__name__}: {str(e)[:200]} | | |")
                traceback.print_exc()
emit(f"\ncorrectness failures: {failures}\n")

# ---- 2. decode timing -------------------------------------------------------------------
HQ, HKV, D, BS = (4, 1, 64, 16) if SMOKE else (32, 8, 128, 16)
CONTEXTS = (64,) if SMOKE else (512, 2048, 8192)
BATCHES = (1, 2) if SMOKE else (1, 16, 64, 256)
PREFILLS = ((1, 64),) if SMOKE else ((1, 2048), (4, 1024), (1, 8192))
DT = jnp.bfloat16
try:
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged
except Exception as e:  # removed with the Triton lowering in some JAX version
    jax_paged = None
    emit(f"jax.experimental.pallas.ops.gpu.paged_attention does not import: {e}")


def decode_problem(batch, ctx):
    """Pool holding exactly `batch` sequences of `ctx` tokens, shuffled blocks."""
    pages = ctx // BS
    nb = batch * pages + 8
    key = jax.random.key(batch * 100003 + ctx)
    k1, k2, k3, k4 = jax.random.split(key, 4)
    k_pages = jax.random.normal(k1, (nb, BS, HKV, D), DT)
    v_pages = jax.random.normal(k2, (nb, BS, HKV, D), DT)
    tables = jax.random.permutation(k3, nb)[: batch * pages].reshape(batch, pages).astype(jnp.int32)
    q = jax.random.normal(k4, (batch, HQ, D), DT)
    kv_lens = jnp.full((batch,), ctx, jnp.int32)
    cu = jnp.arange(batch + 1, dtype=jnp.int32)
    return q, k_pages, v_pages, kv_lens, tables, cu, jnp.array([batch], jnp.int32)


emit("## Decode (bf16, 32 q / 8 KV heads, head_dim 128, block 16)\n")
emit("HBM GB/s counts K, V and q bytes read once; '% copy' is that over the device copy bandwidth.\n")
emit("| batch | context | impl | us/call | GB/s | % copy | x jaxpaged |")
emit("|---|---|---|---|---|---|---|")
scale = 1.0 / math.sqrt(D)
for ctx in CONTEXTS:
    for batch in BATCHES:
        if over_budget():
            emit(f"| {batch} | {ctx} | (skipped: time budget) | | | | |")
            continue
        q, kp, vp, lens, tables, cu, ns = decode_problem(batch, ctx)
        nbytes = 2 * batch * ctx * HKV * D * 2 + q.size * 2
        impls = {}
        impls["jaxpaged pallas"] = (
            lambda q, kp, vp, lens, tables, cu, ns: ragged_paged_attention(
                q, kp, vp, lens, tables, cu, ns, sm_scale=scale, backend="pallas", max_q_len=1,
                interpret=INTERPRET),
            (q, kp, vp, lens, tables, cu, ns),
        )
        impls["jaxpaged xla"] = (
            lambda q, kp, vp, lens, tables, cu, ns: ragged_paged_attention(
                q, kp, vp, lens, tables, cu, ns, sm_scale=scale, backend="xla", max_q_len=1,
                max_kv_len=ctx),
            (q, kp, vp, lens, tables, cu, ns),
        )
        if jax_paged is not None:
            # JAX's layout is [kv_heads, pages, page_size, head_dim]; q pre-scaled.
            kpj = jnp.transpose(kp, (2, 0, 1, 3))
            vpj = jnp.transpose(vp, (2, 0, 1, 3))
            splits = min(16, ctx // BS)
            impls["jax pallas paged_attention"] = (
                lambda q, kpj, vpj, tables, lens: jax_paged.paged_attention(
                    q * scale, kpj, vpj, tables, lens, k_splits=splits,
                    pages_per_compute_block=min(8, ctx // BS // splits), interpret=SMOKE),
                (q, kpj, vpj, tables, lens),
            )
        kd = kp[tables].reshape(batch, ctx, HKV, D)
        vd = vp[tables].reshape(batch, ctx, HKV, D)
        impls["dense xla"] = (
            lambda q, kd, vd: jax.nn.dot_product_attention(
                q[:, None], kd, vd, scale=scale, implementation="xla")[:, 0],
            (q, kd, vd),
        )
        base = None
        for name, (fn, args) in impls.items():
            try:
                sec = loop_time(fn, args, n=20 if batch * ctx <= 64 * 2048 else 5)
            except Exception as e:
                emit(f"| {batch} | {ctx} | {name} | ERROR {type(e).__name__}: {str(e)[:120]} | | | |")
                continue
            base = base or sec
            gbs = nbytes / sec / 1e9
            emit(f"| {batch} | {ctx} | {name} | {sec * 1e6:.1f} | {gbs:.0f} | "
                 f"{100 * gbs * 1e9 / COPY_BW:.0f}% | {sec / base:.2f} |")
        del kd, vd, impls, q, kp, vp

# ---- 3. prefill timing ------------------------------------------------------------------
emit("\n## Prefill (bf16, causal, 32 q / 8 KV heads, head_dim 128, block 16)\n")
emit("| batch x tokens | impl | ms/call | TFLOP/s (causal) | x jaxpaged |")
emit("|---|---|---|---|---|")
for batch, n in PREFILLS:
    if over_budget():
        emit(f"| {batch}x{n} | (skipped: time budget) | | | |")
        continue
    rng = np.random.default_rng(batch * n)
    pages = n // BS
    nb = batch * pages + 8
    kp = jnp.asarray(rng.standard_normal((nb, BS, HKV, D)), DT)
    vp = jnp.asarray(rng.standard_normal((nb, BS, HKV, D)), DT)
    tables = jnp.asarray(rng.permutation(nb)[: batch * pages].reshape(batch, pages), jnp.int32)
    q = jnp.asarray(rng.standard_normal((batch * n, HQ, D)), DT)
    lens = jnp.full((batch,), n, jnp.int32)
    cu = jnp.arange(batch + 1, dtype=jnp.int32) * n
    ns = jnp.array([batch], jnp.int32)
    flops = 4 * batch * n * n / 2 * HQ * D
    impls = {
        "jaxpaged pallas": (
            lambda q, kp, vp, lens, tables, cu, ns: ragged_paged_attention(
                q, kp, vp, lens, tables, cu, ns, sm_scale=scale, backend="pallas", max_q_len=n,
                interpret=INTERPRET),
            (q, kp, vp, lens, tables, cu, ns),
        ),
        "dense xla (causal)": (
            lambda q, kd, vd: jax.nn.dot_product_attention(
                q.reshape(batch, n, HQ, D), kd, vd, scale=scale, is_causal=True,
                implementation="xla").reshape(batch * n, HQ, D),
            (q, kp[tables].reshape(batch, n, HKV, D), vp[tables].reshape(batch, n, HKV, D)),
        ),
    }
    try:
        impls["dense cudnn (causal)"] = (
            lambda q, kd, vd: jax.nn.dot_product_attention(
                q.reshape(batch, n, HQ, D), kd, vd, scale=scale, is_causal=True,
                implementation="cudnn").reshape(batch * n, HQ, D),
            impls["dense xla (causal)"][1],
        )
    except Exception:
        pass
    base = None
    for name, (fn, args) in impls.items():
        try:
            sec = loop_time(fn, args, n=5)
        except Exception as e:
            emit(f"| {batch}x{n} | {name} | ERROR {type(e).__name__}: {str(e)[:120]} | | |")
            continue
        base = base or sec
        emit(f"| {batch}x{n} | {name} | {sec * 1e3:.2f} | {flops / sec / 1e12:.0f} | {sec / base:.2f} |")

emit(f"\ntotal {time.time() - START:.0f} s")
out = os.environ.get("OUT")
if out:
    with open(os.path.join(out, "gpu_check.md"), "w") as f:
        f.write("\n".join(LINES) + "\n")
sys.exit(1 if failures else 0)
PY
