"""The native matmuls per layer shape of the bundled SmolLM2, float32 against int8 and 4-bit
weights, side by side in one process: where the quantized kernels lose to float32.

    python bench/quant_shapes.py [--rows 32 1] [--rounds 7] [--formats float32,int8,q4_1]

Each shape's call runs over its 30 stacked layers in one jitted loop (every layer's weight
read cold, as in a decode step; the lm_head once), the formats alternated round by round.
Prints per format the median ms per call (range), GFLOP/s and the share of the float32 FMA
peak measured in the same run (bench/mac_peak.cc on every core at once), and the time against
float32's (below 1: faster). Formats: float32 and bfloat16 (cpu.linear), int8 (per-output
scales, linear_q8), q4_1 (GGUF's 4-bit with scale and min per 32 inputs, linear_q4) and
q8_0 (8-bit per 32 inputs, linear_q4: the bundled GGUF's embedding, so its lm_head).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from mac_peak import build as build_mac_peak
from mac_peak import calibrate, rate

from jaxpaged.kernels import cpu
from jaxpaged.kernels.cpu.linear_q4 import linear_q4
from jaxpaged.kernels.cpu.linear_q8 import linear_q8, pack_panels_q8
from jaxpaged.models.quant.grouped import quantize_grouped
from jaxpaged.models.quant.weights import quantize_array

# name -> (N, K, layers): SmolLM2-135M (D 576, F 1536, 9 query + 3 KV heads of 64)
SHAPES = {
    "qkv": (960, 576, 30),
    "o": (576, 576, 30),
    "gate/up": (1536, 576, 60),  # two calls a layer
    "down": (576, 1536, 30),
    "lm_head": (49152, 576, 1),
}
FORMATS = ("float32", "bfloat16", "int8", "q4_1", "q8_0")


def make_weight(fmt: str, w: np.ndarray) -> object:  # w: float32 [L, N, K]
    """``w`` in the kernel layout of ``fmt``."""
    if fmt in ("float32", "bfloat16"):
        return cpu.pack_panels(jnp.asarray(w, fmt))
    if fmt == "int8":
        return pack_panels_q8(jax.tree.map(jnp.asarray, quantize_array(w, 1, "int8")))
    bits = 4 if fmt == "q4_1" else 8
    return jax.tree.map(jnp.asarray, quantize_grouped(w, 1, 32, bits))


def matmul(fmt: str):
    """The kernel call of ``fmt``: (x [M, K], weight, layer) -> [M, N]."""
    if fmt in ("float32", "bfloat16"):
        return lambda x, w, i: cpu.linear(x, w, i, out_dtype=jnp.float32)
    if fmt == "int8":
        return lambda x, w, i: linear_q8(x, w, i, out_dtype=jnp.float32)
    return lambda x, w, i: linear_q4(x, w, i, out_dtype=jnp.float32)


def runner(fmt: str, layers: int):
    """A jitted pass over every layer of one shape, summing a corner of each product."""
    call = matmul(fmt)

    @jax.jit
    def run(w, x):  # x: float32 [M, K]
        def body(i, acc):
            return acc + jnp.sum(call(x, w, i)[:, :8])

        return jax.lax.fori_loop(0, layers, body, jnp.float32(0))

    return run


def fma_peak_gflops() -> float:
    """float32 FMA GFLOP/s of the whole machine (every core at once), from mac_peak.cc."""
    lib = build_mac_peak()
    iters = calibrate(lib.fma_f32, 0.2)
    threads = os.cpu_count() or 1
    return 2 * threads * statistics.median(rate(lib.fma_f32, iters, threads) for _ in range(3))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--rows", type=int, nargs="+", default=[32, 1])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--formats", default="float32,int8,q4_1")
    p.add_argument("--shapes", default=",".join(SHAPES))
    args = p.parse_args()
    if not cpu.available():
        raise SystemExit("the native CPU kernels did not build")
    formats = args.formats.split(",")
    peak = fma_peak_gflops()
    print(f"float32 FMA peak, all cores: {peak:.1f} GFLOP/s (uptime: {os.getloadavg()[0]:.1f})")
    rng = np.random.default_rng(0)
    print(f"{'shape':8s} {'rows':>4s} {'format':8s} {'ms/call':>8s} {'range':>13s} "
          f"{'GFLOP/s':>8s} {'% peak':>6s} {'x f32':>6s}")  # fmt: skip
    for name in args.shapes.split(","):
        n, k, layers = SHAPES[name]
        w = rng.standard_normal((layers, n, k), dtype=np.float32) * 0.05
        weights = {f: make_weight(f, w) for f in formats}
        del w
        for m in args.rows:
            x = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32))
            runs = {f: runner(f, layers) for f in formats}
            for f in formats:  # compile and warm
                runs[f](weights[f], x).block_until_ready()
            times: dict[str, list[float]] = {f: [] for f in formats}
            for _ in range(args.rounds):
                for f in formats:
                    t0 = time.perf_counter()
                    runs[f](weights[f], x).block_until_ready()
                    times[f].append((time.perf_counter() - t0) / layers)
            base = statistics.median(times[formats[0]])
            for f in formats:
                med = statistics.median(times[f])
                gflops = 2 * m * n * k / med / 1e9
                print(f"{name:8s} {m:4d} {f:8s} {med * 1e3:8.3f} "
                      f"{min(times[f]) * 1e3:6.3f}-{max(times[f]) * 1e3:6.3f} "
                      f"{gflops:8.1f} {100 * gflops / peak:6.1f} {med / base:6.2f}")  # fmt: skip
        del weights
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
