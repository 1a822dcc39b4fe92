"""2 MiB pages under the weights a CPU engine streams (jaxpaged.kernels.cpu.huge_pages), checked against
the kernel's own accounting in /proc/self/smaps: every advised range must end up backed by
huge pages, with the arrays' addresses and contents unchanged."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.kernels.cpu.huge_pages import HUGE_PAGE_BYTES, back_with_huge_pages


def _collapse_supported() -> bool:
    if not sys.platform.startswith("linux") or jax.default_backend() != "cpu":
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return False
    except OSError:
        return False
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    return (major, minor) >= (6, 1)  # MADV_COLLAPSE


pytestmark = pytest.mark.skipif(
    not _collapse_supported(), reason="needs Linux 6.1+ with THP, JAX on the CPU"
)


def _aligned_interior(ptr: int, nbytes: int) -> tuple[int, int]:
    start = -(-ptr // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    return start, max(start, (ptr + nbytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES)


def _huge_bytes_within(start: int, end: int) -> int:
    """AnonHugePages of the mappings lying inside [start, end) (madvise splits the advised
    range into mappings of its own; a neighbouring advised range may merge with it, so a
    mapping that overlaps the range counts only for its huge pages inside it, at most)."""
    total, lo, hi = 0, 0, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
            elif head == "AnonHugePages:" and lo < end and hi > start:
                total += min(int(line.split()[1]) << 10, min(hi, end) - max(lo, start))
    return total


@pytest.mark.parametrize("mib", [9, 24, 67])
def test_large_arrays_move_to_huge_pages_in_place(mib):
    rng = np.random.default_rng()
    host = rng.standard_normal(mib * (1 << 20) // 4, dtype=np.float32)
    arr = jnp.asarray(host) + 0.0  # a buffer XLA allocated, not numpy's
    ptr = arr.unsafe_buffer_pointer()
    start, end = _aligned_interior(ptr, arr.nbytes)
    collapsed = back_with_huge_pages([arr])
    assert collapsed == end - start > 0
    assert _huge_bytes_within(start, end) == end - start
    assert arr.unsafe_buffer_pointer() == ptr
    np.testing.assert_array_equal(np.asarray(arr), host)
    np.testing.assert_array_equal(np.asarray(arr * 2.0), host * 2.0)  # still usable by XLA


def test_small_arrays_are_left_alone():
    small = jnp.ones((1 << 20,), jnp.float32) + 0.0  # 4 MiB: under the default minimum
    assert back_with_huge_pages([small]) == 0


def test_min_bytes_below_a_huge_page_is_rejected():
    with pytest.raises(ValueError, match="min_bytes"):
        back_with_huge_pages([], min_bytes=4096)


def test_engine_streams_its_weights_from_huge_pages(bundled_model_path):
    from jaxpaged import LLM
    from jaxpaged.models.linear import streamed_weights

    # the float expansion of the GGUF (its quantized weights are a fifth of the size)
    llm = LLM(bundled_model_path, quantization="none", enforce_eager=True, max_model_len=256,
              max_num_seqs=4, num_kv_blocks=64, show_progress=False)  # fmt: skip
    try:
        runner = llm.engine.runner
        ranges = [_aligned_interior(a.unsafe_buffer_pointer(), a.nbytes)
                  for a in streamed_weights(runner.params) if a.nbytes >= 4 * HUGE_PAGE_BYTES]  # fmt: skip
        expected = sum(end - start for start, end in ranges)
        assert expected > 400 << 20  # SmolLM2's layers and lm_head in float32
        assert runner.huge_page_bytes == expected
        assert sum(_huge_bytes_within(s, e) for s, e in ranges) == expected
        # the embedding table, of which a step reads a few rows, is not advised: its range
        # lies outside every advised one. (Whether its pages are huge is not the engine's to
        # say in a long-lived process: memory an earlier engine advised and freed keeps its
        # advice when the allocator hands it out again, as in the suite's pytest workers.)
        embed = runner.params["embed"]
        lo, hi = _aligned_interior(embed.unsafe_buffer_pointer(), embed.nbytes)
        assert all(hi <= start or end <= lo for start, end in ranges), ((lo, hi), ranges)
    finally:
        llm.engine.close()
    off = LLM(bundled_model_path, quantization="none", enforce_eager=True, max_model_len=256,
              max_num_seqs=4, num_kv_blocks=64, show_progress=False, huge_pages=False)  # fmt: skip
    try:
        assert off.engine.runner.huge_page_bytes == 0  # --no-huge-pages
    finally:
        off.engine.close()
