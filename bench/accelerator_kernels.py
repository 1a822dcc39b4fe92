"""The first stages of bench/accelerator_check.py (versions, compile, correctness) and what
every stage shares: the line-by-line report with its deadline, the kernels under test."""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


def import_jaxpaged() -> None:
    """``jaxpaged.kernels`` / ``.models`` from a plain checkout (no pip install, no network)."""
    root = os.path.dirname(HERE)
    if root not in sys.path:
        sys.path.insert(0, root)
    import jaxpaged

    try:
        import jaxpaged.kernels  # noqa: F401
    except ImportError:
        jaxpaged.__path__.append(root)


class Report:
    """Lines to stdout and to the report file as they come; the deadline every stage asks."""

    def __init__(self, out_dir: str | None, deadline_s: float, *, reserve: float) -> None:
        self.start = time.monotonic()
        self.deadline_s = deadline_s
        self.reserve = reserve  # seconds a stage or case needs to start
        self.failures = 0
        self.file = None
        if out_dir:
            os.makedirs(out_dir, exist_ok=True)
            self.file = open(os.path.join(out_dir, "accelerator_check.md"), "a")  # noqa: SIM115

    def stage(self, title: str) -> None:
        """A stage's heading, with the seconds spent so far."""
        self.line(f"\n## {title} (at {time.monotonic() - self.start:.0f} s)\n")

    def line(self, text: str = "") -> None:
        print(text, flush=True)
        if self.file is not None:
            self.file.write(text + "\n")
            self.file.flush()

    def left(self) -> float:
        return self.deadline_s - (time.monotonic() - self.start)

    def fail(self, what: str, error: BaseException) -> None:
        self.failures += 1
        self.line(f"FAIL {what}: {type(error).__name__}: {str(error)[:300]}")
        self.line("```\n" + traceback.format_exc()[-4000:] + "```")


# ---------------------------------------------------------------- stage 0: versions
def versions(rep: Report) -> str:
    import jax

    dev = jax.devices()[0]
    rep.line("# jaxpaged accelerator check\n")
    import jaxlib

    rep.line(f"python {sys.version.split()[0]}, jax {jax.__version__}, jaxlib {jaxlib.__version__}")
    rep.line(f"device: {dev.device_kind} ({dev.platform}), {jax.device_count()} device(s)")
    try:
        cuda = getattr(jax._src.lib, "cuda_versions", None)  # noqa: SLF001
        if cuda is not None:
            rep.line(f"CUDA runtime {cuda.cuda_runtime_get_version()}, "
                     f"cuDNN {cuda.cudnn_get_version()}")  # fmt: skip
    except Exception as e:  # versions are informative only
        rep.line(f"(CUDA versions unavailable: {type(e).__name__})")
    return dev.platform


# ---------------------------------------------------------------- kernels under test
def kernel_backend(platform: str) -> str:
    return "tpu" if platform == "tpu" else "pallas"


def attention(backend: str, interpret: bool) -> Callable[..., Any]:
    from jaxpaged.kernels import ragged_paged_attention

    def call(*args: Any, **kw: Any) -> Any:
        if backend == "pallas":
            kw["interpret"] = interpret
        return ragged_paged_attention(*args, backend=backend, **kw)

    return call


def case_args(rng: Any, seqs: list, *, hq: int, hkv: int, d: int, bs: int, dtype: str, **kw):
    import jax.numpy as jnp

    from jaxpaged.kernels.testing import DTYPES, make_case

    case = make_case(rng, seqs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
                     dtype=DTYPES[dtype], **kw)  # fmt: skip
    return case, tuple(map(jnp.asarray, case.args()))


# ---------------------------------------------------------------- stage 1: compile
def compile_stage(rep: Report, backend: str, interpret: bool, small: bool) -> None:
    import jax
    import numpy as np

    rep.stage("Compile one decode and one prefill shape")
    rng = np.random.default_rng(0)
    attend = attention(backend, interpret)
    shapes = [("decode", [(1, 40 if small else 2000)] * 4, 1),
              ("prefill", [(17 if small else 512, 17 if small else 512)], None)]  # fmt: skip
    shape = dict(hq=4, hkv=1, d=64) if small else dict(hq=8, hkv=2, d=128)
    for name, seqs, max_q_len in shapes:
        if rep.left() < rep.reserve:
            rep.line(f"- {name}: skipped: deadline")
            continue
        case, args = case_args(rng, seqs, **shape, bs=16, dtype="bfloat16")
        t = time.perf_counter()
        try:
            scale = case.sm_scale
            fn = jax.jit(lambda *a, m=max_q_len, s=scale: attend(*a, sm_scale=s, max_q_len=m))
            jax.block_until_ready(fn(*args))
            rep.line(f"- {name}: compiled and ran in {time.perf_counter() - t:.1f} s")
        except Exception as e:
            rep.fail(f"compile {name}", e)


# ---------------------------------------------------------------- stage 2: correctness
def correctness_cases(platform: str, small: bool) -> list[tuple[str, dict, list, dict]]:
    """bfloat16 first, then float16 (not on TPU), float32, head_dim 256 last."""
    long = 40 if small else 1500
    mixed = [(1, long), (1, 37), (30, 30), (12, 70), (1, 9)]
    dtypes = ["bfloat16"] + ([] if platform == "tpu" else ["float16"]) + ["float32"]
    cases = []
    for dtype in dtypes:
        for label, shape, extra in (
            ("32q/8kv d128 bs16", dict(hq=32, hkv=8, d=128, bs=16), {}),
            ("9q/3kv d64 bs16 window+cap", dict(hq=9, hkv=3, d=64, bs=16),
             dict(sliding_window=50, soft_cap=30.0)),
        ):  # fmt: skip
            cases.append((f"{label} mixed", dict(shape, dtype=dtype), mixed, dict(extra)))
            cases.append((f"{label} decode-only, wide table", dict(shape, dtype=dtype),
                          [(1, long), (1, 5), (1, 300 if not small else 20)],
                          dict(extra, max_q_len=1, extra_table_cols=64 if small else 500)))  # fmt: skip
    for dtype in dtypes:
        cases.append(("16q/4kv d256 bs16 mixed", dict(hq=16, hkv=4, d=256, bs=16, dtype=dtype),
                      mixed, {}))  # fmt: skip
    if small:  # a dry run: head_dim 256, mixed decode and prefill
        return [cases[-1]]
    return cases


def correctness_stage(rep: Report, platform: str, interpret: bool, small: bool) -> None:
    import jax
    import numpy as np

    from jaxpaged.kernels.testing import TOLERANCE, rel_err

    rep.stage("Correctness against the reference (relative error, fresh random inputs)")
    seed = int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    rep.line(
        f"seed {seed}\n\n| case | dtype | {kernel_backend(platform)} | limit |\n|---|---|---|---|"
    )
    reference = attention("reference", False)
    attend = attention(kernel_backend(platform), interpret)
    for label, shape, seqs, extra in correctness_cases(platform, small):
        if rep.left() < rep.reserve:
            rep.line(f"| {label} | {shape['dtype']} | skipped: deadline | |")
            continue
        extra = dict(extra)
        make_kw = {k: extra.pop(k) for k in ("extra_table_cols",) if k in extra}
        try:
            case, args = case_args(rng, seqs, **shape, max_seqs=8, pad_tokens=3, **make_kw)
            opts = dict(sm_scale=case.sm_scale, **extra)
            with jax.default_matmul_precision("highest"):
                ref = reference(*args, **{k: v for k, v in opts.items() if k != "max_q_len"})
                out = attend(*args, **opts)
            err = rel_err(out, ref)
            total = sum(q for q, _ in seqs)
            pad_ok = bool(np.all(np.asarray(out.astype("float32"))[total:] == 0))
            ok = err < TOLERANCE[shape["dtype"]] and pad_ok
            rep.failures += not ok
            verdict = "" if ok else (" FAIL" if pad_ok else " FAIL (padding rows)")
            rep.line(f"| {label} | {shape['dtype']} | {err:.1e}{verdict} | "
                     f"{TOLERANCE[shape['dtype']]:g} |")  # fmt: skip
        except Exception as e:
            rep.fail(f"correctness {label} {shape['dtype']}", e)
