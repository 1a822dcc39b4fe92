"""The architecture description every family's forward reads (`ModelConfig`), and the
rotary scaling it may carry. Parsing a config.json is the family's own (models/registry.py
finds the family; each family module parses its config)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

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
    # Mixtral's checkpoint: the experts under block_sparse_moe, named w1 (gate), w3 (up) and
    # w2 (down); else under mlp, named gate_proj, up_proj and down_proj (Qwen3-MoE)
    block_sparse_moe: bool = False
    # Phi-3's checkpoint: q, k and v fused in self_attn.qkv_proj, gate and up in
    # mlp.gate_up_proj
    fused_projections: bool = False
    hidden_act: str = "silu"  # the MLP's activation (gpt2: gelu_new, opt: relu)
    position_offset: int = 0  # learned positions: row of position p is p + offset (opt: 2)
    # GPT-2's checkpoint: transformers' Conv1D modules (weights [in, out], q, k and v fused
    # in attn.c_attn) under transformer.h.N; else OPT's nn.Linear under model.decoder.layers.N
    conv1d_weights: bool = False
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
    # Granite's scalars on the Llama layer (models/granite.py); the defaults change nothing
    embedding_multiplier: float = 1.0  # the token embeddings are scaled by it
    residual_multiplier: float = 1.0  # each block's output is scaled by it before the add
    attention_multiplier: float | None = None  # the attention scale (None: head_dim ** -0.5)
    logits_scaling: float = 1.0  # the vocabulary logits are divided by it
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads
