"""Which sequences of a step are pooling requests at their final prefill chunk, and their
hidden states read back from the step's ``StepOutput.pooled`` (the step computes that
output for every sequence; it crosses to the host only when some sequence is pooled)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import numpy as np

from jaxpaged.sched.output import NewRequestData, ScheduledSeq

__all__ = ["pooled_hidden", "pooled_seqs"]


def pooled_seqs(
    seqs: Sequence[ScheduledSeq], requests: Mapping[str, NewRequestData]
) -> tuple[tuple[int, str], ...]:
    """(sequence index, request id) of the pooling requests whose final prefill chunk this
    step feeds (the chunk that samples: its last row is the last prompt token)."""
    out = []
    for i, s in enumerate(seqs):
        data = requests.get(s.request_id)
        if s.do_sample and data is not None and data.pooling:
            out.append((i, s.request_id))
    return tuple(out)


def pooled_hidden(
    pooled: jax.Array | None,  # float32 [S, D] StepOutput.pooled
    which: Sequence[tuple[int, str]],
) -> dict[str, np.ndarray]:  # request id -> float32 [D]
    """The pooled sequences' hidden states on the host (waits for the step)."""
    if not which or pooled is None:
        return {}
    rows = np.asarray(pooled)
    return {rid: rows[i].copy() for i, rid in which}
