"""The native CPU matmul (kernels/cpu/cpu_linear.cc) over float32 and bfloat16 weights, side
by side: a decode step's matmuls (SmolLM2-135M's five projections over 30 stacked layers, each
layer's weights read cold as in a step, plus the tied lm_head) at a few row counts, the two
dtypes alternated call by call in one process; prints medians and the bfloat16 / float32
ratio (below 1: bfloat16 faster).

    python bench/linear_dtypes.py [--rows 1 8 32] [--pairs 9]

bfloat16 weights halve the bytes a step streams; x, the accumulation and the result stay
float32, so where the CPU has no bfloat16 dot product the arithmetic is float32's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.kernels import cpu

# [N, K] of each projection: qkv, o, gate, up, down (SmolLM2-135M: D 576, F 1536, 9+2x3 heads)
LAYER_SHAPES = ((960, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536))
LM_HEAD = (49152, 576)


def _weights(dtype, layers: int, seed: int = 0) -> list[jax.Array]:
    """Per projection, all layers' weights in panel layout: [layers, N, K]."""
    rng = np.random.default_rng(seed)
    out = [rng.standard_normal((layers, n, k), dtype=np.float32) * 0.05 for n, k in LAYER_SHAPES]
    out.append(rng.standard_normal((1, *LM_HEAD), dtype=np.float32) * 0.05)
    return [cpu.pack_panels(jnp.asarray(w, dtype)) for w in out]


def _step_fn(layers: int):
    """A jitted pass: every projection of every layer, then the lm_head, on x [M, 576]."""

    @jax.jit
    def run(ws, x):  # x: float32 [M, 576]
        def body(i, acc):
            for w in ws[:-1]:
                xin = x if w.shape[2] == x.shape[1] else jnp.zeros((x.shape[0], w.shape[2]))
                acc = acc + jnp.sum(cpu.linear(xin, w, i, out_dtype=jnp.float32)[:, :8])
            return acc

        acc = jax.lax.fori_loop(0, layers, body, jnp.float32(0))
        return acc + jnp.sum(cpu.linear(x, ws[-1], 0, out_dtype=jnp.float32)[:, :8])

    return run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--pairs", type=int, default=9)
    p.add_argument("--layers", type=int, default=30)
    args = p.parse_args()
    if not cpu.available():
        raise SystemExit("the native CPU kernels did not build")
    weights = {d: _weights(d, args.layers) for d in (jnp.float32, jnp.bfloat16)}
    run = _step_fn(args.layers)
    print(f"{'rows':>5s} {'float32 ms':>11s} {'bfloat16 ms':>12s} {'bf16 / f32':>11s}  "
          "bf16 faster in")  # fmt: skip
    for m in args.rows:
        x = jnp.asarray(np.random.default_rng(m).standard_normal((m, 576), dtype=np.float32))
        times: dict[object, list[float]] = {jnp.float32: [], jnp.bfloat16: []}
        for d in times:  # compile and warm both
            run(weights[d], x).block_until_ready()
        for _ in range(args.pairs):
            for d in times:
                t0 = time.perf_counter()
                run(weights[d], x).block_until_ready()
                times[d].append(time.perf_counter() - t0)
        f32, bf16 = (statistics.median(times[d]) * 1e3 for d in (jnp.float32, jnp.bfloat16))
        wins = sum(b < f for f, b in zip(times[jnp.float32], times[jnp.bfloat16], strict=True))
        print(f"{m:5d} {f32:11.2f} {bf16:12.2f} {bf16 / f32:10.2f}x  {wins} of {args.pairs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
