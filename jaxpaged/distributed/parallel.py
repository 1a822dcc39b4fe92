"""Tensor parallelism on JAX's own machinery: a 1-D device ``Mesh`` (axis ``"tp"``), a
``NamedSharding`` per params leaf and for the KV pool, and ``shard_map`` around the attention
kernels. Everything else in the step (projections, MLP, logits, sampling) is plain jnp that
GSPMD partitions from the weights' shardings, inserting the all-reduces itself.

Megatron split (N = tensor_parallel_size), over the params layout of ``models.llama``
(Gemma's is the same, with its extra norms replicated; ``models.bloom`` stores its attention
in the same fused layout, one query per KV head):

==============  =========================  ===========================================
leaf            shape                      split
==============  =========================  ===========================================
wqkv            [L, Hkv, G+2, hd, D]       KV heads (column-parallel: each device
bqkv            [L, Hkv, G+2, hd]          computes q/k/v of its own KV heads)
wo              [L, D, Hkv, G, hd]         KV heads (row-parallel: partial sums of the
                                           output projection, one all-reduce per layer)
w_gate_up       [L, 2, F, D]               F (column-parallel)
w_down          [L, D, F]                  F (row-parallel: one all-reduce per layer)
w_experts_*     [L, E, 2, F, D], [L, E,    F of every expert (see below)
                D, F]
w_fc, b_fc      [L, F, D], [L, F]          F (BLOOM's plain MLP: column-parallel)
w_proj          [L, D, F]                  F (row-parallel)
embed           [V, D]                     V when N divides V, else replicated
lm_head         [V, D]                     V when N divides V, else replicated
norms, router   [L, D], [D], [L, E, D]     replicated
KV pool k, v    [L*NB, bs, Hkv, hd]        KV heads (an 8-bit pool's scales
                                           [L*NB, bs, Hkv] alike)
==============  =========================  ===========================================

GPT-2 / OPT (``models.gpt``, Hkv = Hq): wqkv [L, 3, Hq*hd, D] and bqkv [L, 3, Hq*hd] split
over Hq*hd (whole heads, as hd divides each slice), wo [L, D, Hq*hd] over Hq*hd, w_fc [L, F, D]
and b_fc [L, F] over F, w_proj [L, D, F] over F; the row-parallel layers' biases (bo, b_proj),
the LayerNorms and the learned positions are replicated. The program is the unsplit model's
and GSPMD keeps its meaning: a replicated bias is added once, after the all-reduce of the
partial sums, not once per device.

Mixture-of-Experts: every expert's intermediate dimension F is split as a dense MLP's
(column-parallel gate/up, row-parallel down), and the router is replicated. Each device then
holds 1/N of every expert and computes every token's routing itself, so the routed sum needs
exactly the one all-reduce a dense MLP needs, any N that divides F works whatever the number
of experts, and the MoE code is the single-device code. Placing whole experts per device
would need E % N == 0 and buy nothing here: the forward runs every expert on every token
(``models.llama._moe_mlp``), so there is no token dispatch for expert placement to save.

Logits [S, V] are gathered to every device before sampling, so the sampler sees the full
vocabulary and returns the same token on every device (a few KB per step).

KV-head replication. Attention needs whole KV heads on a device. When N > Hkv (N a multiple
of Hkv), each KV head is replicated r = N / Hkv times and its G query heads are split among
the replicas (G / r each): the config becomes ``num_kv_heads = N``, the k/v columns of wqkv
(and bqkv) are copied r times, wo is only reshaped (query-head order is unchanged). The cost:
the KV pool holds r copies of every head, so a token's cache takes r times the memory of the
unreplicated model (each device still stores exactly one KV head, i.e. 1/Hkv of an
unsplit pool instead of 1/N), and the k/v projection weights grow by the same factor (small:
2 * D * hd per extra head per layer). The results are identical: every query head reads the
same K/V values it would read without replication.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpaged.models.config import ModelConfig
from jaxpaged.models.loader import scales_sharding
from jaxpaged.models.quant import GroupedWeight, QuantizedWeight
from jaxpaged.models.quant.grouped import grouped_sharding_tree
from jaxpaged.models.registry import check_feature, family_of
from jaxpaged.models.types import TP_AXIS, Params

AXIS = TP_AXIS  # the axis the families' partition metadata names

# Each family's module declares the axis of each leaf that is split over the mesh where it
# creates the leaf's nnx.Param (its partition metadata, `split_axes`); vocabulary-sized
# leaves are split only when N divides V (see `leaf_spec`).
_VOCAB_LEAVES = ("embed", "lm_head")
# the pool arrays' split: the KV-head axis (trailing axes unnamed, so replicated whole)
_POOL_SPEC = P(None, None, AXIS)


# ------------------------------------------------------------------------------- mesh


def make_mesh(tensor_parallel_size: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh (axis ``"tp"``) over the first N devices (all processes' devices when
    ``jax.distributed`` is initialized, so one mesh can span several hosts)."""
    n = tensor_parallel_size
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"tensor_parallel_size must be an int >= 1, got {n!r}")
    devices = list(jax.devices() if devices is None else devices)
    if n > len(devices):
        raise ValueError(
            f"tensor_parallel_size={n} exceeds the {len(devices)} available "
            f"{devices[0].platform if devices else ''} device(s); on CPU, simulate more with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n}"
        )
    return Mesh(np.asarray(devices[:n]), (AXIS,))


def mesh_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape[AXIS]


# ------------------------------------------------------------------------ validation


def kv_replication(config: ModelConfig, tensor_parallel_size: int) -> int:
    """How many copies of each KV head N devices need (1 = plain split); ValueError naming
    the config field when N cannot split the model."""
    n, c = tensor_parallel_size, config
    if n > 1:
        check_feature(c, "tensor_parallel", f"tensor_parallel_size={n}")
    if c.num_heads % n:
        raise ValueError(f"tensor_parallel_size={n} must divide num_attention_heads={c.num_heads}")
    if c.intermediate_size % n:
        raise ValueError(
            f"tensor_parallel_size={n} must divide intermediate_size={c.intermediate_size}"
        )
    if c.num_kv_heads % n == 0:
        return 1
    if n % c.num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size={n} must divide num_key_value_heads={c.num_kv_heads} or be "
            "a multiple of it (then each KV head is replicated N / num_key_value_heads times)"
        )
    return n // c.num_kv_heads  # divides G, because N divides num_heads = Hkv * G


def tp_config(config: ModelConfig, tensor_parallel_size: int) -> ModelConfig:
    """The config the sharded model runs with (num_kv_heads raised when heads are replicated)."""
    r = kv_replication(config, tensor_parallel_size)
    if r == 1:
        return config
    return dataclasses.replace(config, num_kv_heads=config.num_kv_heads * r)


def replicate_kv_heads(
    config: ModelConfig, host: Mapping[str, Any], tensor_parallel_size: int
) -> tuple[ModelConfig, dict[str, Any]]:
    """Rewrite host (numpy) params so N devices each get whole KV heads (module docstring).
    Returns (new config, new params); a no-op when no replication is needed."""
    r = kv_replication(config, tensor_parallel_size)
    params = dict(host)
    if r == 1:
        return config, params
    g, hkv = config.queries_per_kv, config.num_kv_heads
    gr = g // r
    layers = dict(params["layers"])

    def split_qkv(w: np.ndarray, head_axis: int) -> np.ndarray:
        # [..., Hkv, G + 2, hd, ...] -> [..., Hkv * r, G / r + 2, hd, ...]
        if isinstance(w, QuantizedWeight):  # scales [L, Hkv, G + 2, hd, 1] split alike
            return QuantizedWeight(split_qkv(w.values, head_axis), split_qkv(w.scales, head_axis))
        if isinstance(w, GroupedWeight):  # K = D is the last axis: heads are leading axes
            mins = None if w.mins is None else split_qkv(w.mins, head_axis)
            values = split_qkv(w.values, head_axis)
            shape = (*values.shape[:-1], w.shape[-1])
            return GroupedWeight(  # an act-order g_idx [L, 1, 1, 1, K] is shared by all rows
                values, split_qkv(w.scales, head_axis), mins, shape, w.group_size, w.bits, w.g_idx
            )
        w = np.asarray(w)
        w = np.moveaxis(w, (head_axis, head_axis + 1), (0, 1))  # [Hkv, G + 2, *rest]
        rest = w.shape[2:]
        q = w[:, :g].reshape(hkv, r, gr, *rest)
        kv = np.broadcast_to(w[:, None, g:], (hkv, r, 2, *rest))
        out = np.concatenate([q, kv], axis=2).reshape(hkv * r, gr + 2, *rest)
        return np.ascontiguousarray(np.moveaxis(out, (0, 1), (head_axis, head_axis + 1)))

    layers["wqkv"] = split_qkv(layers["wqkv"], 1)  # [L, Hkv, G + 2, hd, D]
    if "bqkv" in layers:
        layers["bqkv"] = split_qkv(layers["bqkv"], 1)  # [L, Hkv, G + 2, hd]
    wo = layers["wo"]  # [L, D, Hkv, G, hd]; query-head order is unchanged
    wo = wo if isinstance(wo, QuantizedWeight | GroupedWeight) else np.asarray(wo)
    layers["wo"] = wo.reshape(*wo.shape[:2], hkv * r, gr, wo.shape[4])
    params["layers"] = layers
    return tp_config(config, tensor_parallel_size), params


# ------------------------------------------------------------------------- shardings


def split_axes(config: ModelConfig) -> dict[str, int]:
    """Leaf path ("layers/wqkv") -> the axis N devices split (leaves absent are replicated),
    as ``config``'s family module declares it: the partition metadata of each nnx.Param
    (``nnx.get_partition_spec`` of the module's abstract state, built with its own
    vocabulary projection, which int8 weights add even when tied)."""
    family = family_of(config)
    model = nnx.eval_shape(lambda: family.module(config, lm_head=True))
    specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(model)))
    axes: dict[str, int] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, Mapping):
            for k, v in node.items():
                walk(v, f"{prefix}/{k}" if prefix else str(k))
        elif isinstance(node, P) and AXIS in tuple(node):
            axes[prefix] = tuple(node).index(AXIS)

    walk(specs, "")
    return axes


def leaf_spec(
    path: str, shape: tuple[int, ...], tensor_parallel_size: int, axes: Mapping[str, int]
) -> P:
    """PartitionSpec of one params leaf ("layers/wqkv", ...) for N devices, given its
    family's `split_axes`."""
    axis = axes.get(path)
    if axis is None or tensor_parallel_size == 1:
        return P()
    if shape[axis] % tensor_parallel_size:
        if path in _VOCAB_LEAVES:
            return P()  # vocabulary not divisible by N: replicate
        raise ValueError(
            f"params leaf {path!r} of shape {shape}: axis {axis} ({shape[axis]}) is not "
            f"divisible by tensor_parallel_size={tensor_parallel_size}"
        )
    return P(*([None] * axis), AXIS)


def param_sharding_fn(
    mesh: Mesh, config: ModelConfig
) -> Callable[[str, tuple[int, ...]], NamedSharding]:
    """``(leaf path, shape) -> NamedSharding`` for ``config``'s family: the form
    ``models.loader.load_model`` takes, so each device receives only its own shard of every
    weight."""
    n = mesh_size(mesh)
    axes = split_axes(config) if n > 1 else {}
    return lambda path, shape: NamedSharding(mesh, leaf_spec(path, tuple(shape), n, axes))


def param_shardings(
    params_or_shapes: Mapping[str, Any], mesh: Mesh, config: ModelConfig
) -> dict[str, Any]:
    """A NamedSharding per leaf, same tree as the params (leaves may be arrays or shapes)."""
    fn = param_sharding_fn(mesh, config)

    def walk(node: Any, prefix: str) -> Any:
        if isinstance(node, Mapping):
            return {k: walk(v, f"{prefix}/{k}" if prefix else k) for k, v in node.items()}
        shape = node if isinstance(node, tuple) else tuple(node.shape)
        if isinstance(node, QuantizedWeight):  # values split as the float leaf, scales alike
            values = fn(prefix, shape)
            return QuantizedWeight(values, scales_sharding(values, node))
        if isinstance(node, GroupedWeight):  # K split only at group boundaries
            return grouped_sharding_tree(fn(prefix, node.shape), node, prefix)
        return fn(prefix, shape)

    return walk(params_or_shapes, "")


def kv_pool_sharding(mesh: Mesh) -> NamedSharding:
    """Every pool array split over its KV-head axis (the third): the pages [L * num_blocks,
    block_size, Hkv, hd] and an 8-bit pool's scales [L * num_blocks, block_size, Hkv]."""
    return NamedSharding(mesh, _POOL_SPEC)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def shard_params(config: ModelConfig, params: Params, mesh: Mesh) -> tuple[ModelConfig, Params]:
    """Place in-memory params on the mesh (replicating KV heads first when needed). Params that
    already carry these shardings are left where they are."""
    n = mesh_size(mesh)
    if kv_replication(config, n) > 1:
        config, params = replicate_kv_heads(config, jax.device_get(params), n)
    shardings = param_shardings(params, mesh, config)
    return config, jax.device_put(params, shardings)


# ---------------------------------------------------------------------- the step side


def shard_attention(
    fn: Callable[..., Any], mesh: Mesh, *, alibi: bool = False
) -> Callable[..., Any]:
    """Run the paged attention op per device on its own heads.

    ``fn(q, k, v, layer, pool, slot_mapping, kv_lens, block_tables, cu_q_lens, num_seqs) ->
    (out, pool)`` with q [T, Hq, hd], k/v [T, Hkv, hd], pool a tuple of [L*NB, bs, heads, hd]
    arrays split over their heads axis, out [T, Hq, hd]. Inside, each device sees Hq/N query heads and the
    Hkv/N KV heads they read (heads are grouped by KV head, so the GQA mapping is unchanged),
    and the kernels (Pallas or XLA) run unchanged on local shapes, with no communication.
    With ``alibi``, fn takes one more argument, the ALiBi slopes float32 [Hq], split over
    heads like q (device d gets slopes[d * Hq / N:(d + 1) * Hq / N]).
    """
    heads = P(None, AXIS, None)
    pages = _POOL_SPEC  # a prefix of every pool array's spec: pages and 8-bit scales alike
    rep = P()
    return jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=(heads, heads, heads, rep, pages, rep, rep, rep, rep, rep)
        + ((P(AXIS),) if alibi else ()),
        out_specs=(heads, pages),
        check_vma=False,
    )


def replicate_on(x: Any, mesh: Mesh | None) -> Any:
    """Constrain (inside jit) every leaf of x to be whole on every device."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, replicated(mesh))
