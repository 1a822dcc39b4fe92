"""Structured output with drafts made on the device (a draft model, an EAGLE-3 head).

A grammar request samples each verified position under the mask of its own position: the
grammar's mask after the drafts before it, as if they were accepted (a copy of the
request's matcher walks them, ``GrammarMatchers.masks_through``; rows after the first
draft the grammar rejects allow every token, and that draft is never sampled at its own
position, so verification stops at it and nothing after it is emitted). n-gram drafts are
known when the step is planned. Device drafts are not, so for a step that carries a
grammar request with device drafts the runner reads the drafts back before it launches the
target's step, and the engine core's :class:`DraftMasks` turns them into masks:

* a draft model: its passes have run (:mod:`.spec_draft`); the drafts are the tail of the
  previous-token array the target step reads them from (``draft_model_drafts``);
* EAGLE-3: the head's passes run inside the target's step, so a step program that stops
  after them (``step(..., propose_only=True)``, compiled at warm-up per verification
  bucket when structured output is possible) makes them first; the target step is fed
  those drafts as tokens (``StepBatch.host_drafts``), never drafts of its own for that
  sequence, so the masks and the verified tokens agree bit for bit
  (``with_given_drafts``).

That read-back is the one place the overlapped loop waits for the device (for the previous
step and the drafting), and only in steps that carry such a request; a grammar request is
never planned while its last token is in flight anyway (its next mask needs it). The
drafts themselves stay the drafter's own (unconstrained greedy): a draft the grammar
rejects only ends that sequence's accepted run, so acceptance follows how often the
drafter's unconstrained choice obeys the grammar. Masking the drafter's own sampling would
need a host round trip per draft position and is not done.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import jax
import numpy as np

from jaxpaged.sched.output import ScheduledSeq, SchedulerOutput
from jaxpaged.worker.buckets import Bucket
from jaxpaged.worker.input_batch import InputBatch
from jaxpaged.worker.step import StepBatch

__all__ = [
    "DraftMasks",
    "DraftingRunner",
    "batch_after_drafts",
    "draft_model_drafts",
    "with_given_drafts",
]


class DraftingRunner(Protocol):
    """What this module reads of the target's runner (which imports this module)."""

    input_batch: InputBatch
    drafter: Any  # the draft model's proposer, or None (EAGLE-3 drafts in the step)
    sampled: jax.Array  # int32 [R]: the last step's token array

    def build_batch(
        self,
        seqs: Sequence[ScheduledSeq],
        bucket: Bucket,
        allowed: Mapping[int, np.ndarray] | None = None,
    ) -> tuple[StepBatch, dict[int, str]]: ...

    def propose(self, batch: StepBatch, bucket: Bucket) -> jax.Array: ...  # int32 [S, K]


# a request's drafts -> its masks, int32 [len(drafts) + 1, W] (GrammarMatchers.masks_through)
MasksAfter = Callable[[Sequence[int]], np.ndarray]


class DraftMasks(dict):
    """A step's structured-output masks (sequence index -> int32 [W] or [d + 1, W]) known
    when it is planned, and ``pending``: the sequences whose masks follow their device
    drafts (index -> how to make them). A runner without device drafts sees only the
    known masks (the scheduler gives it no such sequences)."""

    def __init__(self, known: Mapping[int, np.ndarray], pending: Mapping[int, MasksAfter]) -> None:
        super().__init__(known)
        self.pending = dict(pending)

    def __bool__(self) -> bool:
        return bool(len(self) or self.pending)

    def resolve(self, drafts: Mapping[int, Sequence[int]]) -> dict[int, np.ndarray]:
        """Every sequence's masks, given each pending sequence's drafts."""
        out = dict(self)
        for i, masks_after in self.pending.items():
            out[i] = masks_after(drafts[i])
        return out


def draft_model_drafts(
    sampled: np.ndarray,  # int32 [R * (K + 1)] read back: R previous tokens, then the drafts
    plan: SchedulerOutput,
    pending: Sequence[int],
    *,
    num_rows: int,
    k: int,
) -> dict[int, tuple[int, ...]]:
    """The drafts of the ``pending`` sequences (draft j of sequence i at ``R + i * K + j``,
    where the target step's draft rows read them: StepBatch.prev_rows)."""
    out = {}
    for i in pending:
        first = num_rows + i * k
        out[i] = tuple(int(t) for t in sampled[first : first + plan.seqs[i].num_draft_tokens])
    return out


def with_given_drafts(batch: StepBatch, drafts: Mapping[int, Sequence[int]]) -> StepBatch:
    """``batch`` (host arrays) with each sequence's drafts (index -> its d drafts) in its
    draft rows, marked given (the target step keeps them: StepBatch.host_drafts)."""
    tokens, given = np.array(batch.tokens), np.array(batch.host_drafts)
    for i, d in drafts.items():
        tokens[np.asarray(batch.verify_rows)[i, 1 : len(d) + 1]] = d
        given[i] = 1
    return batch._replace(tokens=tokens, host_drafts=given)


def batch_after_drafts(
    runner: DraftingRunner,
    plan: SchedulerOutput,
    bucket: Bucket,
    batch: StepBatch,
    masks: DraftMasks,
) -> StepBatch:
    """The target step's batch once the pending grammar requests' device drafts are read
    back (the wait the module docstring describes) and their masks made from them."""
    pending = sorted(masks.pending)
    ib = runner.input_batch
    if runner.drafter is not None:  # its passes ran: the drafts are in the token array
        sampled = np.asarray(jax.device_get(runner.sampled))
        drafts = draft_model_drafts(
            sampled, plan, pending, num_rows=ib.draft_slots_base, k=ib.num_speculative_tokens
        )
        return runner.build_batch(plan.seqs, bucket, masks.resolve(drafts))[0]
    proposed = np.asarray(jax.device_get(runner.propose(batch, bucket)))  # [S, K]
    drafts = {i: tuple(int(t) for t in proposed[i, : plan.seqs[i].num_draft_tokens])
              for i in pending}  # fmt: skip
    new, _ = runner.build_batch(plan.seqs, bucket, masks.resolve(drafts))
    return with_given_drafts(new, drafts)
