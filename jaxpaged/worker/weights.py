"""Replacement weights for a running engine: what new params must match, and where they go.

A swap must leave the compiled step programs valid, so the new params must have the tree,
the shapes and the dtypes of the ones the engine was built on (any pytree: the check does not
depend on the model's layout). Arrays already on the engine's device, or on its mesh with the
engine's shardings, are used as they are; arrays elsewhere are moved (device to device when
they are on the device already, so nothing goes through the host).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

__all__ = ["ParamsSpec"]


def _path_name(path: tuple[Any, ...]) -> str:
    return jax.tree_util.keystr(path) or "<root>"


def _dtype(x: Any) -> np.dtype:
    return np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype


@dataclasses.dataclass(frozen=True)
class ParamsSpec:
    """The tree, shapes, dtypes and placement of an engine's params as it was built on them
    (before any kernel-specific packing)."""

    treedef: Any  # jax.tree_util.PyTreeDef
    leaves: tuple[jax.ShapeDtypeStruct, ...]
    paths: tuple[str, ...]
    shardings: tuple[jax.sharding.Sharding | None, ...]  # None: the default device

    @classmethod
    def of(cls, params: Any) -> ParamsSpec:
        flat, treedef = jax.tree_util.tree_flatten_with_path(params)
        leaves = tuple(jax.ShapeDtypeStruct(np.shape(x), _dtype(x)) for _, x in flat)
        shardings = tuple(
            x.sharding if isinstance(x, jax.Array) and x.committed else None for _, x in flat
        )
        return cls(treedef, leaves, tuple(_path_name(p) for p, _ in flat), shardings)

    def check(self, params: Any) -> None:
        """ValueError naming the first way ``params`` differ from this spec (tree, shape or
        dtype): such params would need new compiled programs."""
        flat, treedef = jax.tree_util.tree_flatten_with_path(params)
        if treedef != self.treedef:
            have = {_path_name(p) for p, _ in flat}
            want = set(self.paths)
            missing, extra = sorted(want - have), sorted(have - want)
            raise ValueError(
                "params: the tree differs from the engine's"
                + (f"; missing {missing[:5]}" if missing else "")
                + (f"; unexpected {extra[:5]}" if extra else "")
                + ("" if missing or extra else f" (engine: {self.treedef}, given: {treedef})")
            )
        for (path, x), want in zip(flat, self.leaves, strict=True):
            shape = tuple(np.shape(x))
            dtype = _dtype(x)
            if shape != want.shape or dtype != want.dtype:
                raise ValueError(
                    f"params{_path_name(path)}: shape {shape} {dtype}, the engine's is "
                    f"{want.shape} {want.dtype} (a swap keeps every shape and dtype)"
                )

    def place(self, params: Any) -> Any:
        """``params`` (checked) where the engine's were: leaves already there untouched,
        others moved (on-device resharding for arrays on another device or sharding)."""
        flat = jax.tree.leaves(params)
        out = []
        for x, sharding in zip(flat, self.shardings, strict=True):
            if sharding is None:
                default = jax.devices()[0]
                if not isinstance(x, jax.Array):
                    out.append(jax.device_put(x))  # host data: uncommitted, as loaded params
                elif x.sharding.device_set == {default}:
                    out.append(x)
                else:
                    out.append(jax.device_put(x, default))  # device to device
            elif isinstance(x, jax.Array) and x.sharding == sharding:
                out.append(x)
            else:
                # also for an equivalent sharding spelled differently (P("tp") and
                # P("tp", None)): the step's compiled program is keyed on the exact one
                out.append(jax.device_put(x, sharding))
        return jax.tree.unflatten(self.treedef, out)
