"""Tile sizes of the Pallas GPU attention kernels (pallas_gpu.py): the launch parameters,
the shared-memory estimate they must fit, and the table that picks them per shape."""

from __future__ import annotations

import dataclasses


def _cdiv(a, b):
    return (a + b - 1) // b


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasConfig:
    """Tile sizes and launch parameters (all static); ``choose_config`` fills them per shape."""

    block_kv: int = 64  # KV tokens per inner step (rounded to whole blocks, >= 16)
    prefill_rows: int = 64  # matmul rows of a prefill tile (tokens x padded GQA group)
    num_splits: int | None = None  # decode KV splits; None = enough to fill the GPU
    target_programs: int = 264  # decode programs to aim for (2 x 132 SMs on H100/H200)
    num_warps: int = 4  # decode kernel
    num_stages: int = 3  # decode kernel: deeper pipelining hides the KV loads it waits on
    prefill_warps: int = 4
    prefill_stages: int = 2


# Shared memory one program may use: H100/H200 give 227 KB per SM; 160 KB leaves room for
# Triton's layout-conversion scratch and lets an SM hold a second small program.
SMEM_BUDGET = 160 * 1024


def _rows(rows: int, group_pad: int) -> int:
    return max(16, group_pad, rows)


def smem_bytes(
    config: PallasConfig, *, head_dim: int, itemsize: int, block_size: int, group_pad: int
) -> dict[str, int]:
    """Upper estimate of each kernel's shared memory per program: every pipeline stage holds
    one K and one V tile; the query tile and the probabilities (the second matmul's operand)
    are staged once."""
    block_k = _pages_per_step(config, block_size) * block_size
    kv = 2 * block_k * head_dim * itemsize
    out = {}
    for name, rows, stages in (
        ("decode", _rows(16, group_pad), config.num_stages),
        ("prefill", _prefill_rows(config, group_pad), config.prefill_stages),
    ):
        out[name] = stages * kv + rows * head_dim * itemsize + rows * block_k * itemsize
    return out


def _pages_per_step(config: PallasConfig, block_size: int) -> int:
    return max(1, config.block_kv // block_size, _cdiv(16, block_size))


def _prefill_rows(config: PallasConfig, group_pad: int) -> int:
    m_rows = max(16, _pow2_at_least(min(config.prefill_rows, 4096)))
    return max(1, m_rows // group_pad) * group_pad


def unsupported_reason(
    *, head_dim: int, itemsize: int, block_size: int, group_pad: int
) -> str | None:
    """Why the Pallas kernels cannot run this shape (None: they can); callers fall back to
    the XLA path."""
    if head_dim & (head_dim - 1) or head_dim < 16:
        return f"head_dim must be a power of two >= 16, got {head_dim}"
    if block_size & (block_size - 1):
        return f"block_size must be a power of two, got {block_size}"
    config = choose_config(
        head_dim=head_dim, itemsize=itemsize, block_size=block_size, group_pad=group_pad
    )
    dims = dict(head_dim=head_dim, itemsize=itemsize, block_size=block_size, group_pad=group_pad)
    need = max(smem_bytes(config, **dims).values())
    if need > SMEM_BUDGET:
        return (
            f"one block of {block_size} tokens x head_dim {head_dim} x {itemsize}-byte values "
            f"needs {need} bytes of shared memory per program, over the {SMEM_BUDGET} budget; "
            "use a smaller block_size"
        )
    return None


def choose_config(*, head_dim: int, itemsize: int, block_size: int, group_pad: int) -> PallasConfig:
    """The tile table, by bytes per K row (head_dim x dtype size):

    | bytes per row | block_kv | prefill rows | prefill warps | decode stages |
    |---|---|---|---|---|
    | <= 256 (d128 bf16) | 64 | 64 | 8 from d128 | 3 |
    | 512 (d256 bf16, d128 f32) | 32 | 64 | 8 | 3 |
    | 1024 (d256 f32) | 16 | 32 | 8 | 2 |

    then halved further (block_kv first, down to one block or 16 tokens) while an estimate
    (``smem_bytes``) exceeds SMEM_BUDGET, e.g. for block sizes above block_kv."""
    row = head_dim * itemsize
    if row <= 256:
        config = PallasConfig(block_kv=64, prefill_rows=64)
    elif row <= 512:
        config = PallasConfig(block_kv=32, prefill_rows=64)
    else:
        config = PallasConfig(block_kv=16, prefill_rows=32, num_stages=2)
    if head_dim >= 128:
        config = dataclasses.replace(config, prefill_warps=8)
    dims = dict(head_dim=head_dim, itemsize=itemsize, block_size=block_size, group_pad=group_pad)
    replace = dataclasses.replace
    shrink = (  # in this order, one step at a time
        lambda c: c.num_stages > 2 and replace(c, num_stages=c.num_stages - 1),
        lambda c: (
            _pages_per_step(c, block_size) * block_size > 16
            and c.block_kv > block_size
            and replace(c, block_kv=c.block_kv // 2)
        ),
        lambda c: c.prefill_rows > 16 and replace(c, prefill_rows=c.prefill_rows // 2),
        lambda c: (
            max(c.num_stages, c.prefill_stages) > 1 and replace(c, num_stages=1, prefill_stages=1)
        ),
    )
    while max(smem_bytes(config, **dims).values()) > SMEM_BUDGET:
        smaller = next((c for c in (f(config) for f in shrink) if c), None)
        if smaller is None:
            break  # nothing left to shrink: test_pallas_gpu_tiles_fit_shared_memory says so
        config = smaller
    return config
