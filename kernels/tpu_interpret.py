"""Running JAX's TPU ragged paged-attention kernel on a CPU, in Pallas' TPU interpret mode.

``interpret_mode()`` enters ``pltpu.force_tpu_interpret_mode`` (every ``pallas_call`` traced
inside runs on the TPU simulator: HBM/VMEM buffers, DMAs, semaphores). JAX 0.10.2's simulator
cannot run that kernel as shipped; two shims, installed once on first use, fill the gaps:

* a read through a reshaped or bitcast ref (the kernel's ``kv_bufs.at[i].reshape(...)``, and
  ``.bitcast(uint32)`` for 16-bit pools) fails in ``to_range`` (``'ReshapeTransform' object
  has no attribute 'indices'``): the shim reads the range before the first such transform,
  then applies it and the transforms after it in numpy, with Mosaic's packing rule for a
  bitcast (values packed along the second-minor dimension, the first one in the low bits);
* a masked store fully inside its buffer is reported out of bounds when the mask is set past
  dimension 0's in-bounds length (the check indexes dimension 0 for every dimension): the shim
  merges the mask itself and stores unmasked.

Both shims compute exactly what the simulator computes for accesses it does support, so they
are harmless where JAX has fixed these. Only tests and CPU dry runs use this module; a real TPU
compiles the kernel with Mosaic and never enters it.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator

import jax
import numpy as np
from jax.experimental.pallas import tpu as pltpu

_install_lock = threading.Lock()


def _bitcast(x: np.ndarray, dtype) -> np.ndarray:
    """Mosaic's ref bitcast in numpy: a width change packs or unpacks the second-minor axis."""
    dtype = np.dtype(dtype)
    src, dst = x.dtype.itemsize, dtype.itemsize
    if src < dst:
        ratio = dst // src
        x = x.reshape(*x.shape[:-2], x.shape[-2] // ratio, ratio, x.shape[-1]).swapaxes(-1, -2)
        return np.ascontiguousarray(x).view(dtype)[..., 0]
    if src > dst:
        y = np.ascontiguousarray(x).view(dtype)  # [..., m, n * ratio]
        y = y.reshape(*x.shape, src // dst).swapaxes(-1, -2)
        return y.reshape(*x.shape[:-2], -1, x.shape[-1])
    return x.view(dtype)


def _reshape_aware_get(original):
    from jax._src.pallas.mosaic.interpret import utils as interpret_utils
    from jax._src.state.types import BitcastTransform, ReshapeTransform

    special = (BitcastTransform, ReshapeTransform)

    @functools.wraps(original)
    def get(token, device_id, local_core_id, memory_space, buffer_id, transforms, *a, **kw):
        transforms = tuple(transforms)
        cut = next((i for i, t in enumerate(transforms) if isinstance(t, special)), None)
        if cut is None:
            return original(token, device_id, local_core_id, memory_space, buffer_id, transforms, *a, **kw)  # fmt: skip
        token, value = get(
            token, device_id, local_core_id, memory_space, buffer_id, transforms[:cut], *a, **kw
        )
        value = np.asarray(value)
        for t in transforms[cut:]:
            if isinstance(t, ReshapeTransform):
                value = value.reshape(t.shape)
            elif isinstance(t, BitcastTransform):
                value = _bitcast(value, t.dtype)
            else:
                value = value[interpret_utils.to_range([jax.tree.map(int, t)])]
        return token, value

    get._jaxpaged_shim = True
    return get


def _merged_mask_swap(original):
    @functools.wraps(original)
    def swap_buffer_content(self, key, rnge, value, mask, global_core_id, *a, **kw):
        if mask is not None:
            current = self.mem[key][rnge]
            if current.shape == value.shape:  # fully in bounds: merge the mask here
                merged = np.where(mask, value, current)
                old, shape_dtype, clock = original(
                    self, key, rnge, merged, None, global_core_id, *a, **kw
                )
                return (None if old is None else np.where(mask, old, value)), shape_dtype, clock
        return original(self, key, rnge, value, mask, global_core_id, *a, **kw)

    swap_buffer_content._jaxpaged_shim = True
    return swap_buffer_content


def install_shims() -> None:
    """Installs both shims into JAX's TPU simulator (idempotent)."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    from jax._src.pallas.mosaic.interpret import shared_memory

    with _install_lock:
        if not getattr(ipc.get, "_jaxpaged_shim", False):
            ipc.get = _reshape_aware_get(ipc.get)
        memory = shared_memory.SharedMemory
        if not getattr(memory.swap_buffer_content, "_jaxpaged_shim", False):
            memory.swap_buffer_content = _merged_mask_swap(memory.swap_buffer_content)


@contextlib.contextmanager
def interpret_mode() -> Iterator[None]:
    """Pallas TPU kernels traced inside run on JAX's TPU simulator (on any backend)."""
    install_shims()
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
        yield
