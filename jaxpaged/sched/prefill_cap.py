"""How many prefill tokens a step that carries decodes may take.

The cap (``max_prefill_tokens_with_decodes``) bounds the step every running request waits for
(the tail of the inter-token latency). With ``fit_prefill_to_buckets`` it is lowered to end
the step exactly on a compiled size when that keeps at least half of the cap: 15 decodes +
49 tokens = 64. On the native CPU kernels that saves little: a step's time follows its real
rows, not the padded size (measured in alternating rounds: 15 decodes + 64 tokens, 3.99x a
decode step padded to 128 rows, 3.85x padded to 80; + 49 tokens, 64 rows: 3.1-3.2x), so a
lower cap mostly means more, shorter steps per prompt. The scheduler works without the sizes too (an
empty tuple: the plain cap).
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
