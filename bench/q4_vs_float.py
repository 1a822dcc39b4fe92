"""The native 4-bit matmul (linear_q4, G=32) against the float32 panel matmul, by rows, in one
process: 30 layers of SmolLM2-135M's MLP shapes (576 -> 1536 -> 576) per call, the two kernels
interleaved, medians. Prints q4 time / float32 time per row count (lower is better).

    python bench/q4_vs_float.py [--rows 1,2,3,4,6,8,16,32] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--rows", default="1,2,3,4,6,8,16,32")
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxpaged.kernels import cpu
    from jaxpaged.kernels.cpu.linear_q4 import linear_q4
    from jaxpaged.models.quant.grouped import quantize_grouped

    layers = 30
    rng = np.random.default_rng(0)
    wu = rng.normal(0, 0.05, (layers, 1536, 576)).astype(np.float32)
    wd = rng.normal(0, 0.05, (layers, 576, 1536)).astype(np.float32)
    q = [jax.tree.map(jnp.asarray, quantize_grouped(w, 1, 32, 4)) for w in (wu, wd)]
    f = [cpu.pack_panels(jnp.asarray(w)) for w in (wu, wd)]

    def make(lin, up, down):
        @jax.jit
        def run(x):  # [M, 576]
            return jax.lax.fori_loop(0, layers, lambda i, x: lin(lin(x, up, i), down, i) * 0.01, x)

        return run

    fq, ff = make(linear_q4, *q), make(cpu.linear, *f)
    for m in (int(v) for v in args.rows.split(",")):
        x = jnp.asarray(rng.normal(0, 1, (m, 576)), jnp.float32)
        fq(x).block_until_ready()
        ff(x).block_until_ready()
        times: dict[str, list[float]] = {"q4": [], "f32": []}
        for _ in range(args.repeats):
            for name, fn in (("q4", fq), ("f32", ff)):
                start = time.perf_counter()
                fn(x).block_until_ready()
                times[name].append(time.perf_counter() - start)
        tq, tf = statistics.median(times["q4"]), statistics.median(times["f32"])
        print(f"rows {m:3d}: q4 {tq * 1e3:7.2f} ms, float32 {tf * 1e3:7.2f} ms, "
              f"q4 / float32 {tq / tf:.2f}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
