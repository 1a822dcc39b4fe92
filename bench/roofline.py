"""Machine peaks (matmul FLOP/s, memory read bandwidth), the roofline of one decode step and
the useful FLOPs of a prefill.

A decode step of S sequences must at least (a) read every weight once and the K/V of every
cached token once, and (b) do ~2 FLOPs per weight per sequence plus the attention dot
products. Its roofline time is the larger of bytes / bandwidth and FLOPs / matmul peak,
both measured on this machine in the same run (``python bench/roofline.py`` prints them).

FLOPs of prefilling a prompt of L tokens: 2 x (matmul parameters of every layer) per token,
the lm_head once (only the last position is sampled), and causal attention, q.k and p.v over
the L(L+1)/2 visible pairs: 2 x layers x heads x head_dim x L(L+1) in all.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "DecodeCost",
    "MachinePeaks",
    "decode_step_cost",
    "measure_peaks",
    "param_count",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class MachinePeaks:
    matmul_flops: float  # FLOP/s, best of numpy and jax
    mem_bandwidth: float  # bytes/s read, best of numpy and jax reductions
    dtype: str
    detail: dict[str, float]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeCost:
    matmul_flops: float  # the projections and the lm_head
    attn_flops: float  # q.k and p.v over the cached tokens
    weight_bytes: float
    kv_bytes: float

    @property
    def flops(self) -> float:
        return self.matmul_flops + self.attn_flops

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes

    def roofline_seconds(self, peaks: MachinePeaks) -> float:
        return max(self.flops / peaks.matmul_flops, self.bytes / peaks.mem_bandwidth)

    def bound(self, peaks: MachinePeaks) -> str:
        t_c = self.flops / peaks.matmul_flops
        return "compute" if t_c >= self.bytes / peaks.mem_bandwidth else "memory"

    def serial_seconds(self, peaks: MachinePeaks) -> float:
        """The matmuls (weights streamed under their FLOPs), then the attention (KV read
        under its FLOPs): the floor of a step whose attention cannot overlap its matmuls, as
        on a CPU where both phases use every core. The roofline above assumes they overlap."""
        matmuls = max(
            self.matmul_flops / peaks.matmul_flops, self.weight_bytes / peaks.mem_bandwidth
        )
        attention = max(self.attn_flops / peaks.matmul_flops, self.kv_bytes / peaks.mem_bandwidth)
        return matmuls + attention


def _best_time(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm (and compile)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_peaks(
    *,
    dtype: str = "float32",
    matmul_n: int = 2048,
    bandwidth_mib: int = 512,
    repeats: int = 5,
    use_jax: bool = True,
) -> MachinePeaks:
    """Best-of-``repeats`` n^3 matmul FLOP/s and large-array read bandwidth (a sum over
    ``bandwidth_mib`` MiB, far larger than any cache), with numpy and (if ``use_jax``) jax."""
    rng = np.random.default_rng(0)
    np_dtype = np.float32 if dtype == "float32" else np.float64
    a = rng.standard_normal((matmul_n, matmul_n), dtype=np.float32).astype(np_dtype)
    b = rng.standard_normal((matmul_n, matmul_n), dtype=np.float32).astype(np_dtype)
    flops = 2.0 * matmul_n**3
    n_elem = bandwidth_mib * (1 << 20) // 4
    big = rng.standard_normal(n_elem, dtype=np.float32)
    detail = {
        "numpy_matmul": flops / _best_time(lambda: a @ b, repeats),
        "numpy_read": big.nbytes / _best_time(lambda: big.sum(), repeats),
    }
    if use_jax:
        import jax
        import jax.numpy as jnp

        ja, jb = jnp.asarray(a, dtype=dtype), jnp.asarray(b, dtype=dtype)
        jbig = jnp.asarray(big)
        mm = jax.jit(lambda x, y: x @ y)
        red = jax.jit(lambda x: jnp.sum(x))
        detail["jax_matmul"] = flops / _best_time(lambda: mm(ja, jb).block_until_ready(), repeats)
        detail["jax_read"] = jbig.nbytes / _best_time(
            lambda: red(jbig).block_until_ready(), repeats
        )
    return MachinePeaks(
        matmul_flops=max(v for k, v in detail.items() if k.endswith("matmul")),
        mem_bandwidth=max(v for k, v in detail.items() if k.endswith("read")),
        dtype=dtype,
        detail=detail,
    )


def param_count(config: Any) -> dict[str, int]:
    """Parameters of a Llama-family ModelConfig: per-layer matmul weights, embedding, lm_head."""
    c = config
    d, f, hd = c.hidden_size, c.intermediate_size, c.head_dim
    qkv = d * (c.num_heads + 2 * c.num_kv_heads) * hd
    o = c.num_heads * hd * d
    mlp = 3 * d * f
    layer_matmul = qkv + o + mlp
    return {
        "layer_matmul": layer_matmul,
        "layers_total": c.num_layers * (layer_matmul + 2 * d),
        "embed": c.vocab_size * d,
        "lm_head": c.vocab_size * d,  # the tied embedding is read in full as the lm_head
        "total": c.num_layers * (layer_matmul + 2 * d)
        + c.vocab_size * d * (1 if c.tie_word_embeddings else 2)
        + d,
    }


def decode_step_cost(config: Any, context_lens: Sequence[int], *, dtype_bytes: int) -> DecodeCost:
    """FLOPs and bytes of one decode step of ``len(context_lens)`` sequences, each attending
    to ``context_lens[i]`` cached tokens (its new one included). Bytes: all layer weights and
    the lm_head once (embedding lookups are a few rows, ignored) and each sequence's K and V."""
    c = config
    s = len(context_lens)
    n = param_count(c)
    ctx = float(sum(context_lens))
    matmul_flops = 2.0 * s * (c.num_layers * n["layer_matmul"] + n["lm_head"])
    attn_flops = 4.0 * c.num_layers * c.num_heads * c.head_dim * ctx  # q.k and p.v
    weight_bytes = dtype_bytes * (n["layers_total"] + n["lm_head"])
    kv_bytes = dtype_bytes * 2.0 * c.num_layers * c.num_kv_heads * c.head_dim * ctx
    return DecodeCost(
        matmul_flops=matmul_flops,
        attn_flops=attn_flops,
        weight_bytes=weight_bytes,
        kv_bytes=kv_bytes,
    )


def prefill_flops(config: Any, prompt_len: int) -> float:
    """Useful FLOPs of prefilling one ``prompt_len``-token prompt (see the module docstring)."""
    c = config
    n = param_count(c)
    matmuls = 2.0 * (prompt_len * c.num_layers * n["layer_matmul"] + n["lm_head"])
    attention = 2.0 * c.num_layers * c.num_heads * c.head_dim * prompt_len * (prompt_len + 1)
    return matmuls + attention


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--matmul-n", type=int, default=2048)
    p.add_argument("--bandwidth-mib", type=int, default=512)
    p.add_argument("--no-jax", action="store_true")
    args = p.parse_args(argv)
    peaks = measure_peaks(
        matmul_n=args.matmul_n, bandwidth_mib=args.bandwidth_mib, use_jax=not args.no_jax
    )
    for k, v in peaks.detail.items():
        unit = "GFLOP/s" if k.endswith("matmul") else "GB/s"
        print(f"{k:14s} {v / 1e9:8.1f} {unit}")
    print(f"peak matmul {peaks.matmul_flops / 1e9:.1f} GFLOP/s, "
          f"read bandwidth {peaks.mem_bandwidth / 1e9:.1f} GB/s")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
