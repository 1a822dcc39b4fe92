"""The quantization a pre-quantized checkpoint declares (``quantization_config`` in its
config.json), read as vLLM reads it: the checkpoint decides the format, and an explicit
``quantization=`` must agree with it.

Read formats (weight-only, symmetric unless said):

- compressed-tensors (llm-compressor's output): 8-bit float weights (e4m3, one scale per
  output channel or per tensor) -> ``fp8``; 8-bit integer weights per channel ->
  ``int8``, in groups of inputs (W8A16) -> ``int8-group``; stored plain ("naive-quantized",
  "float-quantized", "int-quantized") or packed in int32 ("pack-quantized"); 4-bit integer weights in groups or per channel, symmetric or
  with zero points (W4A16, "pack-quantized") -> ``int4``. Activation quantization (W8A8,
  FP8 with input scales), block scales, sparsity, KV cache schemes and transforms are
  refused by name.

- AWQ (AutoAWQ's "gemm" version) and GPTQ (AutoGPTQ / GPTQModel, "gptq" and "gptq_v2"
  formats, act-order too): 4-bit weights with a scale and zero per group of inputs ->
  ``int4``, a `GroupedWeight` (models/quant/gptq_awq.py has the layouts).

Anything else with a ``quantization_config`` (bitsandbytes, Marlin, ...) is refused, naming
its format, since reading its packed tensors as floats would load garbage.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

__all__ = [
    "CHECKPOINT_FORMATS",
    "CheckpointQuantization",
    "checkpoint_quantization",
    "resolve_quantization",
]

# quant_method -> the format's name in messages; those not in _READ are refused
_FORMAT_NAMES = {
    "compressed-tensors": "compressed-tensors",
    "awq": "AWQ",
    "gptq": "GPTQ",
    "fp8": "FP8 (block-scaled)",
    "bitsandbytes": "bitsandbytes",
    "marlin": "Marlin",
}
_READ = ("compressed-tensors", "awq", "gptq")
# the quantization= values that name a checkpoint format rather than a load-time method
CHECKPOINT_FORMATS = _READ

# compressed-tensors storage formats whose weights this module reads
_CT_FORMATS = ("naive-quantized", "float-quantized", "int-quantized", "pack-quantized")


@dataclasses.dataclass(frozen=True)
class CheckpointQuantization:
    """How a checkpoint's quantized linear weights are stored and what they load as."""

    quant_method: str  # config.json's quant_method, e.g. "compressed-tensors"
    # the params' format: "int8" or "fp8" (QuantizedWeight), "int4" or "int8-group"
    # (GroupedWeight, 4 or 8 bits)
    method: str
    strategy: str  # "channel" (a scale per output), "tensor" (one scale) or "group"
    packed: bool = False  # compressed-tensors "pack-quantized": values packed in int32 words
    group_size: int = 0  # "group": inputs per scale; -1 = all of K (one group per output)
    zero_offset: int = 0  # added to GPTQ's stored zeros (1 in its v1 format)
    symmetric: bool = True  # compressed-tensors 4-bit: False = zero points stored
    act_order: bool = False  # GPTQ desc_act: each layer's weights carry their g_idx

    @property
    def grouped_bits(self) -> int:
        """4 or 8 for a format read into `GroupedWeight`s, else 0."""
        return {"int4": 4, "int8-group": 8}.get(self.method, 0)

    @property
    def marker(self) -> str:
        """The tensor suffix that marks a module as quantized in the checkpoint."""
        return "weight_scale" if self.quant_method == "compressed-tensors" else "qweight"

    @property
    def format_name(self) -> str:
        return _FORMAT_NAMES.get(self.quant_method, self.quant_method)


def checkpoint_quantization(folder: str) -> CheckpointQuantization | None:
    """The quantization of the checkpoint in ``folder`` (None for a float one); ValueError
    naming the format or scheme when jaxpaged does not read it."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        qc = json.load(f).get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "unknown")).lower()
    name = _FORMAT_NAMES.get(method, method)
    if method not in _READ:
        raise ValueError(
            f"checkpoint {folder!r} is pre-quantized ({name}, quantization_config.quant_method="
            f"{method!r}); jaxpaged does not load {name} checkpoints yet: load its float "
            "checkpoint with quantization='int8' or 'fp8' instead"
        )
    if method == "awq":
        return _awq(qc, folder)
    if method == "gptq":
        return _gptq(qc, folder)
    return _compressed_tensors(qc, folder)


def _refusal(fmt: str, folder: str, what: str, reads: str) -> ValueError:
    return ValueError(f"checkpoint {folder!r} ({fmt}): {what} is not supported; jaxpaged {reads}")


def _awq(qc: Mapping[str, Any], folder: str) -> CheckpointQuantization:
    reads = "reads 4-bit AWQ in the GEMM layout with zero points"
    bits = qc.get("bits", qc.get("w_bit"))
    version = str(qc.get("version", "gemm")).lower()
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if bits != 4:
        raise _refusal("AWQ", folder, f"bits={bits}", reads)
    if version != "gemm":
        raise _refusal("AWQ", folder, f"version={version!r}", reads)
    if not qc.get("zero_point", True):
        raise _refusal("AWQ", folder, "zero_point=false", reads)
    return CheckpointQuantization("awq", "int4", "group", group_size=group)


def _gptq(qc: Mapping[str, Any], folder: str) -> CheckpointQuantization:
    reads = "reads 4-bit GPTQ (formats gptq and gptq_v2, act-order included)"
    bits = qc.get("bits")
    fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower()
    if bits != 4:
        raise _refusal("GPTQ", folder, f"bits={bits}", reads)
    if fmt not in ("gptq", "gptq_v2"):
        raise _refusal("GPTQ", folder, f"checkpoint_format={fmt!r}", reads)
    return CheckpointQuantization(
        "gptq",
        "int4",
        "group",
        group_size=int(qc.get("group_size", 128)),
        zero_offset=1 if fmt == "gptq" else 0,
        act_order=bool(qc.get("desc_act", False)),
    )


def _compressed_tensors(qc: Mapping[str, Any], folder: str) -> CheckpointQuantization:
    def refuse(what: str) -> ValueError:
        return ValueError(
            f"checkpoint {folder!r} (compressed-tensors): {what} is not supported; jaxpaged "
            "reads weight-only fp8 (per channel or tensor), int8 (per channel or group) and int4 "
            "(W4A16) schemes"
        )

    sparsity = qc.get("sparsity_config") or {}
    if sparsity and sparsity.get("format", "dense") != "dense":
        raise refuse(f"sparsity (sparsity_config.format={sparsity.get('format')!r}, e.g. 2:4)")
    for key in ("kv_cache_scheme", "transform_config", "moe_sparsity_config"):
        if qc.get(key):
            raise refuse(f"{key}={qc[key]!r}")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise refuse("a quantization_config without config_groups")
    found: set[CheckpointQuantization] = set()
    for group_name, group in groups.items():
        where = f"config_groups.{group_name}"
        for act in ("input_activations", "output_activations"):
            if group.get(act):
                bits, kind = group[act].get("num_bits"), group[act].get("type")
                raise refuse(
                    f"activation quantization ({where}.{act}: {bits}-bit {kind}, a W8A8-style "
                    "scheme)"
                )
        fmt = group.get("format") or qc.get("format")
        if fmt not in _CT_FORMATS:
            raise refuse(f"the storage format {fmt!r} ({where})")
        found.add(_weight_scheme(group.get("weights") or {}, fmt, refuse, where))
    if len(found) > 1:
        raise refuse(f"mixing weight schemes {sorted(q.method for q in found)} across groups")
    return found.pop()


def _weight_scheme(w: Mapping[str, Any], fmt: str, refuse, where: str) -> CheckpointQuantization:
    bits, kind, strategy = w.get("num_bits"), w.get("type"), w.get("strategy")
    symmetric = w.get("symmetric", True)
    scheme = f"{bits}-bit {kind} weights, strategy {strategy!r} ({where}.weights)"
    if w.get("dynamic"):
        raise refuse("dynamic " + scheme)
    if bits == 4 and kind == "int" and strategy in ("group", "channel") and fmt == "pack-quantized":
        # W4A16: a GroupedWeight (a channel scale is one group of all K inputs)
        group = int(w.get("group_size") or -1) if strategy == "group" else -1
        return CheckpointQuantization(
            "compressed-tensors", "int4", strategy, packed=True, group_size=group,
            symmetric=bool(symmetric),
        )  # fmt: skip
    if bits != 8 or kind not in ("float", "int"):
        raise refuse(scheme)
    if not symmetric:
        raise refuse("asymmetric " + scheme)
    if kind == "float" and strategy in ("channel", "tensor") and fmt != "pack-quantized":
        return CheckpointQuantization("compressed-tensors", "fp8", strategy)
    if kind == "int" and strategy == "channel":
        return CheckpointQuantization(
            "compressed-tensors", "int8", strategy, packed=fmt == "pack-quantized"
        )
    if kind == "int" and strategy == "group":  # llm-compressor's W8A16 preset: groups of 128
        return CheckpointQuantization(
            "compressed-tensors", "int8-group", strategy, packed=fmt == "pack-quantized",
            group_size=int(w.get("group_size") or -1),
        )  # fmt: skip
    raise refuse(scheme)


def resolve_quantization(
    requested: str | None, checkpoint: CheckpointQuantization | None, folder: str
) -> str | None:
    """The method a load applies: the checkpoint's own when it is pre-quantized (an explicit
    ``requested`` must agree: the same method or the checkpoint's format name), else
    ``requested`` (quantized at load)."""
    if checkpoint is None:
        if requested in CHECKPOINT_FORMATS:
            raise ValueError(
                f"quantization={requested!r} names a pre-quantized checkpoint format, but "
                f"{folder!r} has no quantization_config (a float checkpoint: use 'int8' or "
                "'fp8' to quantize it at load)"
            )
        return requested
    if requested not in (None, checkpoint.method, checkpoint.quant_method):
        raise ValueError(
            f"quantization={requested!r} disagrees with the checkpoint {folder!r}, which is "
            f"pre-quantized as {checkpoint.format_name} {checkpoint.method} (its "
            "quantization_config); leave quantization unset to load it as it is"
        )
    return checkpoint.method
