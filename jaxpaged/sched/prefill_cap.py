"""How many prefill tokens a step that carries decodes may take.

A step's time is set by the compiled shape it is padded to (the runner's token sizes,
powers of two), not by its real rows: 15 decodes + a 64-token chunk = 79 rows run as 128,
twice the cost of 64, and that step is the one every running request waits for (the tail of
the inter-token latency). So the cap (``max_prefill_tokens_with_decodes``) is lowered to end
the step exactly on a compiled size when that keeps at least half of the cap: 15 decodes +
49 tokens = 64. The scheduler works without the sizes too (an empty tuple: the plain cap).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["prefill_cap"]


def prefill_cap(cap: int, decodes: int, step_sizes: Sequence[int]) -> int:
    """Prefill tokens a step with ``decodes`` one-token sequences may carry: the largest
    ``size - decodes`` between ``ceil(cap / 2)`` and ``cap`` over the compiled ``step_sizes``,
    else ``cap``."""
    floor = max(1, -(-cap // 2))
    fits = [size - decodes for size in step_sizes if floor <= size - decodes <= cap]
    return max(fits, default=cap)
