"""What a model family declares about itself (`ModelFamily`), so that the loader,
quantization, tensor parallelism, LoRA and the GGUF code ask the declaration instead of
testing the family's name. Each family module (llama.py, gpt.py, gemma.py, bloom.py,
granite.py) defines one ``FAMILY``; models/registry.py finds it by architecture."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

import numpy as np

from .config import ModelConfig
from .types import Params, TensorReader

# The features a family may refuse, each checked in one place:
# "tensor_parallel" (distributed/parallel.py), "lora" (engine/lora.py), "quantization"
# (int8 / fp8 at load, quant/params.py), "prequantized" (AWQ, GPTQ, compressed-tensors
# checkpoints, loader.py), "gguf_quantized" (a GGUF import's own quantized weights,
# gguf_params.py).
FEATURES = ("tensor_parallel", "lora", "quantization", "prequantized", "gguf_quantized")


class GgufMetadata(Protocol):
    """What a family's GGUF config reader sees of a GGUF file (models/gguf.py)."""

    path: Path

    def scalar(self, key: str, *, required: bool = True, default: Any = None) -> Any:
        """A metadata value (ValueError naming the key if required and absent)."""
        ...

    def has_tensor(self, name: str) -> bool: ...

    def float_tensor(self, name: str) -> np.ndarray:  # float32, HF layout [out, in]
        ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class GgufLayout:
    """How one llama.cpp GGUF architecture maps onto a family's Hugging Face names (for
    models/gguf.py, which writes a GGUF file out as a Hugging Face folder, and
    models/gguf_params.py, which reads its quantized weights back)."""

    architecture: str  # general.architecture in the GGUF file ("llama", "qwen2", "gemma3")
    model_type: str  # the config.json model_type the import gets
    hf_architecture: str  # and its architectures entry
    layer_tensors: Mapping[str, str]  # GGUF per-layer tensor -> HF module in model.layers.N
    plus_one_norms: bool = False  # llama.cpp stores the norms' (1 + w) (Gemma's RMSNorms)
    permuted_qk: bool = False  # llama.cpp interleaved the rotary halves of q and k rows
    # params leaf -> HF module of each layer's norms, read as floats beside the quantized
    # matmul weights (gguf_params.py)
    layer_norms: Mapping[str, str] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    # (the file, the config.json fields every architecture has) -> the family's config.json
    # fields: what it reads beyond those (None: nothing)
    config_fields: Callable[[GgufMetadata, dict[str, Any]], dict[str, Any]] | None = None


def gguf_layout_of(layouts: Iterable[GgufLayout], config: ModelConfig) -> GgufLayout | None:
    """The layout among ``layouts`` that a GGUF import of ``config``'s kind was written by:
    the one declaring the model_type the import's config.json got (None: no GGUF import
    has this config's model type)."""
    return {g.model_type: g for g in layouts}.get(config.model_type)


@dataclasses.dataclass(frozen=True)
class LoraSite:
    """One place in a decoder layer's forward that adds a LoRA term after its base
    product: its input and output widths, and how many rank blocks its A stacks (the
    A). The site's arrays per layer: A [parts * max_rank, in], B [out, parts * max_rank].
    An experts site (``experts`` > 1) holds one rank block per expert, A [E * max_rank, in]
    and B [out, E * max_rank], and adds expert e's term to expert e's product."""

    in_features: int
    out_features: int
    parts: int = 1
    experts: int = 1


@dataclasses.dataclass(frozen=True)
class LoraPiece:
    """Where part of one PEFT module's term goes: its A into rank block ``part`` of
    ``site``, row j of its B into the site's output row ``rows[j]`` (-1: not this site;
    None: row j itself)."""

    site: str
    part: int = 0
    rows: np.ndarray | None = None  # int [module out]


@dataclasses.dataclass(frozen=True)
class LoraModule:
    """One PEFT-targetable linear of a decoder layer: its Hugging Face shape (as PEFT's
    lora_A [r, in] and lora_B [out, r] have it) and the site pieces it fills. A stack of
    ``experts`` weights (a parameter PEFT targets with ``target_parameters``) has lora_A
    [E * r, in] (rows expert-major) and lora_B [out, r * E] (columns rank-major), as PEFT's
    ParamWrapper saves them."""

    in_features: int
    out_features: int
    pieces: tuple[LoraPiece, ...]
    experts: int = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraLayout:
    """How PEFT adapters of a family map onto its forward's LoRA sites (models/lora.py).
    ``layer_prefix`` is the Hugging Face path of decoder layer i ("model.layers.{}."),
    ``modules`` names each targetable linear by its path inside the layer
    ("self_attn.q_proj"), as PEFT matches ``target_modules`` against full paths.
    ``conv1d``: the modules are transformers' Conv1D (GPT-2), which PEFT saves with
    ``fan_in_fan_out=True``; lora_A and lora_B keep nn.Linear's orientation either way."""

    layer_prefix: str
    sites: Mapping[str, LoraSite]
    modules: Mapping[str, LoraModule]
    # weights that are no linear module, by parameter path inside the layer
    # ("mlp.experts.gate_up_proj"), as PEFT's ``target_parameters`` names them
    parameters: Mapping[str, LoraModule] = dataclasses.field(
        default_factory=lambda: MappingProxyType({})
    )
    conv1d: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class Linear:
    """One matmul weight of a family's decoder layer, declared once: the stacked "layers"
    leaf and how it reshapes into the ``[L', out, in]`` view that ``linear_fn`` multiplies
    by (its first ``stack_axes`` axes are L', its last ``in_axes`` the contracted ones, the
    rest the output), the axis of the leaf tensor parallelism splits (None: replicated; the
    family's module puts it on the leaf's nnx.Param as partition metadata), the Hugging Face
    modules of one layer (``model.layers.N.<module>``) whose pre-quantized weights fill it,
    and the LoRA sites its products add a term at (one per stacked product, or one for all).
    int8 / fp8 quantization rounds the leaf per output channel over its ``in_axes``."""

    leaf: str  # in params["layers"], e.g. "wqkv"
    in_axes: int = 1  # trailing axes of the leaf its matmul contracts
    stack_axes: int = 1  # leading axes of the leaf that index its products (1: layers only)
    split: int | None = None  # the leaf's axis N devices split
    hf_modules: tuple[str, ...] = ()  # pre-quantized checkpoints' modules (empty: none)
    lora: tuple[str, ...] = ()  # LoRA sites of its products (LoraLayout.sites)

    def view(self, w: Any) -> Any:  # [L', out, in], a free reshape of the leaf
        """The stacked leaf (float, quantized or packed: anything with the leaf's shape and
        ``reshape``) as the ``[L', out, in]`` stack ``linear_fn`` reads."""
        shape = tuple(w.shape)
        lead, trail = shape[: self.stack_axes], shape[len(shape) - self.in_axes :]
        k = math.prod(trail)
        return w.reshape(math.prod(lead), math.prod(shape) // (math.prod(lead) * k), k)

    def products(self, w: Any) -> int:
        """How many products of one layer the leaf stacks (its view's L' is L times this)."""
        return math.prod(tuple(w.shape)[1 : self.stack_axes])


def linear_splits(linears: Iterable[Linear]) -> dict[str, int]:
    """The split axis of every declared linear that tensor parallelism splits, by leaf."""
    return {lin.leaf: lin.split for lin in linears if lin.split is not None}


def _no_refusals(config: ModelConfig) -> Mapping[str, str]:
    del config
    return {}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelFamily:
    """One family: the Hugging Face architectures and model types it serves, how it reads
    a config.json and a checkpoint, its NNX module, its tensor-parallel layout, and the
    features it refuses, each with the reason."""

    name: str
    architectures: tuple[str, ...]  # config.json "architectures" entries it serves
    model_types: tuple[str, ...]  # config.json "model_type" values it accepts
    parse_config: Callable[[Mapping[str, Any]], ModelConfig]  # ValueError naming an option
    module: type  # the NNX module: module(config, dtype=...), see models/protocol.py
    param_shapes: Callable[[ModelConfig], dict[str, Any]]  # the params tree's shapes
    # the safetensors weight names: (read, config, stacked layer buffers to fill) -> host
    # params (the buffers are ``param_shapes(config)["layers"]``'s, float or quantized)
    load_host_params: Callable[[TensorReader, ModelConfig, dict[str, Any]], Params]
    # its decoder layer's matmul weights, each declared once (models/linear.py): the
    # ``linear_fn`` views, int8 / fp8 quantization (``matmul_weights``), pre-quantized
    # checkpoints (``prequantized_modules``) and the CPU platform's weight packing derive
    # from it; a config whose params lack a leaf skips it. Tensor parallelism reads each
    # leaf's split from its nnx.Param's partition metadata (the module declares it)
    linears: tuple[Linear, ...] = ()
    gguf: tuple[GgufLayout, ...] = ()  # the GGUF architectures it imports
    # feature (one of FEATURES) -> why this config cannot have it; absent: supported
    refused: Callable[[ModelConfig], Mapping[str, str]] = _no_refusals
    # LoRA: the PEFT modules and forward sites of a config (None: the family has none)
    lora: Callable[[ModelConfig], LoraLayout] | None = None
    # the runner its checkpoints run by default (vLLM's ``--runner``): "generate" (the paged
    # decoder engine) or "pooling" (an encoder's embeddings and scores, engine/pooling.py)
    runner: str = "generate"

    @property
    def matmul_weights(self) -> Mapping[str, int]:
        """ "layers" leaf -> how many trailing axes its matmul contracts, for every declared
        linear (int8 / fp8 quantize these per output channel, quant/params.py)."""
        return MappingProxyType({lin.leaf: lin.in_axes for lin in self.linears})

    def gguf_layout(self, config: ModelConfig) -> GgufLayout | None:
        """The GGUF layout a GGUF import of ``config`` was written by (None: none)."""
        return gguf_layout_of(self.gguf, config)

    @property
    def prequantized_modules(self) -> Mapping[str, tuple[str, ...]]:
        """ "layers" leaf -> the HF modules of one layer whose pre-quantized weights fill it
        (quant/prequantized.py); empty: the family reads no pre-quantized checkpoint."""
        return MappingProxyType(
            {lin.leaf: lin.hf_modules for lin in self.linears if lin.hf_modules}
        )

    def refusal(self, feature: str, config: ModelConfig) -> str | None:
        """Why ``config`` cannot have ``feature`` (None: it can)."""
        if feature not in FEATURES:
            raise ValueError(f"unknown feature {feature!r}; features: {', '.join(FEATURES)}")
        reason = self.refused(config).get(feature)
        if reason is None and feature == "lora" and self.lora is None:
            return "the family declares no LoRA sites"
        return reason
