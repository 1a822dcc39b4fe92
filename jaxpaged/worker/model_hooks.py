"""The model class's hooks for the platform's layer implementation: which matmul weights a
native kernel may repack (``map_matmul_weights``), which weights every step streams
(``streamed_weights``) and the graph definition of packed params (``graphdef_for``). A model
without them keeps XLA's dots, its weights as loaded and its own graph definition."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from jaxpaged.models.config import ModelConfig
from jaxpaged.models.registry import family_of

__all__ = ["ModelHooks"]


@dataclasses.dataclass(frozen=True)
class ModelHooks:
    model_config: ModelConfig
    model_class: type

    @classmethod
    def of(
        cls, model_config: ModelConfig, params: Any, graphdef: nnx.GraphDef | None
    ) -> ModelHooks:
        """The hooks of a jaxpaged family (``graphdef`` None) or of the model ``graphdef``
        describes."""
        model_class = (
            family_of(model_config).module
            if graphdef is None
            else type(nnx.merge(graphdef, params))
        )
        return cls(model_config, model_class)

    def weight_map(self, params: Any, fn: Callable[[jax.Array], jax.Array]) -> Any:
        """``params`` with ``fn`` applied to every matmul weight's ``[L', out, in]`` view (the
        platform's WeightMap); the params as they are where the model declares none."""
        mapper = getattr(self.model_class, "map_matmul_weights", None)
        return params if mapper is None else mapper(params, self.model_config, fn)

    def streamed(self, params: Any) -> list[jax.Array]:
        """The arrays every step reads whole (what huge pages back)."""
        return getattr(self.model_class, "streamed_weights", jax.tree.leaves)(params)

    def graphdef_for(self, params: Any, graphdef: nnx.GraphDef | None) -> nnx.GraphDef:
        """The graph definition of ``params`` as packed (packing may add a leaf: the tied
        vocabulary projection's own packed copy)."""
        graph_for = getattr(self.model_class, "graphdef_for", None)
        return graphdef if graph_for is None else graph_for(self.model_config, params)
