"""LoRA adapters: PEFT's saved format read into a family's LoRA sites, and the low-rank
term each site adds after its base matmul.

An adapter is a folder of ``adapter_config.json`` and ``adapter_model.safetensors`` (PEFT's
``save_pretrained``). The family declares its sites and the PEFT modules that fill them
(``ModelFamily.lora``, a `LoraLayout`: models/family.py); its weights become one (A, B)
pair per site of the decoder layer, A [L, parts * r', in] and B [L, out, parts * r'] (the
scale folded into B). The Llama family's fused q/k/v site, for example:

    site   PEFT modules              A [L, r', in]     B [L, out, r']
    qkv    q_proj, k_proj, v_proj    [L, 3r, D]        [L, Hkv*(G+2)*hd, 3r]  (the fused wqkv rows)
    o      o_proj                    [L, r, Hq*hd]     [L, D, r]

q, k and v keep their own A: the three are stacked on the rank axis and B is block-diagonal in
the fused row layout, so one product serves the fused projection. Ranks below the engine's
``max_lora_rank`` are zero-padded; modules (or layers) an adapter does not target are zero.

``target_modules`` is matched as PEFT matches it against the model's module paths: a list
of names or of full paths ("model.layers.0.mlp.up_proj", as an ``all-linear`` adapter is
saved), each matching a path equal to it or ending in "." + it (``layers_to_transform`` /
``layers_pattern`` then pick layers), or one string, a regular expression over the whole
path. What cannot apply is refused by name (ValueError).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from .config import ModelConfig
from .family import LoraLayout
from .lora_term import LoraInputs, lora_delta
from .registry import family_of

__all__ = [
    "LoraInputs",
    "LoraWeights",
    "lora_delta",
    "lora_layout",
    "load_peft_adapter",
    "site_shapes",
]

_PREFIX = "base_model.model."  # PEFT's prefix of the base model's parameter names
# adapter_config.json options that change what the adapter computes and jaxpaged does not
# run: refused by name when set
_REFUSED_OPTIONS = (
    "use_dora",
    "modules_to_save",
    "trainable_token_indices",
    "lora_bias",
    "layer_replication",
    "megatron_config",
    "use_qalora",
    "alora_invocation_tokens",
)

_WHY = {
    "target_parameters": " (LoRA on weights that are no linear module: a mixture-of-experts "
    "model's experts and router, which PEFT's all-linear targets there)"
}


def lora_layout(config: ModelConfig) -> LoraLayout:
    """The LoRA sites and PEFT modules ``config``'s family declares (ValueError if none)."""
    family = family_of(config)
    if family.lora is None:
        raise ValueError(f"LoRA: the {family.name} family declares no LoRA sites")
    return family.lora(config)


def site_shapes(config: ModelConfig, max_rank: int) -> dict[str, tuple[tuple, tuple]]:
    """(A shape, B shape) of every site, per layer: A [parts * r', in], B [out, parts * r']
    (experts sites: E * r' for parts * r')."""
    shapes = {}
    for name, s in lora_layout(config).sites.items():
        width = s.parts * s.experts * max_rank
        shapes[name] = ((width, s.in_features), (s.out_features, width))
    return shapes


class LoraWeights(NamedTuple):
    """One adapter on the host in its family's site layout: site -> (A [L, r', in],
    B [L, out, r']); ``rank``: its largest module rank."""

    rank: int
    sites: dict[str, tuple[np.ndarray, np.ndarray]]


def _targets_layer(cfg: Mapping[str, Any], path: str) -> bool:
    """PEFT's layer filter (``layers_to_transform``, ``layers_pattern``) on a module path
    that a list of ``target_modules`` matched (peft.tuners.tuners_utils.
    check_target_module_exists)."""
    wanted = cfg.get("layers_to_transform")
    if wanted is None or (isinstance(wanted, list) and not wanted):
        return True
    patterns = cfg.get("layers_pattern")
    if not patterns:
        m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", path)
    else:
        m = None
        for pattern in [patterns] if isinstance(patterns, str) else patterns:
            m = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", path)
            if m is not None:
                break
    if m is None:
        return False
    index = int(m.group("idx"))
    return index == wanted if isinstance(wanted, int) else index in wanted


def _excluded(cfg: Mapping[str, Any], path: str) -> bool:
    exclude = cfg.get("exclude_modules")
    if not exclude:
        return False
    if isinstance(exclude, str):
        return re.fullmatch(exclude, path) is not None
    return path in exclude or any(path.endswith("." + e) for e in exclude)


def _pattern_value(pattern: Mapping[str, Any], path: str, default: Any) -> Any:  # noqa: ANN401
    """A ``rank_pattern`` / ``alpha_pattern`` entry for ``path`` (peft.utils.other.
    get_pattern_key: the first key the path ends with, as a regex), else ``default``."""
    for key in pattern:
        if re.match(rf"(.*\.)?({key})$", path):
            return pattern[key]
    return default


def _plan(
    cfg: Mapping[str, Any], where: str, layout: LoraLayout, num_layers: int, max_rank: int
) -> dict[tuple[int, str], tuple[int, float]]:
    """The targeted (layer, module)s of a PEFT LoRA config -> their (rank, scale);
    ValueError naming every option, target or rank jaxpaged does not run."""
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {cfg.get('peft_type')!r} is not LORA")
    refused = [f"{key}={cfg[key]!r}{_WHY.get(key, '')}" for key in _REFUSED_OPTIONS if cfg.get(key)]
    if cfg.get("bias", "none") != "none":
        refused.append(f"bias={cfg['bias']!r}")
    if cfg.get("fan_in_fan_out") and not layout.conv1d:
        refused.append("fan_in_fan_out=True (for Conv1D modules; this model's are nn.Linear)")
    targets = cfg.get("target_modules")
    params = cfg.get("target_parameters") or []
    paths = {
        layout.layer_prefix.format(i) + module: (i, module)
        for i in range(num_layers)
        for module in layout.modules
    }
    supported = ", ".join(layout.modules)
    chosen: list[str] = []
    if isinstance(targets, str) and targets.lower() == "all-linear":
        chosen = list(paths)
    elif isinstance(targets, str):
        if cfg.get("layers_to_transform") is not None:
            refused.append("layers_to_transform with a regex target_modules (PEFT refuses it)")
        try:
            chosen = [p for p in paths if re.fullmatch(targets, p)]
        except re.error as e:
            refused.append(f"target_modules={targets!r} (not a regular expression: {e})")
        if not chosen:
            refused.append(f"target_modules={targets!r} (matches none of {supported})")
    elif isinstance(targets, list | tuple):
        unknown = [t for t in targets if not any(p == t or p.endswith("." + t) for p in paths)]
        if unknown:
            refused.append(
                f"target modules {unknown} (not a linear of a decoder layer jaxpaged adapts; "
                f"supported: {supported})"
            )
        # a full path is taken as it is; a name, in the layers the layer filter keeps
        chosen = [
            p
            for p in paths
            if p in targets
            or (any(p.endswith("." + t) for t in targets) and _targets_layer(cfg, p))
        ]
    elif targets is not None or not params:
        refused.append(f"target_modules={targets!r} (give module names, paths or a regex)")
    if params and not layout.parameters:
        refused.append(f"target_parameters={params!r}{_WHY['target_parameters']}")
    elif params:  # matched as PEFT does: a path equal to it or ending in "." + it
        weights = {
            layout.layer_prefix.format(i) + name: (i, name)
            for i in range(num_layers)
            for name in layout.parameters
        }
        unknown = [t for t in params if not any(p == t or p.endswith("." + t) for p in weights)]
        if unknown:
            refused.append(
                f"target_parameters {unknown} (supported: {', '.join(layout.parameters)})"
            )
        paths |= weights
        chosen += [p for p in weights if p in params or any(p.endswith("." + t) for t in params)]
    rank = int(cfg["r"])
    alpha = cfg.get("lora_alpha", 8)  # PEFT's default
    plan: dict[tuple[int, str], tuple[int, float]] = {}
    too_big: set[int] = set()
    for path in chosen:
        if _excluded(cfg, path):
            continue
        r = int(_pattern_value(cfg.get("rank_pattern") or {}, path, rank))
        a = float(_pattern_value(cfg.get("alpha_pattern") or {}, path, alpha))
        if not 1 <= r <= max_rank:
            too_big.add(r)
            continue
        plan[paths[path]] = (r, a / math.sqrt(r) if cfg.get("use_rslora") else a / r)
    if too_big:
        refused.append(f"rank {sorted(too_big)} not in 1..max_lora_rank={max_rank}")
    if refused:
        raise ValueError(f"{where}: not supported by jaxpaged: {'; '.join(refused)}")
    return plan


def load_peft_adapter(
    path: str | os.PathLike[str], config: ModelConfig, *, max_rank: int, dtype: Any
) -> LoraWeights:
    """An adapter folder saved by PEFT, in the family's site layout (``dtype`` as the base
    weights); ValueError naming the first problem (an unsupported option, a module or
    shape that does not fit the model, a rank over ``max_rank``)."""
    from safetensors.numpy import load_file

    path = os.fspath(path)
    where = f"LoRA adapter {path}"
    cfg_file = os.path.join(path, "adapter_config.json")
    weights_file = os.path.join(path, "adapter_model.safetensors")
    for f in (cfg_file, weights_file):
        if not os.path.isfile(f):
            raise ValueError(f"{where}: {os.path.basename(f)} not found")
    layout = lora_layout(config)
    n = config.num_layers
    with open(cfg_file) as fh:
        plan = _plan(json.load(fh), where, layout, n, max_rank)
    keys = {
        f"{_PREFIX}{layout.layer_prefix.format(i)}{module}.lora_{ab}.weight": (i, module, ab)
        for (i, module) in plan
        for ab in "AB"
    }
    # a targeted parameter's module ("...mlp.experts") -> (layer, module path in the layer);
    # PEFT nests one wrapper per targeted parameter of a module, its tensors under
    # "<module>(.base_layer)*.lora_A.weight", told apart here by their shapes
    wrapped_modules = {
        f"{_PREFIX}{layout.layer_prefix.format(i)}{name.rpartition('.')[0]}": (
            i,
            name.rpartition(".")[0],
        )
        for (i, name) in plan
        if name in layout.parameters
    }
    per_module: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    wrapped: dict[tuple[int, str], dict[str, dict[str, np.ndarray]]] = {}
    for key, value in load_file(weights_file).items():
        if key in keys:
            i, module, ab = keys[key]
            per_module.setdefault((i, module), {})[ab] = value
            continue
        m = re.fullmatch(r"(.*?)((?:\.base_layer)*)\.lora_([AB])\.weight", key)
        if m is None or m.group(1) not in wrapped_modules:
            raise ValueError(f"{where}: unsupported tensor {key!r}")
        nest = wrapped.setdefault(wrapped_modules[m.group(1)], {})
        nest.setdefault(m.group(2), {})[m.group(3)] = value
    for (layer, name), (rank, _) in plan.items():
        spec = layout.parameters.get(name)
        if spec is None:
            continue
        module = name.rpartition(".")[0]
        want_a = (spec.experts * rank, spec.in_features)
        want_b = (spec.out_features, spec.experts * rank)
        nest = wrapped.get((layer, module), {})
        fits = [d for d, pair in nest.items() if pair.get("A", np.empty(0)).shape == want_a
                and pair.get("B", np.empty(0)).shape == want_b]  # fmt: skip
        if len(fits) != 1:
            raise ValueError(
                f"{where}: layer {layer} {name}: {len(fits)} lora_A {want_a} / lora_B "
                f"{want_b} pairs under {module} (want one)"
            )
        per_module[(layer, name)] = nest.pop(fits[0])
    for (layer, module), nest in wrapped.items():
        if nest:
            raise ValueError(
                f"{where}: layer {layer} {module}: lora tensors of no targeted parameter "
                f"({sorted(nest)})"
            )
    out = {
        site: (np.zeros((n, *a), np.float32), np.zeros((n, *b), np.float32))
        for site, (a, b) in site_shapes(config, max_rank).items()
    }
    for (layer, module), (rank, scale) in sorted(plan.items()):
        pair = per_module.get((layer, module), {})
        a, b = pair.get("A"), pair.get("B")
        if a is None or b is None:
            raise ValueError(f"{where}: layer {layer} {module} lacks lora_A or lora_B")
        spec = layout.modules.get(module) or layout.parameters[module]
        e = spec.experts
        want_a, want_b = (e * rank, spec.in_features), (spec.out_features, e * rank)
        if a.shape != want_a or b.shape != want_b:
            raise ValueError(
                f"{where}: layer {layer} {module} has A {a.shape}, B {b.shape}; "
                f"the model needs A {want_a}, B {want_b}"
            )
        a = a.astype(np.float32)
        b = b.astype(np.float32) * scale
        if e > 1:  # A rows (expert, rank); B columns (rank, expert) -> (expert, rank)
            a = a.reshape(e, rank, -1)
            b = b.reshape(-1, rank, e).transpose(0, 2, 1)
            for piece in spec.pieces:
                sa, sb = out[piece.site]
                sa[layer].reshape(e, max_rank, -1)[:, :rank] = a
                sb[layer].reshape(-1, e, max_rank)[:, :, :rank] = b
            continue
        for piece in spec.pieces:
            sa, sb = out[piece.site]
            cols = slice(piece.part * max_rank, piece.part * max_rank + rank)
            sa[layer, cols] = a
            if piece.rows is None:
                sb[layer, :, cols] = b
            else:
                mine = piece.rows >= 0
                sb[layer, piece.rows[mine], cols] = b[mine]
    sites = {s: (a.astype(dtype), b.astype(dtype)) for s, (a, b) in out.items()}
    return LoraWeights(rank=max((r for r, _ in plan.values()), default=0), sites=sites)
