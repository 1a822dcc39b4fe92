"""The malloc tuning that keeps XLA:CPU's per-step buffers mapped (jaxpaged.kernels.cpu.host_malloc).

Fresh processes (tuned; with JAXPAGED_TEST_FULL=1 first an untuned control) run the bundled model and ask for the process settings
(``configure_process=True``; they are process-wide, and the arena limit only takes before JAX
starts): 32 sequences in pure decode, counting the minor page faults per engine step in six
windows of four steps (the tuned process: on a fresh thread, then on the main thread). The step's scratch (36 MiB)
is above glibc's largest adaptive mmap threshold, so without the tuning every step maps it
afresh and faults in the ~11 MB it touches (~2,800 pages); with it the block is reused from
the heap, whichever thread runs the step (the engine's caller or, as under the server, a
thread of its own).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import pytest

_CHILD = textwrap.dedent(
    """
    import resource, sys, threading
    from jaxpaged import LLM, SamplingParams
    path, threads, batch = sys.argv[1], sys.argv[2].split(","), 32
    # the float expansion: the glibc tuning is for XLA's step buffers (the GGUF-kept kernel's
    # thread-local scratch grows once per thread that first runs it, outside this measure)
    llm = LLM(path, enforce_eager=True, max_model_len=256, max_num_seqs=batch,
              num_kv_blocks=16 * batch, show_progress=False, configure_process=True,
              quantization="none")
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [1, 2, 3, 4 + i], params)
    while engine.scheduler.waiting or any(not r.output_token_ids
                                          for r in engine.scheduler.running):
        engine.step()
    for _ in range(3):  # compiles the decode bucket (eager engine)
        engine.step()

    def run(windows):
        for _ in range(6):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for _ in range(4):
                engine.step()
            windows.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 4)
        assert len(engine.scheduler.running) == batch

    for where in threads:  # one line of windows per thread, in the order asked
        windows = []
        if where == "thread":  # a thread that has not run a step before
            worker = threading.Thread(target=run, args=(windows,))
            worker.start()
            worker.join()
        else:
            run(windows)
        print(where, " ".join(map(str, windows)))
    """
)

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or jax.default_backend() != "cpu",
    reason="glibc malloc on the CPU platform",
)


def _decode_faults_per_step(model_path: str, tuning: str, threads: str) -> dict[str, list[float]]:
    """Minor page faults per decode step, in six windows of four steps, for each of the
    comma-separated threads ("main" or a fresh "thread") in turn, in one process."""
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, model_path, threads],
        env={**os.environ, "JAX_PLATFORMS": "cpu", "JAXPAGED_MALLOC_TUNING": tuning},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    lines = [line.split() for line in out.stdout.strip().splitlines()[-len(threads.split(",")) :]]
    return {line[0]: [float(x) for x in line[1:]] for line in lines}


def test_decode_steps_reuse_their_scratch_instead_of_faulting_it_in(bundled_model_path):
    untuned = None
    if os.environ.get("JAXPAGED_TEST_FULL") == "1":  # the control: ~18 s of CPU more
        untuned = _decode_faults_per_step(bundled_model_path, "0", "main")["main"]
        # the problem the tuning exists for (so this test can tell the two apart)
        assert min(untuned) > 1000, f"faults per step without the tuning: {untuned}"
    # the fresh thread first: the steps it runs reuse what the main thread's warm-up left
    tuned = _decode_faults_per_step(bundled_model_path, "1", "thread,main")
    for thread, faults in tuned.items():
        assert max(faults) < 64, f"faults per step, tuned, {thread}: {faults} (untuned: {untuned})"


def test_the_cpu_platform_is_recognised_before_and_after_jax_starts():
    from jaxpaged.kernels.cpu.host_malloc import jax_will_run_on_cpu

    assert jax_will_run_on_cpu()  # this process: started, on the CPU
    # a fresh process, JAX_PLATFORMS unset (the installed plugins decide): the prediction
    # made before JAX starts, then what JAX picks once started
    before_start = subprocess.run(
        [sys.executable, "-c", "import jax; from jaxpaged.kernels.cpu.host_malloc import jax_will_run_on_cpu "
         "as f; from jax._src import xla_bridge as b; "
         "print(b.backends_are_initialized(), f(), jax.default_backend())"],
        env={k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"},
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    started, predicted, backend = before_start.stdout.split()
    assert started == "False"
    assert predicted == str(backend == "cpu"), before_start.stdout


def test_max_bytes_must_be_positive():
    from jaxpaged.kernels.cpu.host_malloc import keep_step_buffers

    with pytest.raises(ValueError, match="max_bytes"):
        keep_step_buffers(0)
