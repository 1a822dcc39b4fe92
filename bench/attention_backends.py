"""CPU benchmark of the attention backends: `python bench/attention_backends.py [--quick]`.

Times the "xla" paged path (with and without the static hints the engine can pass), the
"cpu" backend (the native kernel on every row) when it builds, the jnp reference, and dense attention over a contiguous cache of the same work
(`jax.nn.dot_product_attention`, XLA implementation), for decode and prefill shaped like
SmolLM2 (9 query / 3 KV heads, head_dim 64, block 16, float32). Prints a markdown table
with ratios and the KV-read bound from a measured memory copy.
"""

from __future__ import annotations

import argparse
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.kernels import cpu, ragged_paged_attention
from jaxpaged.kernels.testing import make_case

HQ, HKV, D, BS = 9, 3, 64, 16


def bench(fn, *args, reps: int = 5) -> float:
    """Best wall seconds of fn(*args) over `reps` calls after one warm-up (compile) call.

    The minimum, not the median: development machines are shared, and interference
    only ever adds time."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.min(times))


def copy_bandwidth() -> float:
    """Bytes/s of an in-place 128 MB update (read + write counted), the memory roofline."""
    f = jax.jit(lambda a: a + 1.0, donate_argnums=0)
    x = f(jnp.ones((32 * 1024 * 1024,), jnp.float32))
    nbytes = x.nbytes
    times = []
    for _ in range(5):
        t = time.perf_counter()
        x = jax.block_until_ready(f(x))
        times.append(time.perf_counter() - t)
    return 2 * nbytes / float(np.min(times))


def dense_attention(q, k, v, lens, *, causal):
    """Attention over a contiguous cache: q [B, T, Hq, D], k/v [B, L, Hkv, D]."""
    return jax.nn.dot_product_attention(
        q,
        k,
        v,
        is_causal=causal,
        key_value_seq_lengths=None if causal else lens,
        implementation="xla",
    )


def run_case(name, seqs, rng, *, dense_shape, bw, reps, with_reference=True):
    max_kv = max(kv for _, kv in seqs)
    max_q = max(q for q, _ in seqs)
    case = make_case(
        rng,
        seqs,
        num_q_heads=HQ,
        num_kv_heads=HKV,
        head_dim=D,
        block_size=BS,
        extra_table_cols=math.ceil(2048 / BS),
        spare_blocks=64,
    )
    args = tuple(map(jnp.asarray, case.args()))
    call = functools.partial(ragged_paged_attention, sm_scale=case.sm_scale)
    rows = {}
    rows["xla"] = bench(jax.jit(functools.partial(call, backend="xla")), *args, reps=reps)
    rows["xla + hints"] = bench(
        jax.jit(functools.partial(call, backend="xla", max_q_len=max_q, max_kv_len=max_kv)),
        *args,
        reps=reps,
    )
    if cpu.available():
        rows["cpu (native)"] = bench(
            jax.jit(functools.partial(call, backend="cpu", max_q_len=max_q, max_kv_len=max_kv)),
            *args,
            reps=reps,
        )
    if with_reference:
        rows["reference"] = bench(
            jax.jit(functools.partial(call, backend="reference")), *args, reps=reps
        )
    b, t, length, causal = dense_shape
    dq = jnp.asarray(rng.standard_normal((b, t, HQ, D)), jnp.float32)
    dk = jnp.asarray(rng.standard_normal((b, length, HKV, D)), jnp.float32)
    lens = jnp.asarray([kv for _, kv in seqs][:b], jnp.int32)
    rows["dense (contiguous)"] = bench(
        jax.jit(functools.partial(dense_attention, causal=causal)), dq, dk, dk, lens, reps=reps
    )
    kv_bytes = sum(kv for _, kv in seqs) * HKV * D * 4 * 2
    bound = kv_bytes / bw
    # Causal attention FLOPs actually needed: 2 matmuls x 2 flops x visible positions.
    flops = sum(4 * HQ * D * sum(kv - q + j + 1 for j in range(q)) for q, kv in seqs)
    out = []
    for backend, sec in rows.items():
        out.append(
            f"| {name} | {backend} | {sec * 1e3:.2f} | {sec / rows['dense (contiguous)']:.2f} "
            f"| {sec / bound:.1f} | {flops / sec / 1e9:.1f} |"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer cases and repetitions")
    opts = parser.parse_args()
    reps = 3 if opts.quick else 7
    rng = np.random.default_rng(0)
    bw = copy_bandwidth()
    print(
        f"jax {jax.__version__} on {jax.devices()[0].device_kind}; copy bandwidth {bw / 1e9:.1f} GB/s"
    )
    print("Times are the best of several calls; 'x dense' is time over dense attention of the")
    print("same work; 'x KV bound' is time over (KV bytes read once / copy bandwidth);")
    print("GFLOP/s counts only the causal attention FLOPs needed.\n")
    print("| case | backend | ms | x dense | x KV bound | GFLOP/s |")
    print("|---|---|---|---|---|---|")
    contexts = (256, 1024) if opts.quick else (128, 512, 2048)
    for ctx in contexts:
        seqs = [(1, ctx)] * 32
        for line in run_case(
            f"decode b=32 ctx={ctx}",
            seqs,
            rng,
            dense_shape=(32, 1, ctx, False),
            bw=bw,
            reps=reps,
            with_reference=ctx <= 512,
        ):
            print(line, flush=True)
    for n, ref in ((128, True), (512, False)):
        for line in run_case(
            f"prefill 1x{n}",
            [(n, n)],
            rng,
            dense_shape=(1, n, n, True),
            bw=bw,
            reps=reps,
            with_reference=ref,
        ):
            print(line, flush=True)
    if not opts.quick:
        mixed = [(512, 512)] + [(1, 512)] * 31
        for line in run_case(
            "mixed 512 prefill + 31 decode ctx=512",
            mixed,
            rng,
            dense_shape=(1, 512, 512, True),
            bw=bw,
            reps=reps,
            with_reference=False,
        ):
            print(line, flush=True)
        print("\n(mixed: 'x dense' compares with the prefill's dense attention alone)")


if __name__ == "__main__":
    main()
