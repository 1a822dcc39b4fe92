"""What the scheduler hands the other layers, as plain data: the plan of a step
(:class:`SchedulerOutput` of :class:`ScheduledSeq`), what the runner reports back
(:class:`RunnerOutput`) and what a step changed per request (:class:`RequestUpdate`). No
live ``Request`` crosses: ids, positions, block ids and sampling settings.

The plan says what changed, not the whole batch (vLLM v1's ``NewRequestData`` /
``CachedRequestData``): a request's settings cross once, as :class:`NewRequestData`, in the
plan that first schedules it (and again after a preemption); its block table crosses as the
ids that changed since the previous plan (``ScheduledSeq.new_block_ids``); the runner keeps
both in its persistent batch until the request's id comes back in ``finished_request_ids``
or ``preempted_request_ids``. So a plan's size follows what the step feeds and changes, not
the batch's context lengths."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from jaxpaged.outputs import Logprob
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.sched.block_pool import CopyPair
from jaxpaged.sched.images import ImageItem

__all__ = [
    "NewRequestData",
    "StateRowInit",
    "RequestUpdate",
    "RunnerOutput",
    "ScheduledSeq",
    "SchedulerOutput",
    "SchedulerStats",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class NewRequestData:
    """What the runner keeps of a request while it is in the batch, sent once: in the plan
    that schedules it for the first time, or first again after a preemption. None of it
    changes while the request stays in the batch."""

    request_id: str
    seq_id: int  # engine-unique: tells a request from a later one that reuses its id
    params: SamplingParams
    key_stream: int  # sample index (seeded) or the request's engine-unique stream (unseeded)
    state_row: int = -1  # row of the request's on-device sampler state; -1 = none
    lora_slot: int = 0  # the device slot of its LoRA adapter (0 = none)
    images: tuple[ImageItem, ...] = ()  # its prompt's images (the runner encodes them)
    # a pooling request: the runner reads back its final hidden state at the last prompt
    # token (RunnerOutput.pooled_hidden) when its final prefill chunk runs
    pooling: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScheduledSeq:
    """One sequence's share of a step: feed ``token_ids`` at positions
    ``start_pos .. start_pos + num_tokens - 1`` (writing their K/V first), attending to
    ``kv_len`` cached positions through the request's block table, which the runner keeps:
    this step changes its entries from ``block_start`` on to ``new_block_ids`` (new blocks,
    or a copy-on-write copy replacing a shared one; the whole table for a request new to the
    batch), leaving it ``block_start + len(new_block_ids)`` long; no ids, no change. A decode
    whose token the host has not seen yet feeds row ``prev_row`` of the previous step's
    sampled tokens instead (``token_ids`` then holds one placeholder)."""

    request_id: str
    seq_id: int  # engine-unique: tells a request from a later one that reuses its id
    token_ids: tuple[int, ...]
    prev_row: int  # -1: token_ids are the input; >= 0: the previous step's sampled row
    start_pos: int
    new_block_ids: tuple[int, ...] = ()  # the table's entries from block_start on
    block_start: int = 0
    # >= 0: the sequence samples, and this many output tokens were sampled before this one
    # (its random stream's counter); -1: a non-final prefill chunk (no logits needed)
    key_counter: int = -1
    # prompt_logprobs: the prompt token after each of the first len() fed positions
    prompt_targets: tuple[int, ...] = ()
    prompt_top_k: int = 0  # top logprobs wanted with each
    # speculative decoding: the last this many of token_ids are drafts to verify (the step
    # samples after each fed token and keeps the drafts that match, plus one)
    num_draft_tokens: int = 0
    # the known token after the fed ones (a non-final prefill chunk's next prompt token), -1
    # when the step samples it: an EAGLE-3 head's input at the last fed position
    next_token: int = -1

    @property
    def do_sample(self) -> bool:
        return self.key_counter >= 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def kv_len(self) -> int:
        """Cached tokens after this step's writes (the kernel's kv_lens entry)."""
        return self.start_pos + len(self.token_ids)

    def positions(self) -> range:
        return range(self.start_pos, self.kv_len)

    def __repr__(self) -> str:
        drafts = f", drafts={self.num_draft_tokens}" if self.num_draft_tokens else ""
        return (
            f"ScheduledSeq({self.request_id!r}, start_pos={self.start_pos}, "
            f"num_tokens={self.num_tokens}, prev_row={self.prev_row}, "
            f"do_sample={self.do_sample}{drafts})"
        )

    def apply_blocks(self, table: list[int]) -> None:
        """Applies this step's block-table change to ``table`` (the request's, in place)."""
        if self.new_block_ids:
            del table[self.block_start :]
            table.extend(self.new_block_ids)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StateRowInit:
    """Fill the sampler state row ``row`` from a request (before the step runs)."""

    row: int
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    min_tokens: int = 0
    banned_ids: tuple[int, ...] = ()  # held back until min_tokens: EOS + stop_token_ids
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to its logits


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerOutput:
    """The plan of one step. The runner applies, in this order: ``blocks_to_spill`` (host
    tier slot -> disk slot), ``blocks_to_swap_out``
    (device block -> host slot), ``blocks_to_offload`` (device block -> host tier slot),
    ``blocks_to_swap_in`` (host slot -> device block), ``blocks_to_load`` (host tier slot ->
    device block), ``blocks_to_load_from_disk`` (disk slot -> device block),
    ``blocks_to_copy`` (device src -> device dst, copy-on-write),
    ``state_rows_to_init``;
    drops ``finished_request_ids`` and ``preempted_request_ids`` from its batch, adds
    ``new_requests``, applies each sequence's block-table change, then runs ``seqs``. Run it
    even when ``seqs`` is empty but a list is not (:attr:`has_work`)."""

    seqs: tuple[ScheduledSeq, ...] = ()
    # requests that join the runner's batch in this step (each also has an entry in seqs)
    new_requests: tuple[NewRequestData, ...] = ()
    blocks_to_swap_out: tuple[CopyPair, ...] = ()  # (device_block, host_slot)
    blocks_to_swap_in: tuple[CopyPair, ...] = ()  # (host_slot, device_block)
    # the prefix cache's host tier: evicted blocks kept, and blocks a prefix hit brings back
    blocks_to_offload: tuple[CopyPair, ...] = ()  # (device_block, tier_slot)
    blocks_to_load: tuple[CopyPair, ...] = ()  # (tier_slot, device_block)
    # the disk tier behind it: blocks the host tier forgets, and blocks a prefix hit brings back
    blocks_to_spill: tuple[CopyPair, ...] = ()  # (tier_slot, disk_slot)
    blocks_to_load_from_disk: tuple[CopyPair, ...] = ()  # (disk_slot, device_block)
    blocks_to_copy: tuple[CopyPair, ...] = ()  # (src_block, dst_block)
    state_rows_to_init: tuple[StateRowInit, ...] = ()
    # LoRA adapters to write into device slots before the step: (slot, adapter name)
    lora_loads: tuple[tuple[int, str], ...] = ()
    # requests that ended (finished, aborted, errored) since the last schedule(): drop state
    finished_request_ids: tuple[str, ...] = ()
    # requests preempted in this step (recompute: blocks gone; swap: blocks on the host)
    preempted_request_ids: tuple[str, ...] = ()

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def has_work(self) -> bool:
        return bool(
            self.seqs
            or self.blocks_to_swap_out
            or self.blocks_to_swap_in
            or self.blocks_to_offload
            or self.blocks_to_load
            or self.blocks_to_spill
            or self.blocks_to_load_from_disk
            or self.blocks_to_copy
            or self.state_rows_to_init
            or self.finished_request_ids
            or self.preempted_request_ids
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunnerOutput:
    """What the runner sampled, aligned with ``SchedulerOutput.seqs`` (entries of sequences
    that do not sample are ignored; use -1). ``failed`` names sequences the runner could not
    put into the batch, with the reason: those requests end with an error, the rest go on."""

    sampled_token_ids: Sequence[int]
    logprobs: Sequence[Logprob | None] | None = None  # same alignment
    # same alignment: the logprobs of each sequence's prompt_targets (None: none wanted)
    prompt_logprobs: Sequence[Sequence[Logprob] | None] | None = None
    failed: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # speculative decoding, same alignment: every token a sequence that verified drafts
    # emits (its accepted drafts, then the target's own token), None for the others (their
    # one token is in sampled_token_ids); and the target's logprobs of those tokens
    spec_token_ids: Sequence[Sequence[int] | None] | None = None
    spec_logprobs: Sequence[Sequence[Logprob] | None] | None = None
    # pooling requests whose final prefill chunk ran: request id -> float32 [D] (numpy) final
    # hidden state at its last prompt token
    pooled_hidden: Mapping[str, object] = dataclasses.field(default_factory=dict)

    def emitted(self, i: int) -> tuple[Sequence[int], Sequence[Logprob]]:
        """Sequence ``i``'s tokens from the step (several after a verification of drafts)
        and their logprobs (empty when not asked for)."""
        spec = self.spec_token_ids[i] if self.spec_token_ids is not None else None
        if spec is not None:
            lps = self.spec_logprobs[i] if self.spec_logprobs is not None else None
            return [int(t) for t in spec], lps or ()
        lp = self.logprobs[i] if self.logprobs is not None else None
        return [int(self.sampled_token_ids[i])], () if lp is None else (lp,)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RequestUpdate:
    """What one step changed for one request (plain data for the engine's output
    processing)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[Logprob, ...] = ()
    # on the first token's update of a request with prompt_logprobs: those of prompt tokens 1..
    prompt_logprobs: tuple[Logprob, ...] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "error" once finished
    stop_reason: int | str | None = None  # the stop token id that ended it
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(kw_only=True)
class SchedulerStats:
    """Counters since start (mutable; the engine reads them for metrics)."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_swap_outs: int = 0  # preemptions that swapped (the rest recomputed)
    prefix_cache_queries: int = 0  # tokens needed at admissions
    prefix_cache_hits: int = 0  # of those, tokens found cached (prefix cache or n>1 fork)
    kv_offload_hits: int = 0  # of those, tokens loaded back from the host tier
    kv_offload_blocks_stored: int = 0  # blocks copied device -> host tier
    kv_offload_blocks_loaded: int = 0  # blocks copied host (or disk) tier -> device
    kv_offload_disk_blocks_stored: int = 0  # blocks written host tier -> disk tier
    kv_offload_disk_blocks_loaded: int = 0  # of the loaded, those read from the disk tier
    # speculative decoding (vLLM's spec_decode counters): verifications run, draft tokens
    # proposed, drafts the target accepted, and accepted drafts by position in the draft
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = dataclasses.field(default_factory=list)

    def count_drafts(self, num_drafts: int, num_accepted: int) -> None:
        """One verification of ``num_drafts`` draft tokens, of which the first
        ``num_accepted`` were accepted."""
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_drafts
        self.spec_num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.spec_accepted_per_pos[j] += 1
