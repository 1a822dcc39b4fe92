"""LoRA adapters of the Llama family: PEFT's saved format read into jaxpaged's layout, and the
low-rank term each projection adds after its base matmul.

An adapter is a folder of ``adapter_config.json`` and ``adapter_model.safetensors`` (PEFT's
``save_pretrained``). Its weights become one (A, B) pair per *site* of the decoder layer, the
places where `models.llama._layer` calls ``linear_fn``:

    site   PEFT modules              A [L, r', in]     B [L, out, r'] (scale folded in)
    qkv    q_proj, k_proj, v_proj    [L, 3r, D]        [L, Hkv*(G+2)*hd, 3r]  (the fused wqkv rows)
    o      o_proj                    [L, r, Hq*hd]     [L, D, r]
    gate   gate_proj                 [L, r, D]         [L, F, r]
    up     up_proj                   [L, r, D]         [L, F, r]
    down   down_proj                 [L, r, F]         [L, D, r]

q, k and v keep their own A: the three are stacked on the rank axis and B is block-diagonal in
the fused row layout, so one product serves the fused projection. Ranks below the engine's
``max_lora_rank`` are zero-padded; modules an adapter does not target are zero.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig
from .layers import rms_norm

__all__ = [
    "LORA_MODULES",
    "LoraInputs",
    "LoraWeights",
    "lora_delta",
    "load_peft_adapter",
    "site_shapes",
]

# PEFT target-module names of the Llama family -> the site that carries them
LORA_MODULES: dict[str, str] = {
    "q_proj": "qkv",
    "k_proj": "qkv",
    "v_proj": "qkv",
    "o_proj": "o",
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
}
SITES: tuple[str, ...] = ("qkv", "o", "gate", "up", "down")
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)


def site_shapes(config: ModelConfig, max_rank: int) -> dict[str, tuple[tuple, tuple]]:
    """(A shape, B shape) of every site, per layer: A [r', in], B [out, r']."""
    c = config
    d, f, hd = c.hidden_size, c.intermediate_size, c.head_dim
    qkv_out = c.num_kv_heads * (c.queries_per_kv + 2) * hd
    r = max_rank
    return {
        "qkv": ((3 * r, d), (qkv_out, 3 * r)),
        "o": ((r, c.num_heads * hd), (d, r)),
        "gate": ((r, d), (f, r)),
        "up": ((r, d), (f, r)),
        "down": ((r, f), (d, r)),
    }


class LoraWeights(NamedTuple):
    """One adapter on the host in the layout above: site -> (A [L, r', in], B [L, out, r'])."""

    rank: int
    sites: dict[str, tuple[np.ndarray, np.ndarray]]


def _check_config(cfg: dict[str, Any], path: str, max_rank: int) -> tuple[int, float, set[str]]:
    """(rank, scale, target modules) of a PEFT LoRA config; ValueError naming what jaxpaged
    does not support."""
    where = f"LoRA adapter {path}"
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {cfg.get('peft_type')!r} is not LORA")
    refused = []
    if cfg.get("use_dora"):
        refused.append("use_dora")
    if cfg.get("modules_to_save"):
        refused.append(f"modules_to_save={cfg['modules_to_save']}")
    if cfg.get("bias", "none") != "none":
        refused.append(f"bias={cfg['bias']!r}")
    if cfg.get("fan_in_fan_out"):
        refused.append("fan_in_fan_out")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            refused.append(key)
    for key in ("layers_to_transform", "layers_pattern", "layer_replication", "megatron_config"):
        if cfg.get(key) is not None:
            refused.append(key)
    targets = cfg.get("target_modules")
    if targets == "all-linear":
        targets = list(LORA_MODULES)
    if not isinstance(targets, list):
        refused.append(f"target_modules={targets!r} (give a list of module names)")
        targets = []
    unknown = sorted(set(targets) - set(LORA_MODULES))
    if unknown:
        refused.append(f"target modules {unknown} (supported: {', '.join(LORA_MODULES)})")
    if refused:
        raise ValueError(f"{where}: not supported by jaxpaged: {'; '.join(refused)}")
    rank = int(cfg["r"])
    if not 1 <= rank <= max_rank:
        raise ValueError(f"{where}: rank {rank} is over max_lora_rank={max_rank}")
    alpha = float(cfg.get("lora_alpha", rank))
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return rank, scale, set(targets)


def load_peft_adapter(
    path: str | os.PathLike[str], config: ModelConfig, *, max_rank: int, dtype: Any
) -> LoraWeights:
    """An adapter folder saved by PEFT, in the layout above (``dtype`` as the base
    weights); ValueError naming the first problem (an unsupported option, a module or
    shape that does not fit the model, a rank over ``max_rank``)."""
    from safetensors.numpy import load_file

    path = os.fspath(path)
    cfg_file = os.path.join(path, "adapter_config.json")
    weights_file = os.path.join(path, "adapter_model.safetensors")
    for f in (cfg_file, weights_file):
        if not os.path.isfile(f):
            raise ValueError(f"LoRA adapter {path}: {os.path.basename(f)} not found")
    with open(cfg_file) as fh:
        rank, scale, targets = _check_config(json.load(fh), path, max_rank)
    c = config
    n, g, hd, hkv = c.num_layers, c.queries_per_kv, c.head_dim, c.num_kv_heads
    per_module: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, value in load_file(weights_file).items():
        m = _KEY.match(key)
        if m is None or m.group(2) not in targets or int(m.group(1)) >= n:
            raise ValueError(f"LoRA adapter {path}: unsupported tensor {key!r}")
        per_module.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = value
    out = {
        site: (np.zeros((n, *a), np.float32), np.zeros((n, *b), np.float32))
        for site, (a, b) in site_shapes(c, max_rank).items()
    }
    want_in = {"q_proj": c.hidden_size, "k_proj": c.hidden_size, "v_proj": c.hidden_size,
               "o_proj": c.num_heads * hd, "gate_proj": c.hidden_size,
               "up_proj": c.hidden_size, "down_proj": c.intermediate_size}  # fmt: skip
    want_out = {"q_proj": c.num_heads * hd, "k_proj": hkv * hd, "v_proj": hkv * hd,
                "o_proj": c.hidden_size, "gate_proj": c.intermediate_size,
                "up_proj": c.intermediate_size, "down_proj": c.hidden_size}  # fmt: skip
    for (layer, module), pair in sorted(per_module.items()):
        a, b = pair.get("A"), pair.get("B")
        if a is None or b is None:
            raise ValueError(f"LoRA adapter {path}: layer {layer} {module} lacks lora_A or lora_B")
        if a.shape != (rank, want_in[module]) or b.shape != (want_out[module], rank):
            raise ValueError(
                f"LoRA adapter {path}: layer {layer} {module} has A {a.shape}, B {b.shape}; "
                f"the model needs A ({rank}, {want_in[module]}), B ({want_out[module]}, {rank})"
            )
        a = a.astype(np.float32)
        b = b.astype(np.float32) * scale
        site = LORA_MODULES[module]
        sa, sb = out[site]
        if site != "qkv":
            sa[layer, :rank] = a
            sb[layer, :, :rank] = b
            continue
        part = ("q_proj", "k_proj", "v_proj").index(module)
        cols = slice(part * max_rank, part * max_rank + rank)
        sa[layer, cols] = a
        fused = sb[layer].reshape(hkv, g + 2, hd, 3 * max_rank)  # a view: the fused rows
        if module == "q_proj":
            fused[:, :g, :, cols] = b.reshape(hkv, g, hd, rank)
        else:
            fused[:, g + part - 1, :, cols] = b.reshape(hkv, hd, rank)
    sites = {s: (a.astype(dtype), b.astype(dtype)) for s, (a, b) in out.items()}
    return LoraWeights(rank=rank, sites=sites)


class LoraInputs(NamedTuple):
    """What a LoRA-enabled forward reads: every slot's adapters and each token's slot."""

    # site -> (A [L, S, r', in], B [L, S, out, r']); slot 0 is zeros (no adapter)
    weights: dict[str, tuple[jax.Array, jax.Array]]
    slots: jax.Array  # int32 [T]: the adapter slot of each token, 0 = none
    active: jax.Array  # bool []: whether any token has an adapter (else the term is skipped)


def lora_delta(
    x: jax.Array,  # [T, in]: as the site's base linear_fn call receives it
    lora: LoraInputs,
    site: str,
    layer: jax.Array | int,  # int32 []
    *,
    norm: Any = None,  # models.llama.RMSNorm (weight [in], eps), as given to linear_fn
    silu_gate: jax.Array | None = None,  # [T, in]
) -> jax.Array:  # [T, out]
    """Each token's adapter term ``B[slot] @ A[slot] @ h`` with h = norm(silu(silu_gate) *
    x), the input of the base matmul (recomputed: linear_fn may fuse it into the matmul),
    for the whole batch at once: h against every slot's A, masked to the token's own slot,
    then one product with all B (exact: the other slots contribute zeros). Nothing of it
    runs (zeros) when no token has an adapter, so requests without one pay little."""
    a_all, b_all = lora.weights[site]
    a, b = a_all[layer], b_all[layer]  # [S, r', in], [S, out, r']
    num_slots = a.shape[0]

    def term(_):
        h = x if silu_gate is None else jax.nn.silu(silu_gate) * x
        if norm is not None:
            h = rms_norm(h, norm.weight, norm.eps)
        xa = jnp.einsum("ti,sri->tsr", h, a, preferred_element_type=jnp.float32)
        mine = lora.slots[:, None] == jnp.arange(num_slots, dtype=jnp.int32)[None]  # [T, S]
        xa = jnp.where(mine[:, :, None], xa, 0.0).astype(x.dtype)
        return jnp.einsum("tsr,sor->to", xa, b, preferred_element_type=jnp.float32).astype(x.dtype)

    def none(_):
        return jnp.zeros((x.shape[0], b.shape[1]), x.dtype)

    return jax.lax.cond(lora.active, term, none, None)
