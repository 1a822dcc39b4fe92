"""IBM Granite (3.x; transformers' ``GraniteForCausalLM``): the Llama layer with four
scalars, so the family is a declaration over `models.llama`, not a module of its own.

What transformers' Granite computes differently from Llama, and where it happens here:

- ``embedding_multiplier``: the token embeddings are scaled by it (`LlamaForCausalLM`);
- ``residual_multiplier``: each attention and MLP output is scaled by it before its
  residual add (``blocks.residual_projection``, ``blocks.gated_silu_mlp``);
- ``attention_multiplier``: the attention scale, in place of ``head_dim ** -0.5``, passed to
  the attention kernel as ``sm_scale``;
- ``logits_scaling``: the vocabulary logits are divided by it
  (`LlamaForCausalLM.compute_logits`).

The checkpoint names, the params tree, the linears (their tensor-parallel split, quantization
and CPU packing) and the engine features
(native CPU linears, int8/fp8 weights, pre-quantized checkpoints, LoRA) are the Llama
family's, since the layer is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import llama, llama_layout
from .config import ModelConfig
from .family import ModelFamily


def parse_config(d: Mapping[str, Any]) -> ModelConfig:
    """The ModelConfig of a Granite config.json; ValueError naming an option jaxpaged does
    not run."""
    if d.get("mlp_bias"):
        raise ValueError("unsupported granite option mlp_bias=True (biased MLP projections)")
    fields = llama_layout.config_fields(d)
    return ModelConfig(
        **fields,
        embedding_multiplier=float(d.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(d.get("residual_multiplier", 1.0)),
        attention_multiplier=float(d.get("attention_multiplier", 1.0)),  # transformers' default
        logits_scaling=float(d.get("logits_scaling", 1.0)),
    )


def _refused(config: ModelConfig) -> Mapping[str, str]:
    return {
        **llama.FAMILY.refused(config),
        "gguf_quantized": "jaxpaged imports no Granite GGUF layout",
    }


FAMILY = ModelFamily(
    name="granite",
    architectures=("GraniteForCausalLM",),
    model_types=("granite",),
    parse_config=parse_config,
    module=llama.LlamaForCausalLM,
    param_shapes=llama.param_shapes,
    load_host_params=llama_layout.load_host_params,
    linears=llama.LINEARS,
    refused=_refused,
    lora=llama.lora_layout,
)
