"""Which NNX module class serves a config's model_type."""

from __future__ import annotations

from .config import BLOOM_MODEL_TYPES, GEMMA_MODEL_TYPES, GPT_MODEL_TYPES, ModelConfig


def family_class(config: ModelConfig) -> type:
    """The module class of a jaxpaged family (ValueError for a model of your own)."""
    if config.model_type in GPT_MODEL_TYPES:
        from .gpt import GPTForCausalLM

        return GPTForCausalLM
    if config.model_type in GEMMA_MODEL_TYPES:
        from .gemma import GemmaForCausalLM

        return GemmaForCausalLM
    if config.model_type in BLOOM_MODEL_TYPES:
        from .bloom import BloomForCausalLM

        return BloomForCausalLM
    if config.model_type == "custom":
        raise ValueError("a model_type 'custom' config comes with its own module (LLM.from_model)")
    from .llama import LlamaForCausalLM

    return LlamaForCausalLM


def family_param_shapes(config: ModelConfig) -> dict:
    """The shape of every leaf of a jaxpaged family's state (its params tree)."""
    if config.model_type in GPT_MODEL_TYPES:
        from .gpt import param_shapes

        return param_shapes(config)
    if config.model_type in GEMMA_MODEL_TYPES:
        from .gemma import param_shapes as gemma_shapes

        return gemma_shapes(config)
    if config.model_type in BLOOM_MODEL_TYPES:
        from .bloom import param_shapes as bloom_shapes

        return bloom_shapes(config)
    from .llama import param_shapes

    return param_shapes(config)
