"""End-to-end decode throughput of a 1B-class Llama (random bf16 weights, no download) at
several concurrencies, against the HBM roofline measured in the same run: the throughput
figure that bench/accelerator_check.sh (kernels, correctness, a short engine run) leaves out.

    python bench/gpu_decode.py [--json-out FILE] [--attention-backend xla]
    JAX_PLATFORMS=cpu python bench/gpu_decode.py --dry-run   # tiny config: checks the script

Per concurrency S: S requests of --prompt-len random tokens are prefilled, a few decode steps
run untimed (they compile the decode bucket: the engine runs with enforce_eager so only the
shapes used get compiled), then --decode-steps engine.step() calls are timed. Tokens/s =
S / median step time. The roofline step time is (weight bytes + K/V bytes read) / measured
bandwidth (a jitted copy of a large array; read+write bytes over time), and the compute
floor FLOPs / measured bf16 matmul peak is shown beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
from roofline import decode_step_cost  # noqa: E402


def _import_jaxpaged() -> None:
    """Makes ``jaxpaged.kernels`` / ``.models`` / ``.serving`` importable from a plain checkout
    (no ``pip install``) by adding the repository root to the package's search path."""
    root = os.path.dirname(_HERE)
    if root not in sys.path:
        sys.path.insert(0, root)
    import jaxpaged

    try:
        import jaxpaged.kernels  # noqa: F401
    except ImportError:
        jaxpaged.__path__.append(root)
        import jaxpaged.kernels  # noqa: F401


class _IdsTokenizer:
    """Stands in for a tokenizer: the bench sends token ids and never reads the text."""

    eos_token_id = None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "" if not ids else " "


LLAMA_1B = dict(  # Llama-3.2-1B shapes
    model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
    num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500000.0,
    max_position_embeddings=4096, tie_word_embeddings=True, rms_norm_eps=1e-5,
)  # fmt: skip
TINY = dict(
    model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=1024,
    tie_word_embeddings=True,
)  # fmt: skip


def random_params(config: Any, dtype: Any, seed: int = 0) -> Any:
    """Random weights of the right shapes (N(0, 0.02), norms 1), made on the device."""
    import jax
    import jax.numpy as jnp

    from jaxpaged.models.llama import param_shapes

    flat, treedef = jax.tree_util.tree_flatten_with_path(
        param_shapes(config), is_leaf=lambda x: isinstance(x, tuple)
    )

    @jax.jit
    def make(key: jax.Array) -> list[jax.Array]:  # one program for the whole tree
        keys = jax.random.split(key, len(flat))
        return [
            jnp.ones(shape, dtype)
            if "norm" in jax.tree_util.keystr(path)
            else (0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype)
            for (path, shape), k in zip(flat, keys, strict=True)
        ]

    return jax.tree_util.tree_unflatten(treedef, make(jax.random.PRNGKey(seed)))


def measure_device_peaks(
    *, matmul_n: int, copy_mib: int, dtype: Any, repeats: int = 10
) -> dict[str, float]:
    """bf16 matmul FLOP/s and copy bandwidth (read + write bytes / s) on the default device."""
    import jax
    import jax.numpy as jnp

    def best(fn: Any, *a: Any) -> float:
        jax.block_until_ready(fn(*a))
        t = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*a))
            t = min(t, time.perf_counter() - t0)
        return t

    a = jnp.ones((matmul_n, matmul_n), dtype)
    mm = jax.jit(lambda x: x @ x)
    n = copy_mib * (1 << 20) // 4
    big = jnp.ones((n,), jnp.float32)
    copy = jax.jit(lambda x: x + 1.0)
    red = jax.jit(jnp.sum)
    return {
        "matmul_flops": 2.0 * matmul_n**3 / best(mm, a),
        "copy_bandwidth": 2.0 * big.nbytes / best(copy, big),
        "read_bandwidth": big.nbytes / best(red, big),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    _import_jaxpaged()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxpaged import SamplingParams
    from jaxpaged.config import CacheConfig, ProcessConfig, SchedulerConfig
    from jaxpaged.engine import LLMEngine, process_owner_args
    from jaxpaged.models.config import ModelConfig

    dtype = jnp.bfloat16
    config = ModelConfig(**(TINY if args.dry_run else LLAMA_1B))
    levels = [int(x) for x in args.concurrency.split(",")]
    max_s = max(levels)
    total_len = args.prompt_len + args.warm_steps + args.decode_steps + 8
    max_model_len = 1 << (total_len - 1).bit_length()
    blocks_per_seq = -(-total_len // 16) + 1
    print(f"device: {jax.devices()[0]} (jax {jax.__version__}); model {config.num_layers} layers, "
          f"hidden {config.hidden_size}, vocab {config.vocab_size}, bf16", flush=True)  # fmt: skip

    peaks = measure_device_peaks(matmul_n=args.matmul_n, copy_mib=args.copy_mib, dtype=dtype)
    bw = peaks["copy_bandwidth"]
    print(f"measured: matmul {peaks['matmul_flops'] / 1e12:.1f} TFLOP/s bf16, copy "
          f"{bw / 1e9:.0f} GB/s, read {peaks['read_bandwidth'] / 1e9:.0f} GB/s", flush=True)  # fmt: skip

    t0 = time.perf_counter()
    params = random_params(config, dtype)
    jax.block_until_ready(params)
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    print(f"random params: {n_params / 1e9:.3f} B in {time.perf_counter() - t0:.1f} s", flush=True)
    engine = LLMEngine(
        model_config=config,
        params=params,
        tokenizer=_IdsTokenizer(),
        cache_config=CacheConfig(
            num_kv_blocks=max_s * blocks_per_seq + 64, enable_prefix_caching=False
        ),  # fmt: skip
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_s,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=max_model_len,
        ),  # fmt: skip
        enforce_eager=True,
        attention_backend=args.attention_backend,
        show_progress=False,
        process_config=ProcessConfig(**process_owner_args()),
    )
    rng = np.random.default_rng(0)
    rows = []
    for s in levels:
        t0 = time.perf_counter()
        sp = SamplingParams(temperature=0.0, ignore_eos=True,
                            max_tokens=args.warm_steps + args.decode_steps + 4)  # fmt: skip
        ids = [f"s{s}-{i}" for i in range(s)]
        for rid in ids:
            engine.add_request(
                rid, rng.integers(0, config.vocab_size, args.prompt_len).tolist(), sp
            )
        started: set[str] = set()
        while len(started) < s:
            for out in engine.step():
                if out.outputs[0].token_ids:
                    started.add(out.request_id)
        prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(args.warm_steps):
            engine.step()
        warm_s = time.perf_counter() - t0
        times = []
        for i in range(args.decode_steps):
            t1 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t1)
            if i == args.decode_steps // 2:
                ctx = [r.num_tokens for r in engine.scheduler.running]
        running = len(engine.scheduler.running)
        for rid in ids:
            engine.abort(rid)
        med = statistics.median(times)
        cost = decode_step_cost(config, ctx, dtype_bytes=2)
        roof = max(cost.bytes / bw, cost.flops / peaks["matmul_flops"])
        row = {
            "concurrency": s, "running": running, "median_step_ms": 1e3 * med,
            "tok_s": s / med, "roofline_step_ms": 1e3 * roof, "roofline_tok_s": s / roof,
            "fraction_of_roofline": roof / med, "hbm_ms": 1e3 * cost.bytes / bw,
            "compute_ms": 1e3 * cost.flops / peaks["matmul_flops"], "weight_gb": cost.weight_bytes / 1e9,
            "kv_gb": cost.kv_bytes / 1e9, "prefill_s": prefill_s, "warm_steps_s": warm_s,
        }  # fmt: skip
        rows.append(row)
        print(f"S={s:4d}: step {row['median_step_ms']:7.2f} ms -> {row['tok_s']:9.0f} tok/s | "
              f"roofline {row['roofline_step_ms']:6.2f} ms ({row['roofline_tok_s']:9.0f} tok/s; "
              f"HBM {row['hbm_ms']:.2f} ms for {row['weight_gb']:.2f}+{row['kv_gb']:.2f} GB, "
              f"compute {row['compute_ms']:.2f} ms) = {100 * row['fraction_of_roofline']:.0f}% | "
              f"prefill {prefill_s:.1f} s, first steps {warm_s:.1f} s", flush=True)  # fmt: skip
    return {"peaks": peaks, "rows": rows, "args": vars(args), "jax": jax.__version__,
            "device": str(jax.devices()[0]), "compilations_total": engine.get_stats().num_compilations}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--dry-run", action="store_true", help="tiny config, small sizes (CPU check)")
    p.add_argument("--concurrency", default=None, help="default 1,64,256 (dry run 1,4,8)")
    p.add_argument("--prompt-len", type=int, default=None, help="default 448 (dry run 24)")
    p.add_argument("--warm-steps", type=int, default=4)
    p.add_argument("--decode-steps", type=int, default=None, help="default 32 (dry run 4)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="default 4096 (dry 64)")
    p.add_argument("--attention-backend", default=None, choices=("pallas", "xla", "reference"))
    p.add_argument("--matmul-n", type=int, default=None)
    p.add_argument("--copy-mib", type=int, default=None)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    dry = args.dry_run
    defaults = dict(concurrency="1,4,8" if dry else "1,64,256", prompt_len=24 if dry else 448,
                    decode_steps=4 if dry else 32, max_num_batched_tokens=64 if dry else 4096,
                    matmul_n=256 if dry else 8192, copy_mib=16 if dry else 4096)  # fmt: skip
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    result = run(args)
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
