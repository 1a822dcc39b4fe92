"""The data-parallel replicas' stats added up into one EngineStats (what the servers' metrics
read from jaxpaged.engine.data_parallel.DataParallelClient.get_stats)."""

from __future__ import annotations

from collections.abc import Sequence

from jaxpaged.engine.protocol import EngineStats

__all__ = ["sum_stats"]


def sum_stats(items: Sequence[tuple[EngineStats, bool]]) -> EngineStats:
    """Replicas' stats (with whether each is alive) added up (see ``get_stats``)."""
    live = [s for s, alive in items if alive]
    blocks = sum(s.num_kv_blocks for s in live)
    per_pos: list[int] = []
    for s, _ in items:
        for j, n in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
            if j == len(per_pos):
                per_pos.append(0)
            per_pos[j] += n
    waste = [s.kv_cache_waste for s in live]

    def total(name: str, stats: Sequence[EngineStats]) -> int:
        return sum(getattr(s, name) for s in stats)

    every = [s for s, _ in items]
    return EngineStats(
        num_running=total("num_running", live),
        num_waiting=total("num_waiting", live),
        num_swapped=total("num_swapped", live),
        kv_cache_usage=(
            sum(s.kv_cache_usage * s.num_kv_blocks for s in live) / blocks if blocks else 0.0
        ),
        kv_cache_waste=sum(waste) / len(waste) if waste else 0.0,
        num_kv_blocks=blocks,
        num_free_blocks=total("num_free_blocks", live),
        num_preemptions=total("num_preemptions", every),
        prefix_cache_queries=total("prefix_cache_queries", every),
        prefix_cache_hits=total("prefix_cache_hits", every),
        prompt_tokens_total=total("prompt_tokens_total", every),
        generation_tokens_total=total("generation_tokens_total", every),
        num_steps=total("num_steps", every),
        num_compilations=total("num_compilations", every),
        num_compilations_after_warmup=total("num_compilations_after_warmup", every),
        spec_decode_num_drafts=total("spec_decode_num_drafts", every),
        spec_decode_num_draft_tokens=total("spec_decode_num_draft_tokens", every),
        spec_decode_num_accepted_tokens=total("spec_decode_num_accepted_tokens", every),
        spec_decode_num_accepted_tokens_per_pos=tuple(per_pos),
        running_lora_adapters=tuple(sorted({a for s in live for a in s.running_lora_adapters})),
        waiting_lora_adapters=tuple(sorted({a for s in live for a in s.waiting_lora_adapters})),
        max_loras=max((s.max_loras for s in every), default=0),
        kv_offload_num_blocks=total("kv_offload_num_blocks", live),
        kv_offload_capacity_blocks=total("kv_offload_capacity_blocks", live),
        **{name: total(name, every) for name in _OFFLOAD_COUNTERS},
    )


# the host / disk tiers' counters (totals since start, kept for replicas that died)
_OFFLOAD_COUNTERS = (
    "kv_offload_hits",
    "kv_offload_blocks_stored",
    "kv_offload_blocks_loaded",
    "kv_offload_bytes_stored",
    "kv_offload_bytes_loaded",
    "kv_offload_disk_blocks_stored",
    "kv_offload_disk_blocks_loaded",
    "mm_cache_queries",
    "mm_cache_hits",
    "mm_cache_evictions",
    "mm_encoder_seconds",
)
