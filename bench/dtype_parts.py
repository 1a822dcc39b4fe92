"""Where a decode step's time differs between float32 and bfloat16 on this CPU: each native
part of the step (the linear kernel per SmolLM2-135M projection over its 30 stacked layers,
the lm_head, write_kv + paged attention over 30 layers; ``--layers`` sets fewer) timed with
float32 and with bfloat16 weights / KV pools, the two alternated call by call in one process
(order flipped each pair).

    python bench/dtype_parts.py [--rows 32] [--pairs 15] [--context 200] [--parts ...]

Prints per part the median wall time of each dtype and the median of the per-pair ratios
bfloat16 / float32 (below 1: bfloat16 faster) with its quartiles, and the same for process
CPU time (all threads), which a loaded machine disturbs less than wall time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.kernels import cpu

D_MODEL, D_FF = 576, 1536
HQ, HKV, HEAD_DIM, BLOCK = 9, 3, 64, 16
# [N, K] per projection (SmolLM2-135M: fused q/k/v, o, fused gate/up, down) and the lm_head
SHAPES = {
    "qkv": (960, D_MODEL),
    "o": (D_MODEL, D_MODEL),
    "gate_up": (2 * D_FF, D_MODEL),
    "down": (D_MODEL, D_FF),
    "lm_head": (49152, D_MODEL),
}


def linear_part(name: str, dtype: jnp.dtype, rows: int, layers: int) -> Callable[[], jax.Array]:
    """A jitted pass of one projection over every layer (one layer for the lm_head)."""
    n, k = SHAPES[name]
    layers = 1 if name == "lm_head" else layers
    rng = np.random.default_rng(0)
    w = cpu.pack_panels(jnp.asarray(rng.standard_normal((layers, n, k), np.float32) * 0.05, dtype))
    x = jnp.asarray(rng.standard_normal((rows, k), np.float32))  # [rows, K]

    @jax.jit
    def run(w, x):  # w: [L, N, K] panels; x: [rows, K]
        def body(i, acc):
            return acc + cpu.linear(x, w, i, out_dtype=jnp.float32)[:, :8].sum()

        return jax.lax.fori_loop(0, layers, body, jnp.float32(0))

    return lambda: run(w, x)


def attention_part(
    dtype: jnp.dtype, seqs: int, context: int, layers: int
) -> Callable[[], jax.Array]:
    """write_kv of one new row per sequence, then decode attention, for every layer."""
    blocks_per_seq = (context + BLOCK) // BLOCK + 1
    nb = seqs * blocks_per_seq  # per layer
    rng = np.random.default_rng(1)
    pool_shape = (layers * nb, BLOCK, HKV, HEAD_DIM)
    kp = jnp.asarray(rng.standard_normal(pool_shape, np.float32), dtype)
    vp = jnp.asarray(rng.standard_normal(pool_shape, np.float32), dtype)
    perm = rng.permutation(nb).astype(np.int32)  # blocks scattered over the pool, as served
    tables = jnp.asarray(perm.reshape(seqs, blocks_per_seq))  # [S, P]
    kv_lens = jnp.full((seqs,), context + 1, jnp.int32)
    cu_q = jnp.arange(seqs + 1, dtype=jnp.int32)
    slots = tables[:, context // BLOCK] * BLOCK + context % BLOCK  # [S]
    q = jnp.asarray(rng.standard_normal((seqs, HQ, HEAD_DIM), np.float32))
    kv = jnp.asarray(rng.standard_normal((seqs, HKV, HEAD_DIM), np.float32))

    def run(pools, q, kv):  # q: [S, Hq, D]; kv: [S, Hkv, D] float32
        def body(pools, layer):
            kp, vp = cpu.write_kv_native(*pools, kv, kv, slots + layer * nb * BLOCK)
            o = cpu.ragged_paged_attention_native(
                q, kp, vp, kv_lens, tables + layer * nb, cu_q, jnp.int32(seqs),
                sm_scale=HEAD_DIM**-0.5,
            )  # fmt: skip
            return (kp, vp), o.sum()

        return jax.lax.scan(body, pools, jnp.arange(layers, dtype=jnp.int32))

    jitted = jax.jit(run, donate_argnums=(0,))
    state = {"pools": (kp, vp)}

    def call() -> jax.Array:
        state["pools"], sums = jitted(state["pools"], q, kv)
        return sums

    return call


def timed(fn: Callable[[], jax.Array]) -> tuple[float, float]:
    """(wall, process CPU) seconds of one call."""
    c0, t0 = time.process_time(), time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0, time.process_time() - c0


def describe(ratios: list[float]) -> str:
    if len(ratios) == 1:
        return f"{ratios[0]:5.2f}x"
    q1, med, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return f"{med:5.2f}x ({q1:.2f}-{q3:.2f})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--rows", type=int, default=32, help="rows of x = sequences decoded")
    p.add_argument("--pairs", type=int, default=15)
    p.add_argument("--context", type=int, default=200, help="tokens per sequence (attention)")
    p.add_argument("--layers", type=int, default=30, help="decoder layers (SmolLM2-135M: 30)")
    p.add_argument("--parts", nargs="+", default=[*SHAPES, "attention"])
    args = p.parse_args()
    if not cpu.available():
        raise SystemExit("the native CPU kernels did not build")
    print(f"rows {args.rows}, {args.pairs} alternated pairs, load {os.getloadavg()[0]:.1f}")
    print(f"{'part':10s} {'f32 ms':>8s} {'bf16 ms':>8s}  {'bf16/f32 wall (quartiles)':26s} "
          f"{'bf16/f32 CPU time':18s}")  # fmt: skip
    dtypes = (jnp.float32, jnp.bfloat16)
    for part in args.parts:
        fns = {
            d: attention_part(d, args.rows, args.context, args.layers)
            if part == "attention"
            else linear_part(part, d, args.rows, args.layers)
            for d in dtypes
        }
        for d in dtypes:  # compile and warm
            timed(fns[d])
        wall: dict[object, list[float]] = {d: [] for d in dtypes}
        cpu_t: dict[object, list[float]] = {d: [] for d in dtypes}
        for i in range(args.pairs):
            for d in dtypes if i % 2 == 0 else dtypes[::-1]:
                w, c = timed(fns[d])
                wall[d].append(w)
                cpu_t[d].append(c)
        wr = [b / f for f, b in zip(wall[dtypes[0]], wall[dtypes[1]], strict=True)]
        cr = [b / f for f, b in zip(cpu_t[dtypes[0]], cpu_t[dtypes[1]], strict=True)]
        f32, bf16 = (statistics.median(wall[d]) * 1e3 for d in dtypes)
        print(f"{part:10s} {f32:8.2f} {bf16:8.2f}  {describe(wr):26s} {describe(cr):18s}",
              flush=True)  # fmt: skip
    print(f"load {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
