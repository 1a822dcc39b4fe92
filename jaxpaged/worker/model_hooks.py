"""What the platform's layer implementation needs of a model, paired with the model once:
its linears (the family's `Linear` declarations, models/linear.py) for the weight map a
native matmul repacks (``weight_map``), the weights every step streams (``streamed``) and
the graph definition of packed params (``graphdef_for``). The model files declare linears
and nothing platform-specific; the generic maps of models/linear.py do the rest. A model of
your own declares no linears: it keeps XLA's dots, its weights as loaded and its own graph
definition."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from jaxpaged.models.config import ModelConfig
from jaxpaged.models.linear import Linear, map_matmul_weights, streamed_weights
from jaxpaged.models.registry import declared_family, family_of

__all__ = ["ModelHooks"]


@dataclasses.dataclass(frozen=True)
class ModelHooks:
    model_config: ModelConfig
    model_class: type
    linears: tuple[Linear, ...] = ()  # the family's matmul weights (empty: XLA's dots)

    @classmethod
    def of(
        cls, model_config: ModelConfig, params: Any, graphdef: nnx.GraphDef | None
    ) -> ModelHooks:
        """The hooks of a jaxpaged family (``graphdef`` None, or a graph of its module) or
        of the model of your own ``graphdef`` describes."""
        model_class = (
            family_of(model_config).module
            if graphdef is None
            else type(nnx.merge(graphdef, params))
        )
        family = declared_family(model_config)
        return cls(model_config, model_class, () if family is None else tuple(family.linears))

    def weight_map(self, params: Any, fn: Callable[[jax.Array], jax.Array]) -> Any:
        """``params`` with ``fn`` applied to every declared linear's ``[L', out, in]`` view
        and the vocabulary projection (the platform's WeightMap); the params as they are
        where the model declares no linears."""
        return map_matmul_weights(params, self.linears, fn) if self.linears else params

    def streamed(self, params: Any) -> list[jax.Array]:
        """The arrays every step reads whole (what huge pages back)."""
        return streamed_weights(params) if self.linears else jax.tree.leaves(params)

    def graphdef_for(self, params: Any, graphdef: nnx.GraphDef | None) -> nnx.GraphDef:
        """The graph definition of ``params`` as packed (packing may add a leaf: the tied
        vocabulary projection's own packed copy)."""
        graph_for = getattr(self.model_class, "graphdef_for", None)
        return graphdef if graph_for is None else graph_for(self.model_config, params)
