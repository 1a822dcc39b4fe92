"""KV pool sizing: explicit blocks, a byte budget, the device budget on accelerators, and the
start-up error when one max_model_len sequence cannot fit."""

from __future__ import annotations

import pytest

from jaxpaged.models.config import ModelConfig
from jaxpaged.worker.kv_cache import block_bytes, device_kv_budget, num_blocks_for

CFG = ModelConfig(
    model_type="llama",
    vocab_size=100,
    hidden_size=64,
    intermediate_size=128,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)
PER_BLOCK = 2 * 4 * 16 * 2 * 16 * 4  # K and V, layers, block, kv heads, head_dim, float32


def _blocks(**kw):
    args = dict(
        block_size=16, dtype="float32", max_model_len=64, num_kv_blocks=None, kv_cache_memory=None
    )
    args.update(kw)
    return num_blocks_for(CFG, **args)


def test_block_bytes_counts_k_and_v_of_every_layer():
    assert (
        block_bytes(num_layers=4, block_size=16, num_kv_heads=2, head_dim=16, dtype="float32")
        == PER_BLOCK
    )
    assert (
        block_bytes(num_layers=4, block_size=16, num_kv_heads=2, head_dim=16, dtype="bfloat16")
        == PER_BLOCK // 2
    )


def test_explicit_count_then_bytes_then_device_budget():
    assert _blocks(num_kv_blocks=7, kv_cache_memory=10**9) == 7
    assert _blocks(kv_cache_memory=10 * PER_BLOCK + 5) == 10
    assert _blocks(available_bytes=9 * PER_BLOCK) == 9


def test_too_small_for_one_sequence_names_the_figures_and_flags():
    with pytest.raises(ValueError) as exc:
        _blocks(num_kv_blocks=3, max_model_len=64)  # 64 tokens need 4 blocks
    msg = str(exc.value)
    assert "needs 4 blocks" in msg and "--kv-cache-memory" in msg and "--max-model-len" in msg


class _FakeGPU:
    platform = "gpu"

    def __init__(self, limit, in_use):
        self._stats = {"bytes_limit": limit, "bytes_in_use": in_use}

    def memory_stats(self):
        return self._stats


def test_device_budget_from_utilization(monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    gib = 1 << 30
    dev = _FakeGPU(limit=40 * gib, in_use=2 * gib)  # device total 80 GiB
    # 0.45 of 80 GiB = 36 GiB, less 2 GiB of weights, 1 GiB of step scratch and a margin of
    # 2% of the device (1.6 GiB)
    margin = int(0.02 * 80 * gib)
    got = device_kv_budget(gpu_memory_utilization=0.45, activation_bytes=gib, device=dev)
    assert got == 33 * gib - margin
    # never above the allocator's own limit
    got = device_kv_budget(gpu_memory_utilization=0.9, activation_bytes=gib, device=dev)
    assert got == 37 * gib - margin
    # a small device keeps at least 256 MiB free
    small = _FakeGPU(limit=3 * gib, in_use=0)  # 6 GiB device: 2% is 123 MiB
    got = device_kv_budget(gpu_memory_utilization=0.5, activation_bytes=0, device=small)
    assert got == 3 * gib - (256 << 20)


def test_device_budget_refuses_to_guess_without_an_allocator_limit():
    dev = _FakeGPU(limit=None, in_use=0)
    with pytest.raises(ValueError, match="kv_cache_memory"):
        device_kv_budget(gpu_memory_utilization=0.9, activation_bytes=0, device=dev)


def test_device_budget_is_none_on_cpu():
    import jax

    assert (
        device_kv_budget(
            gpu_memory_utilization=0.9, activation_bytes=0, device=jax.devices("cpu")[0]
        )
        is None
    )
