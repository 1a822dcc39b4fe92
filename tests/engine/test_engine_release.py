"""An engine that is closed or dropped releases its compiled programs and device memory.

One process (release_worker.py) builds warmed-up engines of distinct shapes in turn (6; 60
with JAXPAGED_TEST_FULL=1: ~5 s each on 2 cores),
through LLM and a checkpoint folder, closing half of them and only dropping the others.
Each engine compiles its own programs (a step program holds its machine code in memory
mappings of its own), so an engine that kept them would add ~800 lines of /proc/self/maps
and tens of MiB each: a process that built many engines grew until LLVM could not map its
code ("Unable to allocate section memory"). The mappings and resident memory added over the
second half of the engines must stay within a few per engine and within what the first half
added.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
NUM_ENGINES = 60 if os.environ.get("JAXPAGED_TEST_FULL") == "1" else 6
HALF = NUM_ENGINES // 2
# what JAX keeps process-wide whatever the engine does (traces of the jnp calls a model's
# loading makes outside any jit, one per distinct shape) measured ~8 lines and ~20 MiB per
# engine, alike in both halves
MAPS_PER_ENGINE = 20
RSS_MARGIN_MIB = 5 * HALF  # allocator slack


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps")
def test_closed_or_dropped_engines_release_programs_and_memory():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    # the machine code's speed is not the point: LLVM's cheapest level halves compile time
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # every program compiled and mapped in-process
    proc = subprocess.run(
        [sys.executable, str(HERE / "release_worker.py"), str(NUM_ENGINES)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    lines = [json.loads(s) for s in proc.stdout.splitlines() if s.startswith("{")]
    assert proc.returncode == 0 and len(lines) == NUM_ENGINES, (
        f"exit {proc.returncode}, {len(lines)} engines\n{proc.stderr[-4000:]}"
    )
    assert all(line["programs"] > 0 for line in lines)  # each engine warmed up its own
    maps = [line["maps"] for line in lines]
    rss = [line["rss_mib"] for line in lines]
    first_maps, last_maps = maps[HALF - 1] - maps[0], maps[-1] - maps[HALF - 1]
    first_rss, last_rss = rss[HALF - 1] - rss[0], rss[-1] - rss[HALF - 1]
    report = f"maps {maps}\nresident MiB {[round(r) for r in rss]}"
    assert last_maps <= MAPS_PER_ENGINE * HALF, report
    assert last_maps <= max(first_maps, 0) + MAPS_PER_ENGINE * HALF // 2, report
    assert last_rss <= max(first_rss, 0) + RSS_MARGIN_MIB, report
