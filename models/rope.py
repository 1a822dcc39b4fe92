"""Rotary position frequencies: default, and the scalings transformers implements as
functions of the config (llama3, linear, yarn), of the position (longrope) or of the length
of the sequence a forward sees (dynamic).

Computed on the host in float64 and rounded once (as transformers rounds its float32
arange-based frequencies), so they are compile-time constants of the step; only dynamic's
are computed in the step, per token, from each token's sequence length.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Per-pair rotary frequencies [head_dim // 2] (float32), scaled as the config says."""
    dim = config.head_dim
    exponents = np.arange(0, dim, 2, dtype=np.float64) / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    inv_freq = inv_freq.astype(np.float32).astype(np.float64)  # HF rounds to float32 here
    s = config.rope_scaling
    if s is None or s.rope_type == "dynamic":  # dynamic: the plain ones up to the context
        return inv_freq.astype(np.float32)
    if s.rope_type == "linear":
        return (inv_freq / s.factor).astype(np.float32)
    if s.rope_type == "yarn":
        return _yarn_inv_freq(config, exponents)
    if s.rope_type == "longrope":  # the short factors; rope_inv_freq_at picks per position
        return _longrope_inv_freq(config, exponents, s.short_factor)
    return _llama3_inv_freq(config, inv_freq)


def rope_inv_freq_at(
    config: ModelConfig,
    positions: jax.Array,  # int32 [T]
    seq_lens: jax.Array | None = None,  # int32 [T]: each token's sequence length (dynamic)
) -> np.ndarray | jax.Array:  # [hd // 2], or [T, hd // 2] where it depends on the token
    """The frequencies each position rotates by. longrope depends on the position: the
    long factors from original_max_position_embeddings on, as transformers' decode steps do
    (its prefill takes the long ones for every prompt token once the prompt crosses that
    length; a paged engine's rows keep each token's own). dynamic depends on ``seq_lens``,
    the length of the token's sequence once this forward has run (None: every token's is
    ``max(positions) + 1``, one sequence, as transformers takes it)."""
    s = config.rope_scaling
    if s is not None and s.rope_type == "dynamic":
        if seq_lens is None:
            seq_lens = jnp.broadcast_to(jnp.max(positions) + 1, positions.shape)
        return dynamic_ntk_inv_freq(config, seq_lens)
    if s is None or s.rope_type != "longrope":
        return rope_inv_freq(config)
    exponents = np.arange(0, config.head_dim, 2, dtype=np.float64) / config.head_dim
    short = rope_inv_freq(config)
    long = _longrope_inv_freq(config, exponents, s.long_factor)
    beyond = positions[:, None] >= s.original_max_position_embeddings
    return jnp.where(beyond, jnp.asarray(long)[None], jnp.asarray(short)[None])


def dynamic_ntk_inv_freq(
    config: ModelConfig,
    seq_lens: jax.Array,  # int32 [T]
) -> jax.Array:  # float32 [T, hd // 2]
    """Dynamic NTK scaling, as transformers' ``_compute_dynamic_ntk_parameters`` computes it
    (float32): up to the context length L0 (original_max_position_embeddings, which
    transformers takes from max_position_embeddings) the plain frequencies; past it, for a
    sequence of length S, base * (factor * S / L0 - (factor - 1)) ** (hd / (hd - 2)) as
    the base."""
    s = config.rope_scaling
    dim, old = config.head_dim, s.original_max_position_embeddings
    length = jnp.maximum(seq_lens, old).astype(jnp.float32)
    grown = (jnp.float32(s.factor) * length / jnp.float32(old) - jnp.float32(s.factor - 1)) ** (
        dim / (dim - 2)
    )
    base = jnp.float32(config.rope_theta) * grown  # [T]
    exponents = jnp.arange(0, dim, 2, dtype=jnp.float32) / jnp.float32(dim)
    scaled = 1.0 / (base[:, None] ** exponents[None, :])
    plain = jnp.asarray(rope_inv_freq(config))[None, :]
    return jnp.where((seq_lens > old)[:, None], scaled, plain)


def _longrope_inv_freq(
    config: ModelConfig, exponents: np.ndarray, factors: tuple[float, ...] | None
) -> np.ndarray:
    if factors is None or len(factors) != config.head_dim // 2:
        raise ValueError(
            f"longrope short_factor and long_factor need head_dim // 2 = "
            f"{config.head_dim // 2} entries each"
        )
    powers = (config.rope_theta**exponents).astype(np.float32).astype(np.float64)
    return (1.0 / (np.asarray(factors, np.float32).astype(np.float64) * powers)).astype(np.float32)


def rope_attention_factor(config: ModelConfig) -> float:
    """What transformers multiplies cos and sin by (yarn's and longrope's attention
    temperature; 1 else)."""
    s = config.rope_scaling
    if s is not None and s.rope_type == "longrope":
        if s.attention_factor is not None:
            return float(s.attention_factor)
        old = s.original_max_position_embeddings
        return 1.0 if s.factor <= 1 else math.sqrt(1 + math.log(s.factor) / math.log(old))
    if s is None or s.rope_type != "yarn":
        return 1.0
    if s.attention_factor is not None:
        return float(s.attention_factor)
    if s.mscale and s.mscale_all_dim:
        return _yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim)
    return _yarn_mscale(s.factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _llama3_inv_freq(config: ModelConfig, inv_freq: np.ndarray) -> np.ndarray:
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
    s = config.rope_scaling
    old_len = s.original_max_position_embeddings
    low_wavelen = old_len / s.low_freq_factor
    high_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_inv_freq(config: ModelConfig, exponents: np.ndarray) -> np.ndarray:
    """YaRN: interpolate (divide by factor) the low frequencies, keep the high ones, with a
    linear ramp over the dimensions between beta_slow and beta_fast rotations."""
    s = config.rope_scaling
    dim, base = config.head_dim, config.rope_theta
    pos_freqs = (base**exponents).astype(np.float32).astype(np.float64)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (s.factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        old = s.original_max_position_embeddings
        return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoids a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp.astype(np.float64)  # 1: extrapolate (keep), 0: interpolate
    return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)
