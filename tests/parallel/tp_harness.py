"""What the tensor-parallel checks share: the expected split of every leaf, a context that
caches tiny models and TP=1 references, greedy decoding at a given TP, and the assertion that
an engine's weights and KV pool are split as expected."""

from __future__ import annotations

import os
from typing import Any

from tp_cases import ENGINE_ARGS, MAX_TOKENS, PROMPTS, make_tiny_model

# Independent statement of the Megatron split (leaf -> split axis); vocab leaves only when N
# divides V. The Llama layout (Gemma's too; MoE experts split on each expert's F):
SPLIT_AXIS = {
    "layers/wqkv": 1,
    "layers/bqkv": 1,
    "layers/wo": 2,
    "layers/w_gate_up": 2,
    "layers/w_down": 2,
    "layers/w_experts_gate_up": 3,
    "layers/w_experts_down": 3,
    "layers/w_fc": 1,  # BLOOM's plain MLP
    "layers/b_fc": 1,
    "layers/w_proj": 2,
    "embed": 0,
    "lm_head": 0,
}
# GPT-2 / OPT: [L, 3, Hq*hd, D] q/k/v, [L, D, Hq*hd] out, [L, F, D] fc, [L, D, F] proj
GPT_SPLIT_AXIS = {
    "layers/wqkv": 2,
    "layers/bqkv": 2,
    "layers/wo": 2,
    "layers/w_fc": 1,
    "layers/b_fc": 1,
    "layers/w_proj": 2,
    "embed": 0,
    "lm_head": 0,
}


class Ctx:
    """State shared by the checks: a work folder and cached models / TP=1 references."""

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self.models: dict[str, str] = {}
        self.refs: dict[str, list[list[int]]] = {}

    def model(self, family: str) -> str:
        if family not in self.models:
            self.models[family] = make_tiny_model(family, os.path.join(self.workdir, family))
        return self.models[family]

    def ref(self, family: str) -> list[list[int]]:
        if family not in self.refs:
            self.refs[family] = greedy(self.model(family), 1)[0]
        return self.refs[family]


def greedy(model: str, tp: int, prompts=PROMPTS, max_tokens=MAX_TOKENS, **kw: Any):
    """(token ids per prompt, the LLM) for greedy decoding at tensor_parallel_size=tp."""
    from jaxpaged import LLM, SamplingParams

    args = dict(ENGINE_ARGS)
    args.update(kw)
    llm = LLM(model, tensor_parallel_size=tp, show_progress=False, **args)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    # not closed: callers inspect its weights and pool (closing frees them); dropping the
    # LLM releases the same
    return [list(o.outputs[0].token_ids) for o in outs], llm


def leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(leaves(v, f"{prefix}/{k}" if prefix else k))
        return out
    return {prefix: tree}


def assert_sharded(engine: Any, n: int, *, num_kv_heads: int, vocab: int) -> None:
    """Every weight and the KV pool live on n devices, split as SPLIT_AXIS says (group-wise
    quantized weights by tp_quant_checks.assert_grouped_split)."""
    import jax
    from jax.sharding import NamedSharding

    cfg = engine.model_config
    split_axis = GPT_SPLIT_AXIS if cfg.model_type in ("gpt2", "opt") else SPLIT_AXIS
    want_kv = num_kv_heads if num_kv_heads % n == 0 else n  # replicated heads -> N
    assert cfg.num_kv_heads == want_kv, (cfg.num_kv_heads, want_kv)
    mesh_devices = set(engine.mesh.devices.flat)
    assert len(mesh_devices) == n
    from jaxpaged.models.quant import GroupedWeight

    params = leaves(engine.runner.params)
    grouped = tuple(path for path, x in params.items() if isinstance(x, GroupedWeight))
    if grouped:  # kept quantized (a GGUF model): values, scales and mins split by groups
        from tp_quant_checks import assert_grouped_split

        assert_grouped_split(engine.runner.params, n, grouped)
    for path, x in params.items():
        if path in grouped:
            continue
        assert isinstance(x.sharding, NamedSharding), (path, x.sharding)
        shards = x.addressable_shards
        assert {s.device for s in shards} == mesh_devices, path
        axis = split_axis.get(path)
        if path in ("embed", "lm_head") and vocab % n:
            axis = None
        want = list(x.shape)
        if axis is not None:
            want[axis] //= n
        for s in shards:
            assert list(s.data.shape) == want, (path, s.data.shape, want)
        if axis is not None:  # the shards are n different slices that tile the axis
            starts = sorted(s.index[axis].start or 0 for s in shards)
            assert starts == [i * want[axis] for i in range(n)], (path, starts)
    for pages in engine.runner.pool:  # K/V pages [L*NB, bs, Hkv, hd], 8-bit scales [L*NB, bs, Hkv]
        L, hd = cfg.num_layers, cfg.head_dim
        whole = (L * engine.layout.num_blocks, engine.layout.block_size, want_kv, hd)
        assert pages.shape == whole[: pages.ndim], (pages.shape, whole)
        shards = pages.addressable_shards
        assert {s.device for s in shards} == mesh_devices
        local = (*pages.shape[:2], want_kv // n, *pages.shape[3:])
        for s in shards:
            assert s.data.shape == local, (s.data.shape, local)
    assert jax.device_count() >= n
