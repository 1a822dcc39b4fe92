"""The serve log's periodic stats lines, in vLLM's words (its ``LoggingStatLogger``), so
operators and scripts that read vLLM's logs read jaxpaged's:

    Engine 000: Avg prompt throughput: 120.0 tokens/s, Avg generation throughput: 31.5
    tokens/s, Running: 2 reqs, Waiting: 0 reqs, KV cache usage: 3.1%, Prefix cache hit
    rate: 40.0%
    SpecDecoding metrics: Mean acceptance length: 2.31, Accepted throughput: 5.20 tokens/s,
    Drafted throughput: 12.00 tokens/s, Accepted: 52 tokens, Drafted: 120 tokens,
    Per-position acceptance rate: 0.700, 0.400, 0.200, Avg Draft acceptance rate: 43.3%

Rates are over the interval since the previous line (the engine's counters' differences);
nothing is logged for an interval in which the engine was idle. The second line appears
when the engine verified drafts in the interval.
"""

from __future__ import annotations

from jaxpaged.engine.protocol import EngineStats

__all__ = ["StatsLog"]


class StatsLog:
    """Turns successive :class:`EngineStats` snapshots into the interval's log lines."""

    def __init__(self) -> None:
        self._last: EngineStats | None = None
        self._last_time = 0.0

    def lines(self, stats: EngineStats, now: float) -> list[str]:
        """The lines for the interval ending at ``now`` (seconds, monotonic); the first call
        only records its snapshot."""
        last, last_time = self._last, self._last_time
        self._last, self._last_time = stats, now
        if last is None:
            return []
        prompt = stats.prompt_tokens_total - last.prompt_tokens_total
        generated = stats.generation_tokens_total - last.generation_tokens_total
        busy = stats.num_running or stats.num_waiting or stats.num_swapped
        if not (prompt or generated or busy):
            return []
        dt = max(now - last_time, 1e-9)
        queries = stats.prefix_cache_queries - last.prefix_cache_queries
        hits = stats.prefix_cache_hits - last.prefix_cache_hits
        out = [
            f"Engine 000: Avg prompt throughput: {prompt / dt:.1f} tokens/s, "
            f"Avg generation throughput: {generated / dt:.1f} tokens/s, "
            f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
            f"KV cache usage: {100 * stats.kv_cache_usage:.1f}%, "
            f"Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%"
        ]
        drafts = stats.spec_decode_num_drafts - last.spec_decode_num_drafts
        if drafts:
            drafted = stats.spec_decode_num_draft_tokens - last.spec_decode_num_draft_tokens
            accepted = stats.spec_decode_num_accepted_tokens - last.spec_decode_num_accepted_tokens
            before = last.spec_decode_num_accepted_tokens_per_pos
            per_pos = [
                (n - (before[j] if j < len(before) else 0)) / drafts
                for j, n in enumerate(stats.spec_decode_num_accepted_tokens_per_pos)
            ]
            out.append(
                f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, "
                f"Accepted throughput: {accepted / dt:.2f} tokens/s, "
                f"Drafted throughput: {drafted / dt:.2f} tokens/s, "
                f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, "
                f"Per-position acceptance rate: {', '.join(f'{r:.3f}' for r in per_pos)}, "
                f"Avg Draft acceptance rate: {100 * accepted / drafted if drafted else 0.0:.1f}%"
            )
        return out
