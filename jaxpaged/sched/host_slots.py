"""HostSlots: the host swap space of one KV pool, as slot ids and per-request host tables.

Plain ints, no JAX: the runner owns the host arrays. A slot freed while a step may still read
it (a swap-in's source, a trimmed tail) is *pending* until :meth:`release_pending`, called
between steps, so no step reads and writes one slot.
"""

from __future__ import annotations

from collections.abc import Callable

from jaxpaged.config import CacheConfig, SchedulerConfig

__all__ = ["HostSlots", "host_block_counts"]


def host_block_counts(
    scheduler_config: SchedulerConfig,
    cache_config: CacheConfig,
    bytes_per_block: int | None,
    *,
    host: int | None = None,
    tier: int | None = None,
    disk: int | None = None,
) -> tuple[int, int, int]:
    """(swap slots, host tier slots, disk tier slots): each as given, else from its setting's
    bytes over ``bytes_per_block`` (ValueError when that is needed and missing), else 0."""

    def sized(given: int | None, setting: str, wanted: bool, count: Callable[[int], int]) -> int:
        if given is not None or not wanted:
            return given or 0
        if bytes_per_block is None:
            raise ValueError(f"bytes_per_block is required with {setting}")
        return count(bytes_per_block)

    return (
        sized(host, "preemption_mode='swap'", scheduler_config.preemption_mode == "swap",
              cache_config.num_host_blocks),
        sized(tier, "kv_offloading_size", bool(cache_config.kv_offloading_size),
              cache_config.num_tier_blocks),
        sized(disk, "kv_offloading_disk_dir", bool(cache_config.kv_offloading_disk_dir),
              cache_config.num_disk_blocks),
    )  # fmt: skip


class HostSlots:
    """``num_slots`` host slots: a free stack, then never-used ids taken lazily (a large swap
    space of small blocks costs nothing up front), and the slots of each swapped request in
    logical block order."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        self._free: list[int] = []  # returned slots; then _fresh .. num_slots - 1
        self._fresh = 0
        self._pending: list[int] = []
        self.req_to_slots: dict[str, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free) + (self.num_slots - self._fresh)

    def table(self, request_id: str) -> tuple[int, ...]:
        """The request's host slots, logical block order (a snapshot)."""
        return tuple(self.req_to_slots.get(request_id, ()))

    def num_of(self, request_id: str) -> int:
        return len(self.req_to_slots.get(request_id, ()))

    def take(self, request_id: str, count: int) -> list[int]:
        """``count`` free slots, now the request's host table (the caller checked room)."""
        if count > self.num_free:
            raise RuntimeError(f"swap_out: {count} blocks needed, {self.num_free} host slots free")
        slots = []
        for _ in range(count):
            if self._free:
                slots.append(self._free.pop())
            else:
                slots.append(self._fresh)
                self._fresh += 1
        self.req_to_slots[request_id] = slots
        return slots

    def give_back_later(self, request_id: str) -> list[int]:
        """Drops the request's table (a swap-in read it): its slots free from the next step."""
        slots = self.req_to_slots.pop(request_id, [])
        self._pending.extend(slots)
        return slots

    def trim(self, request_id: str, keep: int) -> None:
        """Keeps the request's first ``keep`` slots; the rest free from the next step."""
        slots = self.req_to_slots.get(request_id)
        if slots and len(slots) > keep:
            self._pending.extend(slots[keep:])
            del slots[keep:]

    def free(self, request_id: str) -> None:
        """Gives back the slots of a request that ends while swapped out, at once."""
        self._free.extend(reversed(self.req_to_slots.pop(request_id, ())))

    def release_pending(self) -> None:
        """Slots read by the last step become free (call between steps)."""
        self._free.extend(reversed(self._pending))
        self._pending.clear()
