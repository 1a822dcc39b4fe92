"""The runner's persistent batch: what it keeps of each request between steps, so that a
step's host work follows what the plan changed, not the batch's size times its context.

The scheduler sends a request's settings once (:class:`~jaxpaged.sched.output.NewRequestData`,
when it joins the batch) and afterwards only what a step changes: the block ids from the
first changed entry of its table on (``ScheduledSeq.new_block_ids``), the tokens to feed,
and the ids of the requests that left (``finished_request_ids``, ``preempted_request_ids``).
:class:`PersistentBatch` keeps, per request, a row of host (numpy) arrays updated in place:
its block table (``[R + 1, B]``, B = the full-width columns of every step bucket) and its
settings. :class:`InputBatch` adds the sampling settings (``SamplingTensors`` rows, filled
once from the request's ``SamplingParams``) and builds each step's padded
:class:`~jaxpaged.worker.step.StepBatch` from them with vectorised gathers: no Python loop
over a block table or a sampling field per step.

Row ``R`` (= ``max_rows``) is padding: a zero block table, greedy sampling with every filter
off; padding sequences and sequences that do not sample in a step read it. Every per-step
array is freshly built (a gather allocates): a step already dispatched may still read what it
was given (on CPU, JAX can alias a numpy argument), so persistent arrays never reach it.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from jaxpaged.sampling_params import SamplingParams
from jaxpaged.sched.output import NewRequestData, ScheduledSeq, SchedulerOutput
from jaxpaged.worker import sampler, spec_verify
from jaxpaged.worker.buckets import Bucket
from jaxpaged.worker.step import StepBatch

__all__ = ["InputBatch", "PersistentBatch"]


class PersistentBatch:
    """Rows of the requests in the batch: request id -> row, each row's block table in a
    persistent ``[max_rows + 1, max_blocks]`` int32 array and its :class:`NewRequestData`.
    :meth:`update` applies a plan; ``entries_written`` counts the block-table entries it
    wrote (what per-step work tests measure)."""

    def __init__(self, *, max_rows: int, max_blocks: int) -> None:
        if max_rows < 1 or max_blocks < 1:
            raise ValueError(f"max_rows and max_blocks must be >= 1, got {max_rows}, {max_blocks}")
        self.max_rows = max_rows
        self.max_blocks = max_blocks
        self.padding_row = max_rows
        self.block_tables = np.zeros((max_rows + 1, max_blocks), np.int32)  # [R + 1, B]
        self.num_blocks = np.zeros(max_rows + 1, np.int32)  # [R + 1] entries in use per row
        self.requests: dict[str, NewRequestData] = {}
        self.rows: dict[str, int] = {}
        self._free_rows = list(range(max_rows - 1, -1, -1))
        self.entries_written = 0

    def __len__(self) -> int:
        return len(self.rows)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.rows

    def block_table(self, request_id: str) -> np.ndarray:  # int32 [n] (a view)
        """The request's block table as the batch holds it."""
        row = self.rows[request_id]
        return self.block_tables[row, : self.num_blocks[row]]

    def update(self, plan: SchedulerOutput) -> None:
        """Drops the requests that left, adds the new ones, applies each sequence's
        block-table change. Ids the batch does not hold are ignored when dropped (a request
        that ended while waiting never joined)."""
        for rid in itertools.chain(plan.finished_request_ids, plan.preempted_request_ids):
            self.remove(rid)
        for data in plan.new_requests:
            self.add(data)
        for seq in plan.seqs:
            if seq.new_block_ids:
                self.set_blocks(seq.request_id, seq.block_start, seq.new_block_ids)

    def add(self, data: NewRequestData) -> int:
        """Gives the request a row (its old one if it holds one: the data replaces it, its
        table starts empty) and returns it."""
        row = self.rows.get(data.request_id)
        if row is None:
            if not self._free_rows:
                raise RuntimeError(
                    f"{data.request_id}: the batch is full ({self.max_rows} requests)"
                )
            row = self._free_rows.pop()
            self.rows[data.request_id] = row
        self._clear_table(row)
        self.requests[data.request_id] = data
        self._on_add(row, data)
        return row

    def remove(self, request_id: str) -> None:
        row = self.rows.pop(request_id, None)
        if row is None:
            return
        del self.requests[request_id]
        self._clear_table(row)
        self._free_rows.append(row)

    def set_blocks(self, request_id: str, start: int, block_ids: Sequence[int]) -> None:
        """Entries ``start ..`` of the request's table become ``block_ids`` (the table is
        then ``start + len(block_ids)`` long)."""
        row = self.rows.get(request_id)
        if row is None:
            raise RuntimeError(f"{request_id}: not in the batch (no NewRequestData was sent)")
        old, end = int(self.num_blocks[row]), start + len(block_ids)
        if start > old or end > self.max_blocks:
            raise RuntimeError(
                f"{request_id}: block entries {start}..{end} do not extend its table of {old} "
                f"(at most {self.max_blocks})"
            )
        self.block_tables[row, start:end] = block_ids
        if end < old:
            self.block_tables[row, end:old] = 0
        self.num_blocks[row] = end
        self.entries_written += len(block_ids) + max(0, old - end)

    def _clear_table(self, row: int) -> None:
        n = int(self.num_blocks[row])
        if n:
            self.block_tables[row, :n] = 0
            self.num_blocks[row] = 0
            self.entries_written += n

    def _on_add(self, row: int, data: NewRequestData) -> None:
        """Fills the row's own settings (subclasses)."""


class _Row(NamedTuple):  # what sampler._fill_row reads (its SamplingRow)
    params: SamplingParams
    key_stream: int
    key_counter: int
    state_row: int


class InputBatch(PersistentBatch):
    """The persistent batch plus each row's sampling settings and LoRA slot; builds the
    padded step inputs (:meth:`prepare`)."""

    def __init__(
        self,
        *,
        max_rows: int,
        max_blocks: int,
        block_size: int,
        vocab_size: int,
        engine_key_data: np.ndarray,  # [2] uint32
        processor_names: Sequence[str] = (),
        lora: bool = False,
        num_speculative_tokens: int = 0,
        draft_slots_base: int | None = None,
        seq_rows: bool = False,
    ) -> None:
        """``num_speculative_tokens``: the most drafts a sequence verifies per step (0:
        speculative decoding off; else every step carries ``StepBatch.verify_rows``);
        ``draft_slots_base``: drafts are made on the device, draft j of sequence i read
        from row ``base + i * K + j`` of the previous-token array (None: the fed tokens
        are the drafts); ``seq_rows``: every step carries ``StepBatch.seq_rows`` (an
        EAGLE-3 head's state is kept per row)."""
        self.draft_slots_base = draft_slots_base
        self.seq_rows = seq_rows
        super().__init__(max_rows=max_rows, max_blocks=max_blocks)
        self.num_speculative_tokens = num_speculative_tokens
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.engine_key_data = np.asarray(engine_key_data, np.uint32)
        self.processor_names = tuple(processor_names)
        self.lora = lora
        # [R + 1] per field (key_data [R + 1, 2], processor_args [R + 1, A]); key_counter and
        # allowed are per step and stay padding here
        self.sampling, _ = sampler.build_sampling_tensors(
            [], max_rows + 1, vocab_size=vocab_size, engine_key_data=self.engine_key_data
        )
        self.lora_slots = np.zeros(max_rows + 1, np.int32)  # [R + 1]
        self.failures: dict[int, str] = {}  # row -> why its sampling settings were refused
        self._padding = sampler._padding_values(vocab_size)
        self._all_allowed: dict[int, np.ndarray] = {}  # S -> int32 [S, W] of -1, never written

    def _on_add(self, row: int, data: NewRequestData) -> None:
        t = self.sampling
        for arr, pad in zip(t, self._padding, strict=True):
            arr[row] = pad
        self.failures.pop(row, None)
        try:
            sampler._fill_row(
                t,
                row,
                _Row(data.params, data.key_stream, 0, data.state_row),
                self.vocab_size,
                self.engine_key_data,
                self.processor_names,
            )
        except (ValueError, TypeError, OverflowError) as e:
            self.failures[row] = f"{type(e).__name__}: {e}"
            for arr, pad in zip(t, self._padding, strict=True):
                arr[row] = pad
        self.lora_slots[row] = data.lora_slot

    def logprobs_wanted(self, seqs: Sequence[ScheduledSeq]) -> tuple[int | None, ...]:
        """Per sequence: the top logprobs its request asked for, None when it does not
        sample or asked for none."""
        req = self.requests
        return tuple(req[s.request_id].params.logprobs if s.do_sample else None for s in seqs)

    def _allowed(
        self, s: int, allowed: Mapping[int, np.ndarray] | None, k1: int = 1
    ) -> np.ndarray:  # int32 [s * k1, W]
        """The step's masks: row ``i * k1 + j`` is sequence i's verified position j (``k1``
        rows per sequence in a step that verifies drafts, else 1). A mask of shape [W]
        covers position 0, one of [m, W] positions 0 .. m - 1; the rest allow every token."""
        words = -(-self.vocab_size // 32)
        if not allowed:
            out = self._all_allowed.get(s * k1)
            if out is None:
                out = self._all_allowed[s * k1] = np.full((s * k1, words), -1, np.int32)
            return out
        out = np.full((s * k1, words), -1, np.int32)
        for i, mask in allowed.items():
            mask = mask.reshape(-1, words)
            if len(mask) > k1:
                raise ValueError(f"sequence {i}: {len(mask)} masks for {k1} verified positions")
            out[i * k1 : i * k1 + len(mask)] = mask
        return out

    def prepare(
        self,
        seqs: Sequence[ScheduledSeq],
        bucket: Bucket,
        allowed: Mapping[int, np.ndarray] | None = None,
    ) -> tuple[StepBatch, dict[int, str]]:
        """One step's inputs padded into ``bucket`` (fresh numpy arrays), and the sequences
        whose sampling settings were refused when their request joined (index -> reason:
        they sample as padding rows and their requests fail). Every sequence's request must
        be in the batch (``update`` with its plan first). ``allowed``: sequence index -> its
        structured-output mask (int32 [ceil(V / 32)]; [d + 1, W] for one that verifies d
        drafts: the mask of each verified position)."""
        t, s, b = bucket.num_tokens, bucket.num_seqs, bucket.max_blocks
        if b != self.max_blocks:
            raise ValueError(f"bucket has {b} block columns, the batch {self.max_blocks}")
        n = len(seqs)
        if n > s:
            raise ValueError(f"{n} sequences do not fit a bucket of {s}")
        pad = self.padding_row
        rows = np.full(s, pad, np.int64)  # each sequence's row, padding after
        sample_idx = np.full(s, pad, np.int64)  # its row when it samples, else padding
        starts = np.zeros(n, np.int32)
        num_tokens = np.zeros(n, np.int32)
        prev = np.full(n, -1, np.int32)
        drafts = np.zeros(n, np.int32)
        counters = np.zeros(s, np.int64)
        prompt_targets = np.full(t, -1, np.int32)
        failed: dict[int, str] = {}
        row_of, failures = self.rows, self.failures
        at = 0
        for i, seq in enumerate(seqs):  # a few scalar reads per sequence, nothing per block
            row = row_of.get(seq.request_id)
            if row is None:
                raise RuntimeError(f"{seq.request_id}: not in the batch (no NewRequestData)")
            k = len(seq.token_ids)
            rows[i], starts[i], num_tokens[i], prev[i] = row, seq.start_pos, k, seq.prev_row
            drafts[i] = seq.num_draft_tokens
            if seq.key_counter >= 0:
                why = failures.get(row) if failures else None
                if why is None:
                    sample_idx[i], counters[i] = row, seq.key_counter
                else:
                    failed[i] = why
            if seq.prompt_targets:
                prompt_targets[at : at + len(seq.prompt_targets)] = seq.prompt_targets
            at += k
        if at > t:
            raise ValueError(f"{at} tokens do not fit a bucket of {t}")
        cu = np.zeros(s + 1, np.int32)
        np.cumsum(num_tokens, out=cu[1 : n + 1])
        cu[n + 1 :] = at
        seq_of = np.repeat(np.arange(n), num_tokens)  # [at] each token's sequence
        pos = starts[seq_of] + (np.arange(at, dtype=np.int32) - cu[seq_of])
        bs = self.block_size
        row_tok = rows[seq_of]
        tokens = np.zeros(t, np.int32)
        tokens[:at] = np.fromiter(
            itertools.chain.from_iterable(seq.token_ids for seq in seqs), np.int32, at
        )
        positions = np.zeros(t, np.int32)
        positions[:at] = pos
        slots = np.full(t, -1, np.int32)
        slots[:at] = self.block_tables[row_tok, pos // bs] * bs + pos % bs
        prev_rows = np.full(t, -1, np.int32)
        prev_rows[cu[:n]] = prev  # only a one-token decode is ever fed this way
        if self.draft_slots_base is not None and drafts.any():  # drafts made on the device
            k = self.num_speculative_tokens
            for i in np.flatnonzero(drafts):
                d = int(drafts[i])
                first = self.draft_slots_base + i * k
                prev_rows[cu[i + 1] - d : cu[i + 1]] = np.arange(first, first + d)
        kv_lens = np.zeros(s, np.int32)
        kv_lens[:n] = starts + num_tokens
        sample_rows = np.zeros(s, np.int32)
        sample_rows[:n] = cu[1 : n + 1] - 1
        spec: dict[str, np.ndarray] = {}
        k1 = 1  # rows sampled per sequence
        # a decode-only step carries no drafts: it samples one row per sequence, as without
        # speculative decoding (no K + 1 logits rows for nothing)
        if self.num_speculative_tokens and not bucket.decode_only:
            k1 = self.num_speculative_tokens + 1
            spec["verify_rows"] = spec_verify.verify_rows(cu[1 : n + 1] - 1, drafts, s, k1)
            spec["num_drafts"] = np.zeros(s, np.int32)
            spec["num_drafts"][:n] = drafts
        elif drafts.any():
            raise ValueError("a sequence feeds drafts in a step without verification rows")
        if self.seq_rows:
            spec["seq_rows"] = rows.astype(np.int32)
            spec["next_tokens"] = np.full(s, -1, np.int32)
            spec["next_tokens"][:n] = [seq.next_token for seq in seqs]
            spec["host_drafts"] = np.zeros(s, np.int32)  # set by spec_grammar
        lora_slots = None
        if self.lora:
            lora_slots = np.zeros(t, np.int32)
            lora_slots[:at] = self.lora_slots[row_tok]
        if failed and allowed:  # a refused row samples as padding: no mask
            allowed = {i: m for i, m in allowed.items() if i not in failed}
        st = self.sampling  # allowed is its last field: per step, not kept
        sampling = sampler.SamplingTensors(
            *(arr[sample_idx] for arr in st[:-1]), allowed=self._allowed(s, allowed, k1)
        )._replace(key_counter=(counters & 0xFFFFFFFF).astype(np.uint32))
        batch = StepBatch(
            tokens=tokens,
            prev_rows=prev_rows,
            positions=positions,
            slot_mapping=slots,
            kv_lens=kv_lens,
            block_tables=self.block_tables[rows],  # [S, B] gathered: one C copy
            cu_q_lens=cu,
            num_seqs=np.array([n], np.int32),
            sample_rows=sample_rows,
            sampling=sampling,
            prompt_targets=prompt_targets,
            lora_slots=lora_slots,
            **spec,
        )
        return batch, failed
