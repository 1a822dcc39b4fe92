"""Tensor parallelism, Orbax and multi-host, on 4 simulated CPU devices.

The checks (tp_checks.py) run in one subprocess started with
XLA_FLAGS=--xla_force_host_platform_device_count=4, so this pytest process and the rest of
the suite keep a single device; each test below reports one check's result.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from simulated_devices import assert_ok, run_checks

HERE = Path(__file__).parent
CHECKS = [
    "errors",
    "family_llama",
    "multihost",
    "family_qwen2",
    "family_qwen3",
    "family_mistral",
    "bloom",
    "orbax",
    "warmup_no_recompile",
    "update_weights",
    "quantized_int8",
    "family_gemma2",
    "family_mixtral",
    "family_gpt2",
    "quantized_families",
    "kv_int8",
    "grouped_gguf",
    "grouped_split_refused",
    "spec_identity",
]
# the rest of the families x sizes x cache dtypes matrix, with TP=1 engines beside
SLOW_CHECKS = [
    "warmup_gpt2",
    "quantized_gpt2",
    "full_gpt2",
    "full_opt",
    "full_gemma2",
    "full_gemma3",
    "full_mixtral",
    "full_qwen3_moe",
    "full_granite",
    "warmup_gemma3",
    "kv_int8_tp4",
    "kv_fp8",
    "grouped_gguf_tp4",
    "grouped_gptq_act",
    "grouped_awq",
    "grouped_gptq",
    "grouped_w4a16",
]


def _run_checks(work: Path, checks: list[str]) -> tuple[dict[str, str], str]:
    return run_checks(HERE / "tp_checks.py", work, checks)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> tuple[dict[str, str], str]:
    return _run_checks(tmp_path_factory.mktemp("tp"), CHECKS)


@pytest.mark.parametrize("check", CHECKS)
def test_tensor_parallel(results, check: str) -> None:
    assert_ok(results, check)


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("JAXPAGED_TEST_FULL") != "1",
    reason="the bundled model at TP=3 (~35 s): set JAXPAGED_TEST_FULL=1",
)
def test_bundled_smollm2_tp3(tmp_path) -> None:
    """The bundled SmolLM2 (9 q / 3 KV heads) at TP=3 vs TP=1, with real chat prompts: a split
    that is not a power of two (the default suite's families split 2 and 4 ways)."""
    assert_ok(_run_checks(tmp_path, ["smollm2_tp3"]), "smollm2_tp3")


@pytest.mark.slow
@pytest.mark.skipif(
    "1" not in (os.environ.get("JAXPAGED_TEST_FULL"), os.environ.get("JAXPAGED_TEST_TP_MATRIX")),
    reason="the full matrix: set JAXPAGED_TEST_FULL=1",
)
def test_tensor_parallel_matrix(tmp_path) -> None:
    """Every family tensor parallelism splits at TP 2 / 4 against TP=1 and transformers, and
    both 8-bit KV caches (~8 minutes on 2 busy cores: run only when asked,
    JAXPAGED_TEST_FULL=1 or JAXPAGED_TEST_TP_MATRIX=1)."""
    found, log = _run_checks(tmp_path, SLOW_CHECKS)
    failed = {c: found.get(c, "did not run") for c in SLOW_CHECKS if found.get(c) != "ok"}
    assert not failed, f"{failed}\n{log}"
