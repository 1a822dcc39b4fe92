"""HostTier: which prefix-cache blocks the host-memory tier holds, and in which host slot
(the disk tier behind it is a second HostTier over disk slots).

Plain bookkeeping (no bytes): the runner keeps each slot's data, the block pool decides what
goes in and out (:class:`jaxpaged.sched.block_pool.BlockPool`). A full block evicted from the
device pool's prefix cache is offered here under its chained prefix key; a later request whose
prefix runs on into keys held here gets those blocks copied back instead of recomputed.

* **Bounded, least recently used first out.** ``num_slots`` slots (``--kv-offloading-size`` /
  bytes per block). A new key takes a free slot, else the slot of the least recently used key
  (which is forgotten). A hit (:meth:`touch`) makes a key the most recently used.
* **Inclusive.** A key loaded back into the device stays here: evicting that device block
  again costs no copy.
* **Pins.** A key whose slot a plan reads (a load) is pinned until the next plan starts
  (:meth:`unpin_all`), so no store of the same plan reuses its slot before the runner reads it.
  When every key is pinned, a new key is refused (``put`` returns None: the block is dropped).
"""

from __future__ import annotations

import collections

__all__ = ["HostTier"]


class HostTier:
    """LRU map of prefix keys to host slots (see the module docstring)."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        self._slots: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # LRU first
        self._free: list[int] = []  # slots given back by clear(); then _fresh.. (lazy)
        self._fresh = 0
        self._pinned: set[bytes] = set()
        self.num_evictions = 0  # keys forgotten to make room
        self.last_evicted: bytes | None = None  # the key the last put forgot (None: none)

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, key: bytes) -> bool:
        return key in self._slots

    def slot(self, key: bytes) -> int:
        """The slot holding ``key`` (KeyError if none)."""
        return self._slots[key]

    def keys(self) -> list[bytes]:
        """The keys held, least recently used first."""
        return list(self._slots)

    def touch(self, key: bytes) -> None:
        """``key`` becomes the most recently used."""
        self._slots.move_to_end(key)

    def pin(self, key: bytes) -> None:
        """Keeps ``key`` (and its slot) until :meth:`unpin_all`; makes it most recent."""
        self.touch(key)
        self._pinned.add(key)

    def unpin_all(self) -> None:
        self._pinned.clear()

    def put(self, key: bytes) -> int | None:
        """A slot for a new ``key`` (not held yet): a free one, else the least recently
        used unpinned key's. None when there is no slot to give (every key pinned, or no
        slots at all)."""
        if key in self._slots:
            raise ValueError("put: key is already held")
        self.last_evicted = None
        if self._free:
            slot = self._free.pop()
        elif self._fresh < self.num_slots:
            slot = self._fresh
            self._fresh += 1
        else:
            victim = next((k for k in self._slots if k not in self._pinned), None)
            if victim is None:
                return None
            slot = self._slots.pop(victim)
            self.num_evictions += 1
            self.last_evicted = victim
        self._slots[key] = slot
        return slot

    def clear(self) -> None:
        """Forgets every key (their slots become free)."""
        self._free.extend(sorted(self._slots.values(), reverse=True))
        self._slots.clear()
        self._pinned.clear()
