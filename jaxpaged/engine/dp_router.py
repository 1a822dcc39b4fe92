"""Which data-parallel replica serves a request: the least-loaded one, unless a replica
already served the request's prompt prefix and is not overloaded (then that one, where the
prefix's KV blocks are cached). Plain Python over numbers the client keeps; no JAX.

Load is a replica's open requests (sent and not finished: its waiting + running + swapped,
counted by the client when it sends, so a burst is spread before any replica reports), then
its KV cache usage (in tenths, from its latest stats), then how many requests it was sent in
all (so an idle server still takes turns).

Prefix keys are chained hashes of the prompt's leading chunks: ``block_size`` token ids for a
prompt of token ids, ``4 * block_size`` characters for a text prompt (about a block of
tokens, with no tokenizing here), at most ``max_chunks`` of them; a prompt shorter than one
chunk has none. The router remembers the replica each key was last sent to (the
``table_size`` most recent keys) and prefers the one holding the request's longest known
prefix while its open requests exceed the least-loaded replica's by at most
``affinity_slack`` and its KV usage is under ``kv_overload``.

Replicas are named by any hashable id: the data-parallel client passes its loads as a list
(ids are ranks), the Ray Serve router (jaxpaged.serving.ray_router) as a mapping from Ray's
replica ids. One rule serves both.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Hashable, Mapping, Sequence

__all__ = ["Loads", "ReplicaLoad", "Router", "RouterConfig", "prefix_keys"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RouterConfig:
    block_size: int = 16
    affinity_slack: int = 4  # open requests the preferred replica may have above the least
    kv_overload: float = 0.9  # KV usage at which the preferred replica counts as overloaded
    max_chunks: int = 32
    table_size: int = 1 << 16

    def __post_init__(self) -> None:
        for name in ("block_size", "max_chunks", "table_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.affinity_slack < 0:
            raise ValueError(f"affinity_slack must be >= 0, got {self.affinity_slack!r}")
        if not 0 < self.kv_overload <= 1:
            raise ValueError(f"kv_overload must be in (0, 1], got {self.kv_overload!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplicaLoad:
    """One replica as the router sees it."""

    alive: bool
    open_requests: int
    kv_cache_usage: float
    sent_total: int


# replicas' loads: a list (ids are its indices) or a mapping from replica id, in order
Loads = Sequence[ReplicaLoad] | Mapping[Hashable, ReplicaLoad]


def prefix_keys(prompt: str | Sequence[int], config: RouterConfig) -> list[int]:
    """Chained hashes of the prompt's full leading chunks (see the module docstring)."""
    if isinstance(prompt, str):
        size = 4 * config.block_size
        chunks = [prompt[i : i + size] for i in range(0, len(prompt) - size + 1, size)]
    else:
        size = config.block_size
        ids = tuple(prompt)
        chunks = [ids[i : i + size] for i in range(0, len(ids) - size + 1, size)]
    keys, h = [], 0
    for chunk in chunks[: config.max_chunks]:
        h = hash((h, chunk))
        keys.append(h)
    return keys


class Router:
    """Chooses a replica per request; remembers where prompt prefixes went."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self._table: collections.OrderedDict[int, Hashable] = collections.OrderedDict()

    def least_loaded(self, loads: Loads) -> Hashable:
        """The id of the least-loaded live replica (ValueError when none is alive); ties go
        to the earlier one."""
        named = _named(loads)
        alive = [(i, r) for i, (r, load) in enumerate(named.items()) if load.alive]
        if not alive:
            raise ValueError("no live replica")
        return min(alive, key=lambda item: _order(named[item[1]], item[0]))[1]

    def choose(self, keys: Sequence[int], loads: Loads) -> Hashable:
        """The replica for a request with prefix ``keys`` (see :func:`prefix_keys`); records
        the choice for the keys."""
        chosen = self.prefer(keys, loads)
        self.record(keys, chosen)
        return chosen

    def prefer(self, keys: Sequence[int], loads: Loads) -> Hashable:
        """The holder of the longest recorded prefix of ``keys`` while it is alive and not
        overloaded (module docstring), else the least-loaded replica. Records nothing."""
        named = _named(loads)
        best = self.least_loaded(named)
        preferred = self._holder(keys)
        if preferred is None or preferred not in named:
            return best
        load, least = named[preferred], named[best]
        if (
            load.alive
            and load.open_requests <= least.open_requests + self.config.affinity_slack
            and load.kv_cache_usage < self.config.kv_overload
        ):
            return preferred
        return best

    def record(self, keys: Sequence[int], replica: Hashable) -> None:
        """Remembers that the prefix ``keys`` went to ``replica`` (the table's newest)."""
        for key in keys:
            self._table[key] = replica
            self._table.move_to_end(key)
        while len(self._table) > self.config.table_size:
            self._table.popitem(last=False)

    def forget(self, replica: Hashable) -> None:
        """Drops every prefix recorded for ``replica`` (one that died)."""
        for key in [k for k, r in self._table.items() if r == replica]:
            del self._table[key]

    def _holder(self, keys: Sequence[int]) -> Hashable | None:
        """The replica of the longest recorded prefix of ``keys``."""
        for key in reversed(keys):
            replica = self._table.get(key)
            if replica is not None:
                return replica
        return None


def _named(loads: Loads) -> Mapping[Hashable, ReplicaLoad]:
    return loads if isinstance(loads, Mapping) else dict(enumerate(loads))


def _order(load: ReplicaLoad, rank: int) -> tuple[int, int, int, int]:
    return (load.open_requests, round(load.kv_cache_usage * 10), load.sent_total, rank)
