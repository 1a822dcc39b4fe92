"""The engine's side of multi-LoRA: what it refuses, the adapters it starts with, and how a
request's adapter is named and registered.

Adapters are registered by name (``--lora-modules``, ``LLM.generate(lora_request=...)``, the
HTTP server's ``/v1/load_lora_adapter``) and a request names one; the scheduler puts
adapters into device slots as requests need them (:mod:`jaxpaged.sched.lora_slots`). Files are
read in the caller's thread; the registry changes on the engine thread
(:meth:`EngineCore.add_lora` / :meth:`EngineCore.remove_lora`) between steps.
"""

from __future__ import annotations

from typing import Any

from jaxpaged.config import LoraConfig
from jaxpaged.lora_request import LoRARequest
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.registry import check_feature
from jaxpaged.worker.lora import LoraAdapters

__all__ = ["LoRARequest", "build_adapters", "read_adapter"]


def build_adapters(
    config: LoraConfig,
    model_config: ModelConfig,
    dtype: Any,  # noqa: ANN401 - the params' dtype
    *,
    own_model: bool,
    tensor_parallel_size: int,
    num_hosts: int,
) -> LoraAdapters | None:
    """The device slots and the start-up adapters, or None when LoRA is off. ValueError for
    a model or setting LoRA does not support, or an adapter that does not fit."""
    if not config.enable_lora:
        return None
    if own_model:
        raise ValueError("enable_lora: LoRA is not supported for a model of your own")
    check_feature(model_config, "lora", "enable_lora")
    if tensor_parallel_size > 1:
        raise ValueError("enable_lora: not supported with tensor_parallel_size > 1 yet")
    if num_hosts > 1:
        raise ValueError("enable_lora: not supported on a multi-host engine")
    adapters = LoraAdapters(
        model_config, max_loras=config.max_loras, max_rank=config.max_lora_rank, dtype=dtype
    )
    for name, path in config.modules:
        adapters.register(name, adapters.read(path), path)
    return adapters


def read_adapter(adapters: LoraAdapters | None, request: LoRARequest) -> Any:  # noqa: ANN401
    """The weights of ``request``'s adapter folder (ValueError when LoRA is off or the
    folder does not fit the model)."""
    if adapters is None:
        raise ValueError("a LoRA adapter was given, but LoRA is not enabled (enable_lora=True)")
    if not isinstance(request, LoRARequest):
        raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
    if not request.lora_path:
        raise ValueError(f"LoRA adapter {request.lora_name!r}: no lora_path given")
    return adapters.read(request.lora_path)
