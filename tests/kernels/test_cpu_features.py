"""CPU feature detection: which bfloat16 dot-product instructions a /proc/cpuinfo reports."""

from __future__ import annotations

from jaxpaged.kernels.cpu import features

AVX2_EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC Processor
flags\t\t: fpu vme sse sse2 avx fma avx2 bmi2
bogomips\t: 4890.83
"""
SAPPHIRE_RAPIDS = """processor\t: 0
flags\t\t: avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile
"""
GRACE = "processor\t: 0\nFeatures\t: fp asimd sve bf16\n"


def test_flags_of_the_first_processor():
    assert features.parse_flags(AVX2_EPYC) == frozenset(
        "fpu vme sse sse2 avx fma avx2 bmi2".split()
    )
    assert "bf16" in features.parse_flags(GRACE)  # arm64 names its list "Features"
    assert features.parse_flags("no flags here\n") == frozenset()


def test_bf16_dot_products_only_with_avx512_bf16_or_amx():
    avx2 = features.parse_flags(AVX2_EPYC)
    assert not features.has_bf16_dot(avx2) and features.bf16_dot_flags(avx2) == ()
    spr = features.parse_flags(SAPPHIRE_RAPIDS)
    assert features.bf16_dot_flags(spr) == ("avx512_bf16", "amx_bf16")
    assert features.has_bf16_dot(frozenset({"avx512_bf16"}))
    assert features.has_bf16_dot(frozenset({"amx_bf16"}))
    assert not features.has_bf16_dot(features.parse_flags(GRACE))  # no x86 kernel for arm64
