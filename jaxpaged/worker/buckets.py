"""Step shapes. XLA compiles one program per input shape, so every step is padded to one of a
few buckets, all compiled at start-up (warm-up) unless ``enforce_eager``:

* decode steps (every sequence feeds one token): S sequences in powers of two from 1 up to
  ``max_num_seqs``, compiled with ``max_q_len=1`` so attention skips its prefill path;
* mixed steps (prefill chunks, with or without decodes): T tokens in powers of two from 16 up
  to ``max_num_batched_tokens``, with S = min(T, max_num_seqs);
* with speculative decoding (K drafts at most), verify steps (every sequence a decode, some
  with drafts): S sequences as for decodes, T = S * (K + 1), compiled with ``max_q_len=K+1``:
  a lone sequence verifying 4 drafts runs 5 rows, not a mixed step's 16.

Block tables are always full width (``max_model_len / block_size``): the attention kernels
stop at the last KV chunk any sequence can see, so context length needs no bucket of its own
and the program count stays at a handful (log2 of the two limits).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence

from jaxpaged.sched.output import ScheduledSeq

__all__ = ["Bucket", "BucketSet", "pow2_ladder"]


def pow2_ladder(lo: int, hi: int) -> tuple[int, ...]:
    """Powers of two from lo while below hi, then hi itself."""
    out = []
    x = lo
    while x < hi:
        out.append(x)
        x *= 2
    out.append(hi)
    return tuple(out)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True, order=True)
class Bucket:
    """A compiled step shape: T token rows, S sequences, B block-table columns."""

    num_tokens: int
    num_seqs: int
    max_blocks: int
    decode_only: bool
    max_q_len: int | None = None  # static bound on any sequence's query rows (None: T)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BucketSet:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    num_speculative_tokens: int = 0

    @property
    def decode_seqs(self) -> tuple[int, ...]:
        # down to 1: a step's 30 layers of XLA:CPU matmuls took 52 ms at 1 row and 166 ms at
        # 8 (2-core dev VM), so a lone sequence must not be padded to 8
        return pow2_ladder(1, self.max_num_seqs)

    @property
    def mixed_tokens(self) -> tuple[int, ...]:
        return pow2_ladder(min(16, self.max_num_batched_tokens), self.max_num_batched_tokens)

    @property
    def full_blocks(self) -> int:
        return _cdiv(self.max_model_len, self.block_size)

    def all(self) -> list[Bucket]:
        out = [Bucket(s, s, self.full_blocks, True) for s in self.decode_seqs]
        out += [
            Bucket(t, min(t, self.max_num_seqs), self.full_blocks, False) for t in self.mixed_tokens
        ]
        out += [self._verify(s) for s in self.verify_seqs]
        return out

    @property
    def verify_seqs(self) -> tuple[int, ...]:
        """Sequence counts of the verify buckets (none without speculative decoding)."""
        k1 = self.num_speculative_tokens + 1
        if k1 == 1:
            return ()
        return tuple(s for s in self.decode_seqs if s * k1 <= self.max_num_batched_tokens)

    def _verify(self, s: int) -> Bucket:
        k1 = self.num_speculative_tokens + 1
        return Bucket(s * k1, s, self.full_blocks, False, max_q_len=k1)

    def pick(self, seqs: Sequence[ScheduledSeq]) -> Bucket:
        n = len(seqs)
        num_tokens = sum(s.num_tokens for s in seqs)
        if all(s.num_tokens == 1 for s in seqs) and n <= self.max_num_seqs:
            s = self.decode_seqs[bisect.bisect_left(self.decode_seqs, n)]
            return Bucket(s, s, self.full_blocks, True)
        verify = self.verify_seqs
        if (
            verify
            and n <= verify[-1]
            and all(s.do_sample and s.num_tokens == 1 + s.num_draft_tokens for s in seqs)
        ):
            return self._verify(verify[bisect.bisect_left(verify, n)])
        i = bisect.bisect_left(self.mixed_tokens, num_tokens)
        if i == len(self.mixed_tokens):
            raise ValueError(
                f"step of {num_tokens} tokens exceeds max_num_batched_tokens="
                f"{self.max_num_batched_tokens}"
            )
        # more sequences than tokens can't happen: each sequence feeds >= 1 token
        t = self.mixed_tokens[i]
        while min(t, self.max_num_seqs) < n:
            i += 1
            t = self.mixed_tokens[i]
        return Bucket(t, min(t, self.max_num_seqs), self.full_blocks, False)
