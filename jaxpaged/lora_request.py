"""LoRARequest: which LoRA adapter a request runs with (vLLM's class of the same name)."""

from __future__ import annotations

import dataclasses

__all__ = ["LoRARequest"]


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """An adapter a request runs with (vLLM's ``LoRARequest(lora_name, lora_int_id,
    lora_path)``): registered under ``lora_name`` on first use, loaded from ``lora_path``
    (a PEFT folder: adapter_config.json + adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("LoRARequest: lora_name must not be empty")
        if self.lora_int_id < 1:
            raise ValueError(f"LoRARequest: lora_int_id must be >= 1, got {self.lora_int_id}")
