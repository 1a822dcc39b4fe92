"""StepPlan: one step's plan while the scheduler builds it (what it feeds, copies and moves,
and how many prompt tokens it may still take), then the plain SchedulerOutput it becomes."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxpaged.sched.block_pool import CopyPair, TierMoves
from jaxpaged.sched.output import NewRequestData, ScheduledSeq, SchedulerOutput, StateRowInit
from jaxpaged.sched.prefill_cap import prefill_cap
from jaxpaged.sched.request import Request

__all__ = ["StepPlan"]


@dataclasses.dataclass(kw_only=True)
class StepPlan:
    """``budget``: tokens left (``max_num_batched_tokens`` at the start); ``cap``: prompt
    tokens a step with decodes may take, or ``caps[d]`` beside d decodes when measured by
    decodes; ``step_sizes``: compiled sizes the cap rounds down to (empty: none)."""

    budget: int
    cap: int
    caps: tuple[int, ...] = ()
    step_sizes: tuple[int, ...] = ()
    prefilled: int = 0  # tokens in chunks of > 1 token
    decodes: int = 0  # sequences fed 1 token
    seqs: list[ScheduledSeq] = dataclasses.field(default_factory=list)
    scheduled: list[Request] = dataclasses.field(default_factory=list)
    fed: dict[str, int] = dataclasses.field(default_factory=dict)  # id -> tokens fed now
    copies: list[CopyPair] = dataclasses.field(default_factory=list)
    swap_out: list[CopyPair] = dataclasses.field(default_factory=list)
    swap_in: list[CopyPair] = dataclasses.field(default_factory=list)
    preempted: list[str] = dataclasses.field(default_factory=list)
    row_inits: list[StateRowInit] = dataclasses.field(default_factory=list)
    lora_loads: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    new_requests: list[NewRequestData] = dataclasses.field(default_factory=list)

    def room(self) -> int:
        """Tokens the next chunk may take: the budget, and beside decodes the prefill cap
        for this many decodes less the prompt tokens already planned."""
        if not self.decodes:
            return self.budget
        limit = self.caps[min(self.decodes, len(self.caps) - 1)] if self.caps else self.cap
        return min(self.budget, prefill_cap(limit, self.decodes, self.step_sizes) - self.prefilled)

    def add(self, req: Request, seq: ScheduledSeq, num_fed: int, num_drafts: int) -> None:
        """Counts one scheduled sequence of ``num_fed`` tokens (its drafts included)."""
        if num_fed - num_drafts == 1:
            self.decodes += 1
        else:
            self.prefilled += num_fed
        self.seqs.append(seq)
        self.scheduled.append(req)
        self.fed[req.request_id] = num_fed
        self.budget -= num_fed

    def output(self, finished: Sequence[str], moves: TierMoves) -> SchedulerOutput:
        return SchedulerOutput(
            seqs=tuple(self.seqs),
            new_requests=tuple(self.new_requests),
            blocks_to_swap_out=tuple(self.swap_out),
            blocks_to_offload=tuple(moves.offload),
            blocks_to_swap_in=tuple(self.swap_in),
            blocks_to_load=tuple(moves.load),
            blocks_to_spill=tuple(moves.spill),
            blocks_to_load_from_disk=tuple(moves.disk_load),
            blocks_to_copy=tuple(self.copies),
            state_rows_to_init=tuple(self.row_inits),
            lora_loads=tuple(self.lora_loads),
            finished_request_ids=tuple(finished),
            preempted_request_ids=tuple(self.preempted),
        )
