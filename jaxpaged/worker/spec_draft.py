"""Draft-model speculation on the device: a smaller model (or the target kept quantized)
proposes the drafts that the target's step then verifies (:mod:`.spec_verify`).

The draft model has its own runner: its own weights, programs and KV pool, with as many
blocks as the target's and the same block tables (the scheduler's, applied to both pools:
one allocation, copy-on-write and swap list serves both; the engine plans the two pools in
one memory budget). Before each target step, for a plan whose decodes carry ``d_i`` draft
slots (placeholders: the scheduler cannot know the tokens):

* pass 0 runs the plan on the draft model without the draft slots (every prefill chunk and
  decode token, so the draft's cache follows the target's), sampling greedily: d_1;
* pass j (1 .. max d_i) feeds d_j to the sequences with ``d_i >= j`` (its K/V written) and
  samples d_{j+1} (unused after d_i): one-token decode steps over the draft's compiled decode
  buckets, each reading the previous pass's tokens on the device;
* the drafts go into the tail of the target's previous-token array, where the target
  step's draft rows read them (``StepBatch.prev_rows``): nothing waits for the host.

Greedy drafts are a point mass, so the target's verification is exact rejection sampling.
After a verification the accepted drafts' K/V in the draft pool is right (they were fed) and
the next pass 0 feeds the target's next token: the draft cache never lags.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.sampling_params import SamplingParams
from jaxpaged.sched.output import ScheduledSeq, SchedulerOutput

if TYPE_CHECKING:  # the draft's runner is a Runner; typing only (no import cycle)
    from jaxpaged.worker.runner import Runner

__all__ = ["DraftModelProposer"]

_GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


def _combine(
    target: jax.Array,  # int32 [N] the target's previous-token array (N = R * (K + 1))
    outs: tuple[jax.Array, ...],  # K x int32 [N] each pass's sampled tokens
    src: jax.Array,  # int32 [K, R] row of sequence i's draft j + 1 in pass j's output, -1 none
) -> jax.Array:  # int32 [N]: target's first R entries, then draft j of sequence i at R + i*K + j
    k, r = src.shape
    vals = jnp.take_along_axis(jnp.stack(outs), jnp.maximum(src, 0), axis=1)  # [K, R]
    vals = jnp.where(src >= 0, vals, 0).T.reshape(-1)
    return target.at[r:].set(vals)


class DraftModelProposer:
    """Runs the draft model's passes for a plan (see the module docstring)."""

    def __init__(self, runner: Runner, *, num_speculative_tokens: int, num_rows: int) -> None:
        self.runner = runner
        self.k = num_speculative_tokens
        self.num_rows = num_rows  # R: the target's sequences per step at most
        self._combine = jax.jit(_combine)

    def propose(self, plan: SchedulerOutput, target_sampled: jax.Array) -> jax.Array:
        """Runs the passes of ``plan`` and returns ``target_sampled`` (int32 [R * (K + 1)])
        with the drafts in its tail, for the target step of the same plan."""
        draft = self.runner
        draft.sampled = target_sampled  # pass 0's decodes read the target's last tokens
        first = dataclasses.replace(
            plan,
            seqs=tuple(_without_drafts(s) for s in plan.seqs),
            new_requests=tuple(
                dataclasses.replace(d, params=_GREEDY, state_row=-1, lora_slot=0)
                for d in plan.new_requests
            ),
            state_rows_to_init=(),
            lora_loads=(),
        )
        pending = draft.dispatch(first)
        drafting = [(i, s) for i, s in enumerate(plan.seqs) if s.num_draft_tokens]
        if pending is None or not drafting:
            return target_sampled
        src = np.full((self.k, self.num_rows), -1, np.int32)
        outs = [pending.out.token_ids]
        rows = {i: i for i, _ in drafting}  # sequence -> its row in the last pass
        for j in range(1, max(s.num_draft_tokens for _, s in drafting) + 1):
            for i, s in drafting:
                if s.num_draft_tokens >= j:
                    src[j - 1, i] = rows[i]  # d_j came out of pass j - 1
            live = [(i, s) for i, s in drafting if s.num_draft_tokens >= j]
            seqs = tuple(
                ScheduledSeq(
                    request_id=s.request_id,
                    seq_id=s.seq_id,
                    token_ids=(0,),
                    prev_row=rows[i],
                    start_pos=s.kv_len - s.num_draft_tokens + j - 1,
                    key_counter=0,
                )  # no block ids: pass 0 brought the table up to date
                for i, s in live
            )
            outs.append(draft.dispatch(SchedulerOutput(seqs=seqs)).out.token_ids)
            rows = {i: row for row, (i, _) in enumerate(live)}
        outs = outs[: self.k] + [target_sampled] * (self.k - len(outs[: self.k]))
        return self._combine(target_sampled, tuple(outs), src)

    def warm_up(self, *, swap: bool, show_progress: bool) -> tuple[int, float]:
        """Compiles the draft model's steps and the draft gather."""
        programs, seconds = self.runner.warm_up(swap=swap, show_progress=show_progress)
        n = self.runner.sampled.shape[0]
        dummy = jnp.zeros((n,), jnp.int32)
        src = np.full((self.k, self.num_rows), -1, np.int32)
        jax.block_until_ready(self._combine(dummy, (dummy,) * self.k, src))
        return programs + 1, seconds


def _without_drafts(s: ScheduledSeq) -> ScheduledSeq:
    """The sequence as the draft model's pass 0 runs it: its draft slots left out, no prompt
    logprobs."""
    d = s.num_draft_tokens
    if not d and not s.prompt_targets:
        return s
    return dataclasses.replace(
        s, token_ids=s.token_ids[: len(s.token_ids) - d], num_draft_tokens=0, prompt_targets=()
    )
