"""The CPU's instruction-set features, read at run time from /proc/cpuinfo (the flags the
kernel reports from cpuid), so an engine can choose a bfloat16 compute path where the
hardware has bfloat16 dot products and keep float32 compute where it does not."""

from __future__ import annotations

import functools
from pathlib import Path

__all__ = ["bf16_dot_flags", "cpu_flags", "has_bf16_dot"]

# cpuinfo flags of bfloat16 dot-product instructions: AVX512-BF16's vdpbf16ps, AMX's tiles
BF16_DOT_FLAGS = ("avx512_bf16", "amx_bf16")


def parse_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags of the first processor in a /proc/cpuinfo text (empty if none)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86, arm64
            return frozenset(value.split())
    return frozenset()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This machine's CPU feature flags (empty where /proc/cpuinfo is unreadable)."""
    try:
        return parse_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return frozenset()


def bf16_dot_flags(flags: frozenset[str] | None = None) -> tuple[str, ...]:
    """Which bfloat16 dot-product features ``flags`` (default: this CPU's) has."""
    flags = cpu_flags() if flags is None else flags
    return tuple(f for f in BF16_DOT_FLAGS if f in flags)


def has_bf16_dot(flags: frozenset[str] | None = None) -> bool:
    """Whether the CPU computes bfloat16 dot products in hardware (AVX512-BF16 or AMX)."""
    return bool(bf16_dot_flags(flags))
