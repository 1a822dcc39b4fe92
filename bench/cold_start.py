"""CPU seconds to the first printed token of a one-shot `jaxpaged generate`, and peak RSS.

Runs the command in a fresh process ``--runs`` times; at the first byte on its stdout it reads
the process's user+sys time from /proc (so a busy machine's waiting does not count), then
lets it finish and reads its peak RSS. Linux only. Usage:

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


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_run(extra: list[str]) -> tuple[float, float, float, str]:
    """(CPU s to the first stdout byte, wall s to it, peak RSS MB, the output)."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxpaged", *COMMAND, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    first = proc.stdout.read(1)
    cpu, wall = _cpu_s(proc.pid), time.perf_counter() - start
    rest = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise RuntimeError(f"generate exited with status {status}")
    return cpu, wall, usage.ru_maxrss / 1024, (first + rest).decode()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("extra", nargs="*", help="more generate flags (after --)")
    args = p.parse_args()
    one_run(args.extra)  # fills the caches
    rows = []
    for _ in range(args.runs):
        cpu, wall, rss, text = one_run(args.extra)
        rows.append((cpu, wall, rss))
        print(f"first token {cpu:.2f} CPU s ({wall:.2f} wall), peak RSS {rss:.0f} MB", flush=True)
    print(f"output: {text.strip()!r}")
    print(
        f"median first token {statistics.median(r[0] for r in rows):.2f} CPU s, "
        f"peak RSS {min(r[2] for r in rows):.0f}-{max(r[2] for r in rows):.0f} MB, "
        f"load {os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    main()
