"""Architecture description of a Llama-family model, read from a Hugging Face config.json."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping

LLAMA_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen3_moe")
# decoders with learned absolute positions, LayerNorm and a plain MLP (models/gpt.py)
GPT_MODEL_TYPES = ("gpt2", "opt")
# (1 + w) RMSNorms, post norms, soft caps, local and global layers (models/gemma.py)
GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")
# ALiBi attention biases instead of positions, LayerNorms, fused per-head qkv (models/bloom.py)
BLOOM_MODEL_TYPES = ("bloom",)
SUPPORTED_MODEL_TYPES = (
    *LLAMA_MODEL_TYPES,
    *GPT_MODEL_TYPES,
    *GEMMA_MODEL_TYPES,
    *BLOOM_MODEL_TYPES,
)
# the model_type of a model of your own (docs/models.md): never read from a checkpoint
CUSTOM_MODEL_TYPE = "custom"


ROPE_TYPES = ("default", "llama3", "linear", "dynamic", "yarn", "longrope")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Rotary frequency scaling, as transformers' rope init functions of the same
    ``rope_type`` compute it (models/rope.py); the fields a type does not use stay None."""

    rope_type: str = "llama3"
    factor: float
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    original_max_position_embeddings: int | None = None  # llama3, yarn, longrope, dynamic
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn
    short_factor: tuple[float, ...] | None = None  # longrope: per-frequency divisors below
    long_factor: tuple[float, ...] | None = None  # and from original_max_position_embeddings

    @classmethod
    def from_hf_dict(cls, rope: Mapping, max_position_embeddings: int) -> RopeScaling | None:
        """The scaling of a config's ``rope_scaling`` / ``rope_parameters`` (None: plain
        RoPE); ValueError naming a rope type or option jaxpaged does not run."""
        rope_type = rope.get("rope_type", rope.get("type")) or "default"
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"unsupported rope type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
            )
        if rope_type == "default":
            return None
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("unsupported rope option partial_rotary_factor != 1")
        factor = float(rope["factor"]) if rope.get("factor") is not None else None
        old = rope.get("original_max_position_embeddings")
        if rope_type == "llama3":
            return cls(
                factor=factor,
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(old),
            )
        if rope_type == "linear":
            return cls(rope_type="linear", factor=factor)
        if rope_type == "dynamic":  # NTK: the base grows with the length past the context,
            # which transformers takes to be max_position_embeddings (models/rope.py)
            if factor is None:
                raise ValueError("rope type 'dynamic' needs factor")
            return cls(
                rope_type="dynamic",
                factor=factor,
                original_max_position_embeddings=max_position_embeddings,
            )
        if rope_type == "longrope":
            for need, value in (("original_max_position_embeddings", old),
                                ("short_factor", rope.get("short_factor")),
                                ("long_factor", rope.get("long_factor"))):  # fmt: skip
                if value is None:
                    raise ValueError(f"rope type 'longrope' needs {need}")
            return cls(
                rope_type="longrope",
                factor=max_position_embeddings / old if factor is None else factor,
                original_max_position_embeddings=int(old),
                attention_factor=rope.get("attention_factor"),
                short_factor=tuple(float(x) for x in rope["short_factor"]),
                long_factor=tuple(float(x) for x in rope["long_factor"]),
            )
        if old is None:
            raise ValueError("rope type 'yarn' needs original_max_position_embeddings")
        if factor is None:  # as transformers: the ratio of the context lengths
            factor = max_position_embeddings / old
        return cls(
            rope_type="yarn",
            factor=factor,
            original_max_position_embeddings=int(old),
            beta_fast=float(rope.get("beta_fast") or 32),
            beta_slow=float(rope.get("beta_slow") or 1),
            attention_factor=rope.get("attention_factor"),
            mscale=rope.get("mscale"),
            mscale_all_dim=rope.get("mscale_all_dim"),
            truncate=bool(rope.get("truncate", True)),
        )


# MoE families (Qwen3-MoE's count is num_experts, saved by transformers 5 as num_local_experts)
_MOE_MODEL_TYPES = ("mixtral", "qwen3_moe")


def _check_qwen3_moe(d: Mapping) -> None:
    """ValueError naming a Qwen3-MoE option jaxpaged does not run: dense MLP layers among
    the sparse ones."""
    if d.get("decoder_sparse_step", 1) != 1:
        raise ValueError(
            f"unsupported qwen3_moe option decoder_sparse_step={d['decoder_sparse_step']} "
            "(dense MLP layers between the sparse ones); jaxpaged runs 1"
        )
    if d.get("mlp_only_layers"):
        raise ValueError(
            f"unsupported qwen3_moe option mlp_only_layers={list(d['mlp_only_layers'])} "
            "(dense MLP layers); jaxpaged runs []"
        )


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
    sliding_window: int | None = None  # Mistral, Phi-3: every layer sees the last W positions
    num_experts: int = 0  # Mixtral: MoE MLPs of this many experts (0: one dense MLP)
    num_experts_per_tok: int = 0  # the top-k experts each token is routed to
    norm_topk_prob: bool = True  # renormalize the top-k routing weights to sum to 1
    hidden_act: str = "silu"  # the MLP's activation (gpt2: gelu_new, opt: relu)
    position_offset: int = 0  # learned positions: row of position p is p + offset (opt: 2)
    # Gemma: each layer's "sliding_attention" (window sliding_window) or "full_attention"
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None  # Gemma 3: the rope base of the sliding layers
    query_pre_attn_scalar: float | None = None  # Gemma: attention scale is its ** -0.5
    attn_soft_cap: float | None = None  # Gemma 2: cap * tanh(logit / cap) on attention logits
    final_soft_cap: float | None = None  # Gemma 2: the same on the vocabulary logits
    # BLOOM: ALiBi biases (layers.alibi_slopes) on the attention logits, no position encoding
    alibi: bool = False
    # BLOOM's apply_residual_connection_post_layernorm: residuals taken after the norms
    residual_post_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.model_type not in (*SUPPORTED_MODEL_TYPES, CUSTOM_MODEL_TYPE):
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
        if model_type == "gemma3":
            raise ValueError(
                "unsupported model_type 'gemma3' (Gemma3ForConditionalGeneration, with a vision "
                "tower); jaxpaged runs the text-only gemma3_text (Gemma3ForCausalLM)"
            )
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if model_type in GPT_MODEL_TYPES:
            from .gpt import gpt_config_fields

            return cls(**gpt_config_fields(d))
        if model_type in GEMMA_MODEL_TYPES:
            from .gemma import gemma_config_fields

            return cls(**gemma_config_fields(d))
        if model_type in BLOOM_MODEL_TYPES:
            from .bloom import bloom_config_fields

            return cls(**bloom_config_fields(d))
        num_heads = d["num_attention_heads"]
        hidden = d["hidden_size"]
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if "original_max_position_embeddings" in d:  # Phi-3 keeps it beside rope_scaling
            rope = {
                "original_max_position_embeddings": d["original_max_position_embeddings"],
                **rope,
            }
        rope_theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
        max_pos = d.get("max_position_embeddings", 2048)
        windowed = ("mistral", "phi3", "mixtral")
        window = d.get("sliding_window") if model_type in windowed else None
        if d.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"unsupported {model_type} option partial_rotary_factor != 1")
        if model_type in ("qwen2", "qwen3", "qwen3_moe") and d.get("use_sliding_window"):
            raise ValueError(
                f"unsupported {model_type} option use_sliding_window=True (sliding window "
                "attention on the layers from max_window_layers on)"
            )
        if model_type == "qwen3_moe":
            _check_qwen3_moe(d)
        scaling = RopeScaling.from_hf_dict(rope, max_pos)
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=hidden,
            intermediate_size=d[
                "moe_intermediate_size" if model_type == "qwen3_moe" else "intermediate_size"
            ],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=d.get("head_dim") or hidden // num_heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(d.get("attention_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            sliding_window=int(window) if window else None,
            num_experts=int(d.get("num_local_experts") or d.get("num_experts") or 0)
            if model_type in _MOE_MODEL_TYPES
            else 0,
            num_experts_per_tok=int(d.get("num_experts_per_tok") or 0),
            # Mixtral always renormalizes; Qwen3-MoE as its config says (transformers: False)
            norm_topk_prob=model_type == "mixtral" or bool(d.get("norm_topk_prob", False)),
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
