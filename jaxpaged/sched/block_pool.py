"""BlockPool: which KV blocks are free, who holds them, and which hold a known prefix.

Host-side bookkeeping only (plain ints); the runner owns the device arrays and applies the
copy / swap lists this module returns.

* **Ref counts.** A device block is held by every request whose ``block_table`` names it.
  Free blocks (ref 0) sit in two lists: *uncached* ones (no known content, reused first) and
  *cached* ones (a full block registered in the prefix cache), reused least-recently-freed
  first. A request frees its blocks tail first, so a prefix outlives the blocks after it.
* **Prefix caching.** A full block whose tokens are computed is registered under
  ``hash_i = sha256(hash_{i-1} || token ids of block i)``: the key of block i covers tokens
  of blocks 0..i, so equal keys mean equal K/V. A new request takes over the longest run of
  registered blocks of its first ``num_tokens - 1`` tokens (the last token is always
  computed, so its logits exist). A freed cached block is reusable until it is evicted
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

Invariant (tests assert it): every block taken is given back on finish, abort, preemption
or error, so after the last request ``num_free_blocks == num_blocks``.
"""

from __future__ import annotations

import array
import collections
import hashlib
from collections.abc import Sequence

from jaxpaged.sched.request import Request

__all__ = ["BlockPool", "CopyPair", "hash_block_tokens"]

CopyPair = tuple[int, int]  # (src, dst): device->device, device->host or host->device

_ROOT_HASH = b"jaxpaged-prefix-v1"


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Chained key of one full block: sha256(parent key || int64 token ids)."""
    h = hashlib.sha256(parent_hash if parent_hash is not None else _ROOT_HASH)
    h.update(array.array("q", token_ids).tobytes())
    return h.digest()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockPool:
    """Free lists, ref counts, prefix-cache map and host swap slots of one KV pool."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        num_host_blocks: int = 0,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_host_blocks = num_host_blocks
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        # Free blocks without content: returned ones (a stack), then never-used ids
        # _fresh.. num_blocks - 1 (lazy, so a huge pool of tiny blocks costs nothing).
        self._free_uncached: list[int] = []
        self._fresh = 0
        # Free cached blocks, least recently freed first.
        self._free_cached: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._cached: dict[bytes, int] = {}  # prefix key -> block id
        self._host_free: list[int] = []  # returned host slots; then _host_fresh.. (lazy)
        self._host_fresh = 0
        self._host_pending: list[int] = []

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

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._host_free) + (self.num_host_blocks - self._host_fresh)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def is_cached(self, block_id: int) -> bool:
        return self._hash[block_id] is not None

    # ------------------------------------------------------------ primitives
    def _take(self) -> int:
        if self._free_uncached:
            b = self._free_uncached.pop()
        elif self._fresh < self.num_blocks:
            b = self._fresh
            self._fresh += 1
        else:
            b, _ = self._free_cached.popitem(last=False)
            self._uncache(b)
        self._ref[b] = 1
        return b

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

    # --------------------------------------------------------- prefix caching
    def block_hashes(self, request: Request, num_full_blocks: int) -> list[bytes]:
        """The request's chained keys of its first ``num_full_blocks`` blocks (memoised on
        ``request.block_hashes``: tokens never change once appended)."""
        hashes = request.block_hashes
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, request.token_ids_slice(i * bs, (i + 1) * bs)))
        return hashes

    def find_prefix(self, request: Request) -> list[int]:
        """Registered blocks holding the longest cached prefix of the request's first
        ``num_tokens - 1`` tokens. No side effects: pass the result to allocate_slots."""
        if not self.enable_prefix_caching:
            return []
        limit = (request.num_tokens - 1) // self.block_size
        blocks = []
        for h in self.block_hashes(request, limit)[:limit]:
            b = self._cached.get(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def register_computed(self, request: Request) -> None:
        """Offers the request's full, computed blocks whose tokens the host knows to the
        prefix cache. A key already held by another block keeps that block; this one stays
        anonymous."""
        known = min(request.num_computed_tokens, request.num_tokens)
        n_full = min(known // self.block_size, len(request.block_table))
        if not self.enable_prefix_caching:
            request.num_registered_blocks = n_full
            return
        if n_full <= request.num_registered_blocks:
            return
        hashes = self.block_hashes(request, n_full)
        for i in range(request.num_registered_blocks, n_full):
            b, h = request.block_table[i], hashes[i]
            if self._hash[b] is None and h not in self._cached:
                self._hash[b] = h
                self._cached[h] = b
        request.num_registered_blocks = n_full

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix (held blocks keep their content, just unnamed)."""
        for b in list(self._free_cached):
            self._uncache(b)
            self._free_uncached.append(b)
        self._free_cached.clear()
        for b in list(self._cached.values()):
            self._uncache(b)

    # ---------------------------------------------------------------- allocate
    def blocks_needed(
        self, request: Request, num_new_tokens: int, prefix_blocks: Sequence[int] = ()
    ) -> int:
        """Free blocks allocate_slots would consume: new blocks, copy-on-write copies and
        prefix blocks that are currently free."""
        table = request.block_table
        start = request.num_computed_tokens + len(prefix_blocks) * self.block_size
        end_block = _cdiv(start + num_new_tokens, self.block_size)
        held = len(table) + len(prefix_blocks)
        need = max(0, end_block - held)
        need += sum(1 for b in prefix_blocks if self._ref[b] == 0)
        for i in range(start // self.block_size, min(len(table), end_block)):
            if self._ref[table[i]] > 1:
                need += 1
        return need

    def allocate_slots(
        self, request: Request, num_new_tokens: int, prefix_blocks: Sequence[int] = ()
    ) -> list[CopyPair] | None:
        """Makes the request's block table cover ``num_new_tokens`` more tokens past
        ``num_computed_tokens`` (plus ``prefix_blocks``, appended first and counted as
        computed). Returns the copy-on-write ``(src, dst)`` pairs, or None (and changes
        nothing) when the free blocks do not suffice. The caller advances
        ``num_computed_tokens`` by ``len(prefix_blocks) * block_size``."""
        if prefix_blocks and (request.block_table or request.num_computed_tokens):
            raise ValueError("prefix_blocks can only start an empty block table")
        if self.blocks_needed(request, num_new_tokens, prefix_blocks) > self.num_free_blocks:
            return None
        table = request.block_table
        for b in prefix_blocks:
            self._incref(b)
            table.append(b)
        if prefix_blocks:
            request.num_registered_blocks = len(prefix_blocks)
        start = request.num_computed_tokens + len(prefix_blocks) * self.block_size
        end_block = _cdiv(start + num_new_tokens, self.block_size)
        copies: list[CopyPair] = []
        for i in range(start // self.block_size, min(len(table), end_block)):
            b = table[i]
            if self._ref[b] > 1:  # shared: write into a private copy
                nb = self._take()
                copies.append((b, nb))
                self._decref(b)
                table[i] = nb
            elif self._hash[b] is not None:  # about to be rewritten: no longer a clean key
                self._uncache(b)
            request.num_registered_blocks = min(request.num_registered_blocks, i)
        while len(table) < end_block:
            table.append(self._take())
        return copies

    def fork(self, parent: Request, child: Request, num_tokens: int) -> None:
        """Child shares the parent's blocks holding its first ``num_tokens`` tokens (the
        partly filled last one included: copy-on-write splits it at the first write)."""
        if child.block_table:
            raise ValueError(f"fork: child {child.request_id!r} already holds blocks")
        if parent.num_computed_tokens < num_tokens:
            raise ValueError(
                f"fork: parent {parent.request_id!r} has computed {parent.num_computed_tokens}"
                f" tokens, fewer than the {num_tokens} to share"
            )
        blocks = parent.block_table[: _cdiv(num_tokens, self.block_size)]
        for b in blocks:
            self._incref(b)
        child.block_table = list(blocks)
        n_full = num_tokens // self.block_size
        child.block_hashes = parent.block_hashes[:n_full]
        child.num_registered_blocks = min(parent.num_registered_blocks, n_full)

    def free(self, request: Request) -> None:
        """Gives back every device block of the request, tail first (so the tail is
        evicted before the prefix)."""
        for b in reversed(request.block_table):
            self._decref(b)
        request.block_table = []
        request.num_registered_blocks = 0

    # -------------------------------------------------------------------- swap
    def can_swap_out(self, request: Request) -> bool:
        return len(request.block_table) <= self.num_free_host_blocks

    def _take_host(self) -> int:
        if self._host_free:
            return self._host_free.pop()
        self._host_fresh += 1
        return self._host_fresh - 1

    def swap_out(self, request: Request) -> list[CopyPair]:
        """Moves the request's blocks to host slots: returns (device_block, host_slot)
        pairs to copy before the step, and frees the device blocks."""
        if not self.can_swap_out(request):
            raise RuntimeError(
                f"swap_out: {len(request.block_table)} blocks needed, "
                f"{self.num_free_host_blocks} host slots free"
            )
        pairs = [(b, self._take_host()) for b in request.block_table]
        request.host_block_table = [h for _, h in pairs]
        self.free(request)
        return pairs

    def can_swap_in(self, request: Request, num_new_tokens: int) -> bool:
        """Room for the request's swapped blocks plus ``num_new_tokens`` more tokens."""
        end_block = _cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        return max(end_block, len(request.host_block_table)) <= self.num_free_blocks

    def swap_in(self, request: Request) -> list[CopyPair]:
        """Takes fresh device blocks for the request's host slots: returns
        (host_slot, device_block) pairs to copy before the step."""
        if request.block_table:
            raise ValueError(f"swap_in: {request.request_id!r} already holds device blocks")
        if len(request.host_block_table) > self.num_free_blocks:
            raise RuntimeError("swap_in: not enough free device blocks")
        pairs = [(h, self._take()) for h in request.host_block_table]
        request.block_table = [b for _, b in pairs]
        request.num_registered_blocks = 0
        self._host_pending.extend(request.host_block_table)
        request.host_block_table = []
        return pairs

    def free_host(self, request: Request) -> None:
        """Gives back the host slots of a swapped request that ends while swapped."""
        self._host_free.extend(reversed(request.host_block_table))
        request.host_block_table = []

    def release_host_slots(self) -> None:
        """Host slots read by the last step's swap-ins become free (call between steps)."""
        self._host_free.extend(reversed(self._host_pending))
        self._host_pending.clear()
