"""CPU seconds to the first printed token of a one-shot `jaxpaged generate`, and peak RSS.

Runs the command in a fresh process ``--runs`` times. The process records its own user+sys
CPU time (``time.process_time``: since it started, interpreter start-up included) when it
first writes to stdout, so neither a busy machine's waiting nor the tokens generated while
a reader is scheduled count; peak RSS comes from ``wait4``. Linux only. Usage:

    python bench/cold_start.py [--runs 5] [-- extra generate flags]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

COMMAND = ["generate", "--chat", "--max-tokens", "32", "What is the capital of France?"]


# run in the child: `jaxpaged ARGS`, stdout's first write stamped with the CPU time so far
_CHILD = """
import os, runpy, sys, time
out, stamp = sys.stdout, []
class _Stamped:
    def write(self, text):
        if text and not stamp:
            stamp.append(time.process_time())
            os.write(2, f"\\nfirst-token-cpu {stamp[0]:.4f} {time.time():.4f}\\n".encode())
        return out.write(text)
    def __getattr__(self, name):
        return getattr(out, name)
sys.stdout = _Stamped()
sys.argv = ["jaxpaged", *sys.argv[1:]]
runpy.run_module("jaxpaged", run_name="__main__")
"""


def one_run(extra: list[str]) -> tuple[float, float, float, float, str]:
    """(CPU s and wall s to the first stdout write, wall s of the whole run, peak RSS MB, the
    output). The wall clock starts before the process is created."""
    started_at = time.time()
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, *COMMAND, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = proc.stdout.read(), proc.stderr.read()  # type: ignore[union-attr]
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if status != 0:
        raise RuntimeError(f"generate exited with status {status}: {err.decode()[-2000:]}")
    stamps = [line for line in err.decode().splitlines() if line.startswith("first-token-cpu ")]
    _, cpu, first_at = stamps[0].split()
    return float(cpu), float(first_at) - started_at, wall, usage.ru_maxrss / 1024, out.decode()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("extra", nargs="*", help="more generate flags (after --)")
    args = p.parse_args()
    one_run(args.extra)  # fills the caches
    rows = []
    for _ in range(args.runs):
        cpu, first_wall, wall, rss, text = one_run(args.extra)
        rows.append((cpu, first_wall, rss))
        print(
            f"first token {cpu:.2f} CPU s, {first_wall:.2f} s wall (run {wall:.2f} s wall), "
            f"peak RSS {rss:.0f} MB",
            flush=True,
        )
    print(f"output: {text.strip()!r}")
    print(
        f"median first token {statistics.median(r[0] for r in rows):.2f} CPU s, "
        f"{statistics.median(r[1] for r in rows):.2f} s wall, "
        f"peak RSS {min(r[2] for r in rows):.0f}-{max(r[2] for r in rows):.0f} MB, "
        f"load {os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    main()
