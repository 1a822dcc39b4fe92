"""N-gram prompt lookup: draft the tokens that followed the latest earlier occurrence of the
sequence's last n tokens (n from ``max_n`` down to ``min_n``, the longest match wins). No
model: the drafts come from the request's own prompt and output, which is why it pays off on
copy-heavy work (editing, summarising, code) and costs little elsewhere."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxpaged.spec.config import SpeculativeConfig

__all__ = ["DeviceDraftSlots", "NgramProposer", "proposer_for"]


class NgramProposer:
    """Proposes up to ``k`` draft tokens per call (stateless; one per engine). Cost per call:
    O(len(token_ids) * n) in numpy, for each n tried."""

    # the drafts are real tokens, known when the step is planned: the engine core walks a
    # grammar through them then (structured output)
    drafts_on_host = True
    grammar_drafts = True  # structured-output requests draft too

    def __init__(self, *, min_n: int, max_n: int, k: int) -> None:
        if not 1 <= min_n <= max_n or k < 1:
            raise ValueError(f"NgramProposer: need 1 <= min_n <= max_n and k >= 1, got "
                             f"{min_n}, {max_n}, {k}")  # fmt: skip
        self.min_n, self.max_n, self.k = min_n, max_n, k

    def propose(self, token_ids: Sequence[int], k: int | None = None) -> tuple[int, ...]:
        """Up to ``k`` (default: the proposer's) tokens continuing ``token_ids`` (prompt +
        output so far), () when no n-gram of the window recurs."""
        k = self.k if k is None else min(k, self.k)
        n_tok = len(token_ids)
        if k <= 0 or n_tok <= self.min_n:
            return ()
        tokens = np.asarray(token_ids, np.int64)
        for n in range(min(self.max_n, n_tok - 1), self.min_n - 1, -1):
            pattern = tokens[-n:]
            # windows starting at 0 .. n_tok - n - 1 (the suffix itself excluded)
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == pattern).all(axis=1))
            if hits.size:
                # the latest occurrence with k tokens after it (the freshest context), else
                # the earliest (the longest continuation)
                full = hits[hits + n + k <= n_tok]
                start = int(full[-1] if full.size else hits[0]) + n
                return tuple(int(t) for t in tokens[start : start + k])
        return ()


class DeviceDraftSlots:
    """For a draft model or an EAGLE-3 head: the scheduler allots ``k`` draft slots per
    decode (placeholder tokens, 0); the drafter fills them on the device
    (jaxpaged.worker.spec_draft, jaxpaged.worker.spec_eagle)."""

    drafts_on_host = False
    # structured-output requests draft too: the runner reads their drafts back before the
    # verification step, for the grammar's masks (jaxpaged.worker.spec_grammar)
    grammar_drafts = True

    def __init__(self, *, k: int) -> None:
        self.k = k

    def propose(self, token_ids: Sequence[int], k: int | None = None) -> tuple[int, ...]:
        return (0,) * (self.k if k is None else min(k, self.k))


def proposer_for(config: SpeculativeConfig) -> NgramProposer | DeviceDraftSlots:
    """The scheduler's drafter: n-gram prompt lookup on the host, or the slots a draft model
    or an EAGLE-3 head fills on the device."""
    k = config.num_speculative_tokens
    if config.method == "ngram":
        lo, hi = config.lookup_window
        return NgramProposer(min_n=lo, max_n=hi, k=k)
    return DeviceDraftSlots(k=k)
