"""The device side of multi-LoRA: the registered adapters (host copies) and the fixed-shape
slots the step reads.

Every site (see :mod:`jaxpaged.models.lora`) has one A [L, S, r', in] and one B
[L, S, out, r'] array with S = max_loras + 1 slots; slot 0 stays zero (no adapter). Loading
an adapter writes its host weights into one slot with a jitted update whose slot index is an
input, so loading and unloading adapters while serving compiles nothing after the first
(warm-up) write. Which adapter sits in which slot is the scheduler's decision
(:mod:`jaxpaged.sched.lora_slots`); this module only carries it out.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.models.config import ModelConfig
from jaxpaged.models.lora import LoraWeights, load_peft_adapter, site_shapes

__all__ = ["LoraAdapters"]


SlotArrays = dict[str, tuple[jax.Array, jax.Array]]  # site -> (A [L, S, r', in], B [L, S, out, r'])


@jax.jit
def _write_slot(
    slots: SlotArrays,
    slot: jax.Array,  # int32 []
    adapter: SlotArrays,  # site -> (A [L, r', in], B [L, out, r'])
) -> SlotArrays:
    return {
        site: (a.at[:, slot].set(adapter[site][0]), b.at[:, slot].set(adapter[site][1]))
        for site, (a, b) in slots.items()
    }


class LoraAdapters:
    """The adapters an engine knows (name -> host weights) and the device slots. The engine
    thread alone writes slots; registering an adapter may read files on any thread."""

    def __init__(
        self, config: ModelConfig, *, max_loras: int, max_rank: int, dtype: jnp.dtype
    ) -> None:
        self.config = config
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = jnp.dtype(dtype)
        self.registered: dict[str, tuple[LoraWeights, str]] = {}  # name -> (weights, path)
        n, s = config.num_layers, max_loras + 1
        self.slots: SlotArrays = {
            site: (jnp.zeros((n, s, *a), self.dtype), jnp.zeros((n, s, *b), self.dtype))
            for site, (a, b) in site_shapes(config, max_rank).items()
        }

    def read(self, path: str | os.PathLike[str]) -> LoraWeights:
        """An adapter folder's weights (ValueError naming what does not fit)."""
        return load_peft_adapter(path, self.config, max_rank=self.max_rank, dtype=self.dtype)

    def register(self, name: str, weights: LoraWeights, path: str) -> None:
        self.registered[name] = (weights, path)

    def unregister(self, name: str) -> None:
        self.registered.pop(name, None)

    def write_slot(self, slot: int, name: str) -> None:
        """Puts the registered adapter ``name`` into device slot ``slot`` (1..max_loras)."""
        if not 1 <= slot <= self.max_loras:
            raise ValueError(f"LoRA slot {slot} is not in 1..{self.max_loras}")
        weights, _ = self.registered[name]
        self.slots = _write_slot(self.slots, np.int32(slot), weights.sites)

    def warm_up(self) -> None:
        """Compiles the slot write (slot 0 rewritten with zeros, leaving it as it was)."""
        zeros = {
            site: (np.zeros(a.shape[:1] + a.shape[2:], self.dtype),
                   np.zeros(b.shape[:1] + b.shape[2:], self.dtype))
            for site, (a, b) in self.slots.items()
        }  # fmt: skip
        self.slots = _write_slot(self.slots, np.int32(0), zeros)
        jax.block_until_ready(self.slots)
