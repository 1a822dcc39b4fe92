"""Which LoRA adapter each device slot holds, decided on the host (no JAX).

The device has ``max_loras`` adapter slots (1..max_loras; slot 0 is "no adapter"). A request
holds its adapter's slot from admission until it finishes (preempted and swapped requests
too, so they can always resume). An adapter no request holds stays resident while its slot
is not needed (a later request finds it loaded), and the least recently used idle slot is
the one taken for a new adapter. When every slot is held by other adapters' requests, a
request waits.
"""

from __future__ import annotations

import collections

__all__ = ["LoraSlots"]


class LoraSlots:
    """Adapter name -> slot, with a count of holders per slot and an LRU of idle slots."""

    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        self.max_loras = max_loras
        self._slot_of: dict[str, int] = {}
        self._name_of: dict[int, str] = {}
        self._holders: dict[int, int] = {}
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self._free = list(range(max_loras, 0, -1))

    def slot_of(self, name: str) -> int | None:
        """The slot that holds ``name`` now, or None."""
        return self._slot_of.get(name)

    def can_acquire(self, name: str) -> bool:
        """Whether a request with adapter ``name`` could get a slot now."""
        return name in self._slot_of or bool(self._free) or bool(self._idle)

    def acquire(self, name: str) -> tuple[int, bool]:
        """A slot for one more request of ``name``: (slot, whether the adapter must be
        written into it first). Call only when :meth:`can_acquire`."""
        slot = self._slot_of.get(name)
        load = slot is None
        if slot is None:
            if self._free:
                slot = self._free.pop()
            else:
                slot, _ = self._idle.popitem(last=False)
                del self._slot_of[self._name_of.pop(slot)]
            self._slot_of[name] = slot
            self._name_of[slot] = name
            self._holders[slot] = 0
        self._idle.pop(slot, None)
        self._holders[slot] += 1
        return slot, load

    def release(self, slot: int) -> None:
        """One holder of ``slot`` finished; with none left the slot becomes idle."""
        self._holders[slot] -= 1
        if self._holders[slot] == 0:
            self._idle[slot] = None

    def num_holders(self, name: str) -> int:
        slot = self._slot_of.get(name)
        return 0 if slot is None else self._holders[slot]

    def forget(self, name: str) -> None:
        """Drops an idle adapter's residency (it was unregistered); ValueError while
        requests hold it."""
        slot = self._slot_of.get(name)
        if slot is None:
            return
        if self._holders[slot]:
            raise ValueError(f"LoRA adapter {name!r} is in use by {self._holders[slot]} requests")
        del self._slot_of[name], self._name_of[slot], self._holders[slot]
        self._idle.pop(slot, None)
        self._free.append(slot)

    @property
    def resident(self) -> dict[str, int]:
        """Adapter name -> slot, for every adapter on the device."""
        return dict(self._slot_of)
