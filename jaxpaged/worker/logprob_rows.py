"""Logprobs out of a step's host copy: the sampled tokens' (with their top-k) and the prompt
tokens' for the sequences that asked (rows of the step's flat batch)."""

from __future__ import annotations

from collections.abc import Sequence

from jaxpaged.outputs import Logprob
from jaxpaged.sched.output import ScheduledSeq
from jaxpaged.worker.step import StepOutput

__all__ = ["logprob_at", "prompt_logprobs_at", "prompt_logprob_rows"]


def prompt_logprob_rows(
    seqs: Sequence[ScheduledSeq],
) -> tuple[tuple[int, tuple[int, ...], int] | None, ...]:
    """Per sequence: (its first row in the batch, its prompt targets, the top-k asked for),
    or None when it wants no prompt logprobs in this step."""
    out = []
    row = 0
    for seq in seqs:
        out.append((row, seq.prompt_targets, seq.prompt_top_k) if seq.prompt_targets else None)
        row += seq.num_tokens
    return tuple(out)


def logprob_at(out: StepOutput, row: int, token: int, k: int) -> Logprob:
    """The sampled token's logprob and the top ``k`` of logprob row ``row`` (host copy)."""
    return Logprob(
        token_id=int(token),
        logprob=float(out.logprobs[row]),
        top=dict(
            zip(out.top_ids[row, :k].tolist(), out.top_logprobs[row, :k].tolist(), strict=True)
        ),
    )


def prompt_logprobs_at(
    out: StepOutput, first: int, targets: Sequence[int], k: int
) -> list[Logprob]:
    """One sequence's prompt logprobs from a step's host copy: rows ``first ..``."""
    return [
        Logprob(
            token_id=target,
            logprob=float(out.prompt_logprobs[r]),
            top=dict(
                zip(
                    out.prompt_top_ids[r, :k].tolist(),
                    out.prompt_top_logprobs[r, :k].tolist(),
                    strict=True,
                )
            ),
        )
        for r, target in enumerate(targets, first)
    ]
