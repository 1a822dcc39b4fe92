"""The KV pool's block moves for one runner: device-to-device copies (copy-on-write), swap to
host memory and back (preemption), the prefix cache's host tier (offload, load) and the disk
tier behind it (spill, load from disk). It keeps the host copies; each move takes the pool and
returns the pool it leaves (JAX arrays are immutable), so the runner stays the pool's owner.

Blocks go to host memory by one path: a gather on the device whose transfer to the host starts
at once (``copy_to_host_async``) and is fetched into per-slot numpy copies once it is done
(:meth:`BlockMover.fetch`: at the next dispatch, at the collect of the step it preceded, or
earlier if a swap-in or load reads the slot), so the copy overlaps the step dispatched after
it. The disk tier keeps one file per disk slot, each pool array's bytes of the block in turn,
written and read on the engine thread. Moves run ``max_move`` pairs at a time: a few compiled
sizes (warmed up by :meth:`BlockMover.warm_up`) cover every plan.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence

import jax
import numpy as np

from jaxpaged.sched.output import SchedulerOutput
from jaxpaged.worker.buckets import pow2_ladder
from jaxpaged.worker.kv_cache import KVLayout
from jaxpaged.worker.programs import EnginePrograms

Pool = tuple[jax.Array, ...]  # the KV pool's arrays, each [num_layers * num_blocks, *page]
Pairs = Sequence[tuple[int, int]]


@dataclasses.dataclass(eq=False)
class HostBlock:
    """One block's copy in host memory: per pool array [L, *page]. Until fetched
    (``data`` None) it is row ``index`` of a device gather whose transfer is under way."""

    gather: tuple[jax.Array, ...] | None  # one [L, N, *page] array per pool array
    index: int
    data: tuple[np.ndarray, ...] | None = None


class BlockMover:
    """Applies a plan's block moves to the pool (engine thread only, like the runner)."""

    def __init__(self, programs: EnginePrograms, layout: KVLayout, max_move: int) -> None:
        self.programs = programs
        self.layout = layout
        self.max_move = max_move  # blocks moved per call: one sequence's worth, a power of 2
        # swapped-out blocks: host slot -> its copy; the prefix cache's host tier: tier slot ->
        # its copy (the scheduler bounds both: a slot the tier forgot at a prefix-cache reset
        # keeps its copy until reused, never more than the tier's size); gathers whose host
        # copies are not fetched yet
        self.host_blocks: dict[int, HostBlock] = {}
        self.tier_blocks: dict[int, HostBlock] = {}
        self.unfetched: list[list[HostBlock]] = []
        self.disk_dir: str | None = None  # the disk tier's folder (set by the engine builder)

    @property
    def _dims(self) -> dict[str, int]:
        return dict(num_layers=self.layout.num_layers, num_blocks=self.layout.num_blocks)

    def apply(
        self, pool: Pool, plan: SchedulerOutput, announce_copy: Callable | None = None
    ) -> Pool:
        """The plan's moves in order: spills, swap-outs and offloads read the blocks before
        swap-ins, loads and copies overwrite any; ``announce_copy(src, dst)`` tells a
        multi-host run's followers of each copy."""
        self.fetch(wait=False)
        self._spill(plan.blocks_to_spill)
        self.swap_out(pool, plan.blocks_to_swap_out)
        self.offload(pool, plan.blocks_to_offload)
        pool = self.swap_in(pool, plan.blocks_to_swap_in)
        pool = self.load(pool, plan.blocks_to_load)
        pool = self._load_from_disk(pool, plan.blocks_to_load_from_disk)
        for chunk in self._chunks(plan.blocks_to_copy):
            src, dst = zip(*chunk, strict=True)
            src, dst = padded(src), padded(dst)
            if announce_copy is not None:
                announce_copy(src, dst)
            pool = self.copy(pool, src, dst)
        return pool

    def swap_out(self, pool: Pool, pairs: Pairs) -> None:
        """(device block, host slot) pairs: a preempted request's blocks to host memory."""
        for chunk in self._chunks(pairs):
            self._to_host(pool, chunk, self.host_blocks)

    def offload(self, pool: Pool, pairs: Pairs) -> None:
        """(device block, tier slot) pairs: evicted cached blocks to the host tier."""
        for chunk in self._chunks(pairs):
            self._to_host(pool, chunk, self.tier_blocks)

    def swap_in(self, pool: Pool, pairs: Pairs) -> Pool:
        """(host slot, device block) pairs; the host slots read back are given up (the
        scheduler frees them)."""
        for chunk in self._chunks(pairs):
            pool = self._to_device(pool, chunk, self.host_blocks, keep=False)
        return pool

    def load(self, pool: Pool, pairs: Pairs) -> Pool:
        """(tier slot, device block) pairs; the tier keeps its copies (it is inclusive)."""
        for chunk in self._chunks(pairs):
            pool = self._to_device(pool, chunk, self.tier_blocks, keep=True)
        return pool

    def copy(
        self,
        pool: Pool,
        src: np.ndarray,  # int32 [N] source block ids, -1 = padding
        dst: np.ndarray,  # int32 [N] destination block ids
    ) -> Pool:
        """The device call of a block copy (followers of a multi-host run too)."""
        return self.programs.copy_blocks(pool, src, dst, **self._dims)

    def clear(self) -> None:
        """Forgets every host copy (the pool was released)."""
        self.host_blocks.clear()
        self.tier_blocks.clear()
        self.unfetched.clear()

    def warm_up(self, pool: Pool, *, swap: bool, done: Callable[[], None]) -> Pool:
        """Compiles the copy (and with ``swap`` the gather and scatter) of every move size;
        ``done()`` after each program. Returns the pool (unchanged: every id is padding)."""
        for n in pow2_ladder(1, self.max_move):
            none = np.full(n, -1, np.int32)
            pool = self.programs.copy_blocks(pool, none, none, **self._dims)
            done()
            if swap:
                arrays = jax.device_get(self.programs.gather_blocks(pool, none, **self._dims))
                done()
                pool = self.programs.scatter_blocks(pool, none, tuple(arrays), **self._dims)
                done()
        return pool

    def num_programs(self, *, swap: bool) -> int:
        return len(pow2_ladder(1, self.max_move)) * (3 if swap else 1)

    def _chunks(self, pairs: Pairs) -> list[Pairs]:
        m = self.max_move
        return [pairs[i : i + m] for i in range(0, len(pairs), m)]

    def _disk_path(self, slot: int) -> str:
        if self.disk_dir is None:
            raise RuntimeError("a plan moves disk-tier blocks but the runner has no disk_dir")
        return os.path.join(self.disk_dir, f"block-{slot}.kv")

    def _spill(self, pairs: Pairs) -> None:
        """(tier slot, disk slot) pairs: writes the host tier's copies to disk files."""
        for slot, disk in pairs:
            blk = self.tier_blocks[slot]
            if blk.data is None:
                self.fetch()
            with open(self._disk_path(disk), "wb") as f:
                for a in blk.data:
                    f.write(np.ascontiguousarray(a).tobytes())

    def _load_from_disk(self, pool: Pool, pairs: Pairs) -> Pool:
        """(disk slot, device block) pairs: reads the files back into the blocks."""
        if not pairs:  # also while asleep: no pool to read shapes from
            return pool
        shapes = [
            ((self.layout.num_layers, *shape[1:]), p.dtype)
            for shape, p in zip(self.layout.shapes, pool, strict=True)
        ]
        for chunk in self._chunks(pairs):
            datas = []
            for disk, _ in chunk:
                with open(self._disk_path(disk), "rb") as f:
                    raw = f.read()
                arrays, at = [], 0
                for shape, dtype in shapes:
                    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
                    arrays.append(np.frombuffer(raw[at : at + n], dtype).reshape(shape))
                    at += n
                datas.append(tuple(arrays))
            pool = self._scatter(pool, [dev for _, dev in chunk], datas)
        return pool

    def _to_host(self, pool: Pool, pairs: Pairs, store: dict[int, HostBlock]) -> None:
        """(device block, host slot) pairs: gathers the blocks (after the steps already
        dispatched, which wrote them) and starts their transfer; fetched later."""
        dev, slots = zip(*pairs, strict=True)
        gather = self.programs.gather_blocks(pool, padded(dev), **self._dims)
        for a in gather:
            a.copy_to_host_async()
        blocks = [HostBlock(gather, i) for i in range(len(slots))]
        store.update(zip(slots, blocks, strict=True))
        self.unfetched.append(blocks)

    def fetch(self, *, wait: bool = True) -> None:
        """Keeps one numpy copy per block of the gathers whose transfers are under way (not
        a view: a slot outlives the rest of its gather); without ``wait``, of those done."""
        left = []
        for blocks in self.unfetched:
            gather = blocks[0].gather
            if not wait and not all(a.is_ready() for a in gather):
                left.append(blocks)
                continue
            arrays = jax.device_get(gather)
            for blk in blocks:
                blk.data = tuple(a[:, blk.index].copy() for a in arrays)
                blk.gather = None
        self.unfetched = left

    def _to_device(
        self, pool: Pool, pairs: Pairs, store: dict[int, HostBlock], *, keep: bool
    ) -> Pool:
        """(host slot, device block) pairs: writes the slots' copies into the blocks."""
        slots, dev = zip(*pairs, strict=True)
        blocks = [store[slot] if keep else store.pop(slot) for slot in slots]
        if any(blk.data is None for blk in blocks):
            self.fetch()
        return self._scatter(pool, dev, [blk.data for blk in blocks])

    def _scatter(
        self, pool: Pool, dev: Sequence[int], datas: Sequence[tuple[np.ndarray, ...]]
    ) -> Pool:
        """Writes one [L, *page] array per pool array into each device block of ``dev``."""
        ids = padded(dev)
        arrays = tuple(
            np.zeros((self.layout.num_layers, len(ids), *shape[1:]), p.dtype)
            for shape, p in zip(self.layout.shapes, pool, strict=True)
        )
        for i, data in enumerate(datas):
            for a, block in zip(arrays, data, strict=True):
                a[:, i] = block
        return self.programs.scatter_blocks(pool, ids, arrays, **self._dims)


def padded(ids: Sequence[int]) -> np.ndarray:
    """int32 [next power of 2 >= len(ids)]: the ids, then -1 (padding the programs skip)."""
    n = 1 << max(0, (len(ids) - 1).bit_length())
    out = np.full(n, -1, np.int32)
    out[: len(ids)] = ids
    return out
