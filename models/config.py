"""Architecture description of a Llama-family model, read from a Hugging Face config.json."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama 3 style frequency scaling (rope_type 'llama3'); other types are rejected."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Everything the forward pass needs to know about the architecture; hashable so it can be
    a static argument of jit."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {self.model_type!r}; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_dict(cls, d: Mapping) -> ModelConfig:
        """Accepts both transformers 4 (`rope_theta`, `rope_scaling`) and 5 (`rope_parameters`)."""
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        num_heads = d["num_attention_heads"]
        hidden = d["hidden_size"]
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None
        if rope_type == "llama3":
            scaling = RopeScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )
        elif rope_type not in ("default", None):
            raise ValueError(f"unsupported rope type {rope_type!r}; supported: default, llama3")
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=hidden,
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=d.get("head_dim") or hidden // num_heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(d.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
        )

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike) -> ModelConfig:
        path = os.path.join(folder, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no config.json in model folder {os.fspath(folder)!r}")
        with open(path) as f:
            return cls.from_hf_dict(json.load(f))
