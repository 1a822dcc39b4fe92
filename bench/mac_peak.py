"""The SIMD multiply-accumulate ceiling of this CPU, per core cycle (bench/mac_peak.cc), for
the instructions the native matmuls can use: float32 FMA, int16 vpmaddwd + vpaddd, u8 x s8
vpmaddubsw, and the float32 and int16 matmul register tiles running from L1.

    python bench/mac_peak.py [--seconds 0.3] [--rounds 5]

Built with the kernels' own compiler flags (-O3 -march=native). Each loop runs on one core,
then on every core at once (``--threads``); the clock is measured with a dependent add chain
in the same run, so MACs per cycle hold even where the VM hides its frequency. Prints the
median and range over the rounds. The ratio "x fma" is the instruction's MACs per cycle
over float32 FMA's: the most a matmul that swaps one for the other can gain. Read the ratios:
on a shared VM the absolute figures move with whatever else runs on the same physical core
(float32 FMA measured 7.7-8.7 MACs per add-chain cycle on the 2-vCPU AVX2 EPYC, where a Zen 4
core issues 16).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import statistics
import subprocess
import threading
from pathlib import Path

HERE = Path(__file__).parent
SOURCE = HERE / "mac_peak.cc"
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-march=native")
LOOPS = (
    ("fma_f32", "float32 FMA ymm (12 chains)"),
    ("madd_i16", "int16 vpmaddwd + vpaddd (6 chains)"),
    ("madd_i16_only", "int16 vpmaddwd alone (12 independent)"),
    ("fma_and_madd", "FMA + vpmaddwd/vpaddd interleaved (both)"),
    ("maddubs_u8s8", "u8xs8 vpmaddubsw + vpmaddwd(1) + vpaddd"),
    ("maddubs_u8s8_i16acc", "u8xs8 vpmaddubsw + vpaddsw (int16 sums)"),
    ("tile_f32", "float32 tile 6x16 from L1 (cpu_linear)"),
    ("tile_i16_mr6", "int16 tile 6x16x2 from L1 (cpu_linear_q8)"),
    ("tile_i16_mr5", "int16 tile 5x16x2 from L1"),
    ("tile_i16_mr4", "int16 tile 4x16x2 from L1"),
)


def build() -> ctypes.CDLL:
    """Compile mac_peak.cc once per source and flags into $JAXPAGED_CACHE/bench/."""
    root = Path(os.environ.get("JAXPAGED_CACHE") or Path.home() / ".cache" / "jaxpaged")
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    out = root / "bench" / f"mac_peak_{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["g++", *FLAGS, str(SOURCE), "-o", str(out)], check=True)
    lib = ctypes.CDLL(str(out))
    for name, _ in (("clock_adds", ""), *LOOPS):
        fn = getattr(lib, name)
        fn.argtypes = (ctypes.c_int64, ctypes.POINTER(ctypes.c_double))
        fn.restype = ctypes.c_double
    return lib


def rate(fn, iters: int, threads: int) -> float:
    """Operations per ns on each of `threads` cores at once (the slowest core's figure)."""
    results = [0.0] * threads

    def one(i: int) -> None:
        ns = ctypes.c_double()
        ops = fn(iters, ctypes.byref(ns))  # ctypes releases the GIL for the call
        results[i] = ops / ns.value

    workers = [threading.Thread(target=one, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return min(results)


def calibrate(fn, seconds: float) -> int:
    """Iterations that take about `seconds` on one core."""
    iters = 1000
    while True:
        ns = ctypes.c_double()
        fn(iters, ctypes.byref(ns))
        if ns.value > 2e7:
            return max(1, int(iters * seconds * 1e9 / ns.value))
        iters *= 4


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--seconds", type=float, default=0.3, help="per loop and round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    lib = build()
    names = ("clock_adds", *(name for name, _ in LOOPS))
    iters = {n: calibrate(getattr(lib, n), args.seconds) for n in names}
    for threads in sorted({1, args.threads}):
        per_round: dict[str, list[float]] = {n: [] for n in names}
        for _ in range(args.rounds):  # loops alternated within each round
            for n in names:
                per_round[n].append(rate(getattr(lib, n), iters[n], threads))
        ghz = statistics.median(per_round["clock_adds"])
        print(f"\n{threads} thread(s): core clock {ghz:.2f} GHz "
              f"({min(per_round['clock_adds']):.2f}-{max(per_round['clock_adds']):.2f})")  # fmt: skip
        fma = statistics.median(per_round["fma_f32"]) / ghz
        print(f"{'loop':45s} {'MAC/cycle':>9s} {'range':>13s} {'GMAC/s':>7s} {'x fma':>6s}")
        for name, label in LOOPS:
            runs = per_round[name]
            med = statistics.median(runs) / ghz
            lo, hi = min(runs) / ghz, max(runs) / ghz
            print(f"{label:45s} {med:9.1f} {lo:6.1f}-{hi:6.1f} {med * ghz:7.1f} {med / fma:6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
