"""BlockPool: which KV blocks are free, who holds them, and which hold a known prefix.

Host-side bookkeeping only (plain ints); the runner owns the device arrays and applies the
copy / swap lists this module returns.

* **Per-request state.** The pool owns every request's block table, keyed by request id:
  its device blocks (``req_to_blocks``), its host slots while swapped out, the memoised
  prefix keys of its full blocks and how many of its leading blocks it has offered to the
  prefix cache. Callers pass the id plus the plain values a method needs (token counts, a
  token-slice function) and read a table back with :meth:`block_table`. :meth:`free` and
  :meth:`free_host` drop every entry of the id, so a later request that reuses the id starts
  clean; the caller must call one of them whenever a request ends or is preempted.
* **Changes.** The pool notes, per request, the first entry of its table changed since the
  caller last took its changes (:meth:`take_block_changes`): a plan sends the runner those
  entries only, not the whole table.
* **Ref counts.** A device block is held by every request whose table names it. Free blocks
  (ref 0) sit in two lists: *uncached* ones (no known content, reused first) and *cached*
  ones (a full block registered in the prefix cache), reused least-recently-freed first. A
  request frees its blocks tail first, so a prefix outlives the blocks after it.
* **Prefix caching.** A full block whose tokens are computed is registered under
  ``hash_i = sha256(hash_{i-1} || token ids of block i)``: the key of block i covers tokens
  of blocks 0..i, so equal keys mean equal K/V. A new request takes over the longest run of
  registered blocks of its first ``num_tokens - 1`` tokens (the last token is always
  computed, so its logits exist). A request with a LoRA adapter chains from a root key of
  its adapter's name (``salt``), so only requests with the same adapter share. A freed cached block is reusable until it is evicted
  (taken for other content, which drops its key).
* **Copy-on-write.** Before a request writes into a block it shares (ref > 1) it gets a
  fresh block, and ``allocate_slots`` returns the ``(src, dst)`` pair the runner must copy
  before the step. :meth:`fork` shares a request's blocks with another (``n > 1``).
* **Swap.** Host slots (``num_host_blocks``, from ``swap_space``) hold the blocks of swapped
  out requests; :meth:`swap_out` returns ``(device_block, host_slot)`` pairs and frees the
  device blocks, :meth:`swap_in` takes fresh device blocks and returns
  ``(host_slot, device_block)`` pairs. Runner order within one step: swap-out, swap-in,
  copies, then the forward pass (so a block freed by a swap-out can be reused at once).
  Host slots freed by a swap-in return to the free list only at the next
  :meth:`release_host_slots` (start of the next schedule), so no step reads and writes one.
* **Host tier** (``num_tier_blocks`` > 0, :mod:`.host_tier`). When a free cached block is
  evicted (taken for other content), its key and content go to the host tier unless it holds
  the key already: a ``(device_block, tier_slot)`` *offload*. :meth:`find_prefix` runs on past
  the device's blocks into keys the tier holds (entries of the result that are keys, not block
  ids); :meth:`allocate_slots` gives each a fresh block, registers it under its key at once
  and notes a ``(tier_slot, device_block)`` *load*. :meth:`take_tier_moves` hands both lists
  over once per plan; the runner applies offloads right after swap-outs and loads right after
  swap-ins, so an offload reads a block before anything of the same plan rewrites it, and a
  load fills its block before the forward pass reads it.
* **Disk tier** (``num_disk_blocks`` > 0, behind the host tier): a key the host tier forgets
  to make room is *spilled* to a disk slot first (``(tier_slot, disk_slot)``, applied before
  the offload that reuses the tier slot; a key offloaded in the same plan is not spilled), and
  :meth:`find_prefix` runs on into keys the disk holds (loaded as ``(disk_slot, block)``).

Invariant (tests assert it): every block taken is given back on finish, abort, preemption
or error, so after the last request ``num_free_blocks == num_blocks`` and no request id is
left in the pool's maps.
"""

from __future__ import annotations

import array
import collections
import hashlib
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from jaxpaged.sched.host_slots import HostSlots
from jaxpaged.sched.host_tier import HostTier

__all__ = [
    "BlockPool",
    "CopyPair",
    "PrefixEntry",
    "TierMoves",
    "TokenSlice",
    "hash_block_tokens",
]

CopyPair = tuple[int, int]  # (src, dst): device->device, device->host or host->device
# one block of a cached prefix: a device block id, or the key of a block the host (or disk)
# tier holds
PrefixEntry = int | bytes


class TierMoves(NamedTuple):
    """One plan's copies of the prefix cache's host and disk tiers (see BlockPool)."""

    offload: list[CopyPair]  # (device_block, tier_slot)
    load: list[CopyPair]  # (tier_slot, device_block)
    spill: list[CopyPair]  # (tier_slot, disk_slot)
    disk_load: list[CopyPair]  # (disk_slot, device_block)


# token_slice(start, stop): a request's token ids [start, stop) (Request.token_ids_slice)
TokenSlice = Callable[[int, int], Sequence[int]]

_ROOT_HASH = b"jaxpaged-prefix-v1"


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Chained key of one full block: sha256(parent key || int64 token ids)."""
    h = hashlib.sha256(parent_hash if parent_hash is not None else _ROOT_HASH)
    h.update(array.array("q", token_ids).tobytes())
    return h.digest()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockPool:
    """Free lists, ref counts, prefix-cache map, host swap slots and the block tables of the
    requests of one KV pool."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        num_host_blocks: int = 0,
        num_tier_blocks: int = 0,
        num_disk_blocks: int = 0,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_tier_blocks < 0:
            raise ValueError(f"num_tier_blocks must be >= 0, got {num_tier_blocks}")
        if num_tier_blocks and not enable_prefix_caching:
            raise ValueError("a host tier (num_tier_blocks > 0) needs prefix caching on")
        if num_disk_blocks < 0 or (num_disk_blocks and not num_tier_blocks):
            raise ValueError(
                f"num_disk_blocks must be >= 0 and needs a host tier, got {num_disk_blocks}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        # Free blocks without content: returned ones (a stack), then never-used ids
        # _fresh.. num_blocks - 1 (lazy, so a huge pool of tiny blocks costs nothing).
        self._free_uncached: list[int] = []
        self._fresh = 0
        # Free cached blocks, least recently freed first.
        self._free_cached: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._cached: dict[bytes, int] = {}  # prefix key -> block id
        self.host = HostSlots(num_host_blocks)
        # Per request id. Logical block i of a request lives in req_to_blocks[id][i] (device)
        # or, while swapped out, in host.req_to_slots[id][i] (host slot).
        self.req_to_blocks: dict[str, list[int]] = {}
        self._req_hashes: dict[str, list[bytes]] = {}  # keys of its full blocks, memoised
        self._num_registered: dict[str, int] = {}  # leading blocks offered to the cache
        # first entry of its table changed since take_block_changes (absent: none)
        self._changed_from: dict[str, int] = {}
        # host tier of evicted prefix blocks (None: off), and the moves of the plan being made
        self.tier = HostTier(num_tier_blocks) if num_tier_blocks else None
        self._offloads: list[CopyPair] = []  # (device_block, tier_slot)
        self._loads: list[CopyPair] = []  # (tier_slot, device_block)
        self.disk = HostTier(num_disk_blocks) if num_disk_blocks else None
        self._spills: list[CopyPair] = []  # (tier_slot, disk_slot)
        self._disk_loads: list[CopyPair] = []  # (disk_slot, device_block)
        self._offloaded_now: set[bytes] = set()  # keys offloaded in the plan being made

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks a request could take now (cached-but-free ones included: evictable)."""
        return len(self._free_uncached) + (self.num_blocks - self._fresh) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of device blocks held by requests."""
        return self.num_used_blocks / self.num_blocks

    def waste(self, computed: Iterable[tuple[str, int]]) -> float:
        """1 - tokens stored / slots of held blocks, given (request id, tokens computed) of
        every running request. Shared blocks count once."""
        used = self.num_used_blocks
        if used == 0:
            return 0.0
        bs = self.block_size
        empty: dict[int, int] = {}
        for request_id, n in computed:
            table = self.req_to_blocks.get(request_id, ())  # read only: no copy
            for i in range(n // bs, len(table)):
                b = table[i]
                empty[b] = min(empty.get(b, bs), bs - min(bs, max(0, n - i * bs)))
        return sum(empty.values()) / (used * bs)

    @property
    def num_host_blocks(self) -> int:
        return self.host.num_slots

    @property
    def num_free_host_blocks(self) -> int:
        return self.host.num_free

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def is_cached(self, block_id: int) -> bool:
        return self._hash[block_id] is not None

    def block_table(self, request_id: str) -> tuple[int, ...]:
        """The request's device block ids, logical block order (a snapshot)."""
        return tuple(self.req_to_blocks.get(request_id, ()))

    def take_block_changes(
        self, request_id: str, *, whole: bool = False
    ) -> tuple[int, tuple[int, ...]]:
        """``(start, ids)``: the request's table from its first entry changed since the last
        call on (every entry with ``whole``), ``start`` = the table's length and ``ids`` empty
        when nothing changed; the table is ``start + len(ids)`` long. Forgets the change."""
        table = self.req_to_blocks.get(request_id, ())
        start = self._changed_from.pop(request_id, len(table))
        if whole:
            start = 0
        return start, tuple(table[start:])

    def _changed(self, request_id: str, index: int) -> None:
        old = self._changed_from.get(request_id)
        if old is None or index < old:
            self._changed_from[request_id] = index

    def num_blocks_of(self, request_id: str) -> int:
        """Device blocks the request holds."""
        return len(self.req_to_blocks.get(request_id, ()))

    def host_block_table(self, request_id: str) -> tuple[int, ...]:
        """The host slots of a swapped-out request, logical block order (a snapshot)."""
        return self.host.table(request_id)

    def tracked_request_ids(self) -> set[str]:
        """Ids the pool keeps any state for (blocks, host slots, keys or counts)."""
        return (
            set(self.req_to_blocks)
            | set(self.host.req_to_slots)
            | set(self._changed_from)
            | set(self._req_hashes)
            | set(self._num_registered)
        )

    # ------------------------------------------------------------ primitives
    def _take(self) -> int:
        if self._free_uncached:
            b = self._free_uncached.pop()
        elif self._fresh < self.num_blocks:
            b = self._fresh
            self._fresh += 1
        else:
            b, _ = self._free_cached.popitem(last=False)
            self._offload(b)
            self._uncache(b)
        self._ref[b] = 1
        return b

    def _offload(self, b: int) -> None:
        """Offers evicted cached block ``b`` to the host tier (a copy unless it holds the
        key already, or has no slot to give)."""
        h = self._hash[b]
        if self.tier is None or h is None:
            return
        if h in self.tier:
            self.tier.touch(h)
            return
        slot = self.tier.put(h)
        if slot is None:
            return
        victim = self.tier.last_evicted
        if self.disk is not None and victim is not None and victim not in self._offloaded_now:
            if victim in self.disk:
                self.disk.touch(victim)
            else:
                disk_slot = self.disk.put(victim)
                if disk_slot is not None:
                    self._spills.append((slot, disk_slot))
        self._offloads.append((b, slot))
        self._offloaded_now.add(h)

    def _incref(self, b: int) -> None:
        if self._ref[b] == 0:
            del self._free_cached[b]  # only cached blocks are found while free
        self._ref[b] += 1

    def _decref(self, b: int) -> None:
        if self._ref[b] <= 0:
            raise RuntimeError(f"block {b} freed more often than taken")
        self._ref[b] -= 1
        if self._ref[b] == 0:
            if self._hash[b] is not None:
                self._free_cached[b] = None
            else:
                self._free_uncached.append(b)

    def _uncache(self, b: int) -> None:
        h = self._hash[b]
        if h is not None:
            self._hash[b] = None
            if self._cached.get(h) == b:
                del self._cached[h]

    def _release_device(self, request_id: str) -> None:
        """Gives back the request's device blocks, tail first (so the tail is evicted
        before the prefix), and forgets which of them it registered."""
        for b in reversed(self.req_to_blocks.pop(request_id, ())):
            self._decref(b)
        self._num_registered.pop(request_id, None)
        self._changed_from.pop(request_id, None)

    # --------------------------------------------------------- prefix caching
    def block_hashes(
        self,
        request_id: str,
        num_full_blocks: int,
        token_slice: TokenSlice,
        salt: str | None = None,
    ) -> Sequence[bytes]:
        """The request's chained keys of (at least) its first ``num_full_blocks`` blocks,
        memoised under its id until it is freed: tokens never change once appended.
        ``salt`` (the LoRA adapter's name) keys the chain's root."""
        hashes = self._req_hashes.setdefault(request_id, [])
        bs = self.block_size
        root = None if salt is None else hashlib.sha256(b"lora:" + salt.encode()).digest()
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else root
            hashes.append(hash_block_tokens(parent, token_slice(i * bs, (i + 1) * bs)))
        return hashes

    def find_prefix(
        self, request_id: str, num_tokens: int, token_slice: TokenSlice, salt: str | None = None
    ) -> list[PrefixEntry]:
        """The longest cached prefix of the request's first ``num_tokens - 1`` tokens (keys
        salted as in :meth:`block_hashes`), one entry per block: the registered device
        block, or, for a block only the host tier holds, its key (pinned in the tier until
        the next plan). Only memoises keys and pins: pass the result to allocate_slots."""
        if not self.enable_prefix_caching:
            return []
        limit = (num_tokens - 1) // self.block_size
        blocks: list[PrefixEntry] = []
        for h in self.block_hashes(request_id, limit, token_slice, salt)[:limit]:
            b = self._cached.get(h)
            if b is not None:
                blocks.append(b)
            elif self.tier is not None and h in self.tier:
                self.tier.pin(h)
                blocks.append(h)
            elif self.disk is not None and h in self.disk:
                self.disk.pin(h)
                blocks.append(h)
            else:
                break
        return blocks

    def register_computed(
        self,
        request_id: str,
        num_computed_tokens: int,
        num_tokens: int,
        token_slice: TokenSlice,
        salt: str | None = None,
    ) -> None:
        """Offers the request's full, computed blocks whose tokens the host knows (the first
        ``min(num_computed_tokens, num_tokens)``) to the prefix cache. A key already held by
        another block keeps that block; this one stays anonymous."""
        if not self.enable_prefix_caching:
            return  # the registered count is read only while caching is on
        table = self.req_to_blocks.get(request_id, [])
        known = min(num_computed_tokens, num_tokens)
        n_full = min(known // self.block_size, len(table))
        done = self._num_registered.get(request_id, 0)
        if n_full <= done:
            return
        hashes = self.block_hashes(request_id, n_full, token_slice, salt)
        for i in range(done, n_full):
            b, h = table[i], hashes[i]
            if self._hash[b] is None and h not in self._cached:
                self._hash[b] = h
                self._cached[h] = b
        self._num_registered[request_id] = n_full

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix (held blocks keep their content, just unnamed), the
        host tier's too."""
        for b in list(self._free_cached):
            self._uncache(b)
            self._free_uncached.append(b)
        self._free_cached.clear()
        for b in list(self._cached.values()):
            self._uncache(b)
        if self.tier is not None:
            self.tier.clear()
        if self.disk is not None:
            self.disk.clear()

    def take_tier_moves(self) -> TierMoves:
        """The host and disk tiers' moves noted since the last call, for the plan being
        made. Forgets them."""
        moves = TierMoves(self._offloads, self._loads, self._spills, self._disk_loads)
        self._offloads, self._loads, self._spills, self._disk_loads = [], [], [], []
        self._offloaded_now = set()
        return moves

    # ---------------------------------------------------------------- allocate
    def blocks_needed(
        self,
        request_id: str,
        num_computed_tokens: int,
        num_new_tokens: int,
        prefix_blocks: Sequence[PrefixEntry] = (),
    ) -> int:
        """Free blocks allocate_slots would consume: new blocks, copy-on-write copies,
        prefix blocks that are currently free and blocks for the host tier's entries."""
        table = self.req_to_blocks.get(request_id, [])
        start = num_computed_tokens + len(prefix_blocks) * self.block_size
        end_block = _cdiv(start + num_new_tokens, self.block_size)
        held = len(table) + len(prefix_blocks)
        need = max(0, end_block - held)
        need += sum(1 for b in prefix_blocks if isinstance(b, bytes) or self._ref[b] == 0)
        for i in range(start // self.block_size, min(len(table), end_block)):
            if self._ref[table[i]] > 1:
                need += 1
        return need

    def can_allocate(
        self,
        request_id: str,
        num_computed_tokens: int,
        num_new_tokens: int,
        prefix_blocks: Sequence[PrefixEntry] = (),
    ) -> bool:
        """Whether allocate_slots with the same arguments would succeed now."""
        need = self.blocks_needed(request_id, num_computed_tokens, num_new_tokens, prefix_blocks)
        return need <= self.num_free_blocks

    def allocate_slots(
        self,
        request_id: str,
        num_computed_tokens: int,
        num_new_tokens: int,
        prefix_blocks: Sequence[PrefixEntry] = (),
    ) -> list[CopyPair] | None:
        """Makes the request's block table cover ``num_new_tokens`` more tokens past its
        ``num_computed_tokens`` (plus ``prefix_blocks``, find_prefix's entries, appended
        first and counted as computed: a host tier key becomes a fresh block with a load).
        Returns the copy-on-write ``(src, dst)`` pairs, or None (and changes nothing) when
        the free blocks do not suffice. The caller advances its ``num_computed_tokens`` by
        ``len(prefix_blocks) * block_size``."""
        if prefix_blocks and (self.num_blocks_of(request_id) or num_computed_tokens):
            raise ValueError("prefix_blocks can only start an empty block table")
        if not self.can_allocate(request_id, num_computed_tokens, num_new_tokens, prefix_blocks):
            return None
        table = self.req_to_blocks.setdefault(request_id, [])
        first_changed = len(table)
        for b in prefix_blocks:  # held first: taking the tier's blocks must not evict them
            if not isinstance(b, bytes):
                self._incref(b)
        for b in prefix_blocks:
            table.append(b if not isinstance(b, bytes) else self._load(b))
        if prefix_blocks:
            self._num_registered[request_id] = len(prefix_blocks)
        start = num_computed_tokens + len(prefix_blocks) * self.block_size
        end_block = _cdiv(start + num_new_tokens, self.block_size)
        copies: list[CopyPair] = []
        for i in range(start // self.block_size, min(len(table), end_block)):
            b = table[i]
            if self._ref[b] > 1:  # shared: write into a private copy
                nb = self._take()
                copies.append((b, nb))
                self._decref(b)
                table[i] = nb
                first_changed = min(first_changed, i)
            elif self._hash[b] is not None:  # about to be rewritten: no longer a clean key
                self._uncache(b)
            if self._num_registered.get(request_id, 0) > i:
                self._num_registered[request_id] = i
        while len(table) < end_block:
            table.append(self._take())
        if first_changed < len(table):
            self._changed(request_id, first_changed)
        return copies

    def _load(self, key: bytes) -> int:
        """A fresh block registered under ``key`` (held by the caller), to be filled from
        the host tier's slot: notes the load. (A key registered on the device since
        find_prefix shares that block instead.)"""
        b = self._cached.get(key)
        if b is not None:
            self._incref(b)
            return b
        assert self.tier is not None
        b = self._take()
        self._hash[b] = key
        self._cached[key] = b
        if key in self.tier:
            self._loads.append((self.tier.slot(key), b))
        else:
            assert self.disk is not None
            self._disk_loads.append((self.disk.slot(key), b))
        return b

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Gives back the request's blocks (device, or host slots while swapped out) past
        those holding its first ``num_tokens`` tokens, tail first: the slots of drafted
        tokens the target rejected. The runner hears of it as a change from the last kept
        entry on (re-sent, so the change is never empty)."""
        keep = _cdiv(num_tokens, self.block_size)
        table = self.req_to_blocks.get(request_id)
        if table and len(table) > keep:
            for b in reversed(table[keep:]):
                self._decref(b)
            del table[keep:]
            self._changed(request_id, max(keep - 1, 0))
            if self._num_registered.get(request_id, 0) > keep:
                self._num_registered[request_id] = keep
        self.host.trim(request_id, keep)  # free from the next schedule on

    def fork(
        self, parent_id: str, child_id: str, num_tokens: int, parent_num_computed_tokens: int
    ) -> None:
        """Child shares the parent's blocks holding its first ``num_tokens`` tokens (the
        partly filled last one included: copy-on-write splits it at the first write)."""
        if self.req_to_blocks.get(child_id):
            raise ValueError(f"fork: child {child_id!r} already holds blocks")
        if parent_num_computed_tokens < num_tokens:
            raise ValueError(
                f"fork: parent {parent_id!r} has computed {parent_num_computed_tokens}"
                f" tokens, fewer than the {num_tokens} to share"
            )
        blocks = self.req_to_blocks.get(parent_id, [])[: _cdiv(num_tokens, self.block_size)]
        for b in blocks:
            self._incref(b)
        self.req_to_blocks[child_id] = list(blocks)
        self._changed(child_id, 0)
        n_full = num_tokens // self.block_size
        self._req_hashes[child_id] = self._req_hashes.get(parent_id, [])[:n_full]
        registered = min(self._num_registered.get(parent_id, 0), n_full)
        if registered:
            self._num_registered[child_id] = registered

    def free(self, request_id: str) -> None:
        """Gives back every device block of the request, tail first (so the tail is
        evicted before the prefix), and forgets its keys: the id may be reused."""
        self._release_device(request_id)
        self._req_hashes.pop(request_id, None)

    # -------------------------------------------------------------------- swap
    def can_swap_out(self, request_id: str) -> bool:
        return self.num_blocks_of(request_id) <= self.num_free_host_blocks

    def swap_out(self, request_id: str) -> list[CopyPair]:
        """Moves the request's blocks to host slots: returns (device_block, host_slot)
        pairs to copy before the step, and frees the device blocks (its keys stay: the same
        tokens come back)."""
        blocks = self.req_to_blocks.get(request_id, [])
        pairs = list(zip(blocks, self.host.take(request_id, len(blocks)), strict=True))
        self._release_device(request_id)
        return pairs

    def can_swap_in(self, request_id: str, num_computed_tokens: int, num_new_tokens: int) -> bool:
        """Room for the request's swapped blocks plus ``num_new_tokens`` more tokens."""
        end_block = _cdiv(num_computed_tokens + num_new_tokens, self.block_size)
        return max(end_block, self.host.num_of(request_id)) <= self.num_free_blocks

    def swap_in(self, request_id: str) -> list[CopyPair]:
        """Takes fresh device blocks for the request's host slots: returns
        (host_slot, device_block) pairs to copy before the step."""
        if self.num_blocks_of(request_id):
            raise ValueError(f"swap_in: {request_id!r} already holds device blocks")
        if self.host.num_of(request_id) > self.num_free_blocks:
            raise RuntimeError("swap_in: not enough free device blocks")
        pairs = [(h, self._take()) for h in self.host.give_back_later(request_id)]
        self.req_to_blocks[request_id] = [b for _, b in pairs]
        self._changed(request_id, 0)
        return pairs

    def free_host(self, request_id: str) -> None:
        """Gives back the host slots of a swapped request that ends while swapped, and
        forgets its keys: the id may be reused."""
        self.host.free(request_id)
        self._req_hashes.pop(request_id, None)

    def release_host_slots(self) -> None:
        """Host slots read by the last step's swap-ins become free, and the host tier's
        pins go (call between steps)."""
        self.host.release_pending()
        if self.tier is not None:
            self.tier.unpin_all()
        if self.disk is not None:
            self.disk.unpin_all()
