"""Which family serves a model: config.json's ``architectures`` entry (as vLLM and
tpu-inference key their models) -> the family module that declares it, imported on first
use; ``model_type`` only for configs without ``architectures`` (GGUF imports of old
converters, hand-written configs). The table is static data: a family is added by writing
its module (with a ``FAMILY``) and naming its architectures here (docs/models.md)."""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from .config import CUSTOM_MODEL_TYPE, ModelConfig
from .family import ModelFamily

# HF architecture -> the module under models/ whose FAMILY serves it
ARCHITECTURES: Mapping[str, str] = MappingProxyType(
    {
        "LlamaForCausalLM": "llama",
        "MistralForCausalLM": "llama",
        "Qwen2ForCausalLM": "llama",
        "Qwen3ForCausalLM": "llama",
        "Phi3ForCausalLM": "llama",
        "MixtralForCausalLM": "llama",
        "Qwen3MoeForCausalLM": "llama",
        "GPT2LMHeadModel": "gpt",
        "OPTForCausalLM": "gpt",
        "Gemma2ForCausalLM": "gemma",
        "Gemma3ForCausalLM": "gemma",
        "Gemma3ForConditionalGeneration": "gemma3_vl",
        "Qwen2_5_VLForConditionalGeneration": "qwen2_vl",
        "BloomForCausalLM": "bloom",
        "GraniteForCausalLM": "granite",
        "BertModel": "bert",
        "RobertaModel": "bert",
        "XLMRobertaModel": "bert",
        "BertForSequenceClassification": "bert",
        "RobertaForSequenceClassification": "bert",
        "XLMRobertaForSequenceClassification": "bert",
    }
)
# Architectures and model types that name a model jaxpaged knows and does not run, and why
_REFUSED: Mapping[str, str] = MappingProxyType({})


def _modules() -> tuple[str, ...]:
    return tuple(dict.fromkeys(ARCHITECTURES.values()))


def _family(module: str) -> ModelFamily:
    return importlib.import_module(f"{__package__}.{module}").FAMILY


def families() -> tuple[ModelFamily, ...]:
    """Every family, in the table's order."""
    return tuple(_family(m) for m in _modules())


def supported_model_types() -> tuple[str, ...]:
    return tuple(t for f in families() for t in f.model_types)


def family_for_architecture(architecture: str) -> ModelFamily:
    """The family serving an HF architecture; ValueError listing the supported ones."""
    if architecture in _REFUSED:
        raise ValueError(_REFUSED[architecture])
    module = ARCHITECTURES.get(architecture)
    if module is None:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(ARCHITECTURES)}"
        )
    return _family(module)


def family_for_model_type(model_type: str | None) -> ModelFamily:
    """The family accepting ``model_type``; ValueError listing the supported ones."""
    if model_type in _REFUSED:
        raise ValueError(_REFUSED[model_type])
    if model_type == CUSTOM_MODEL_TYPE:
        raise ValueError(
            f"a model_type {CUSTOM_MODEL_TYPE!r} config comes with its own module (LLM.from_model)"
        )
    for family in families():
        if model_type in family.model_types:
            return family
    raise ValueError(
        f"unsupported model_type {model_type!r}; supported: {', '.join(supported_model_types())}"
    )


def family_for_hf_config(d: Mapping[str, Any]) -> ModelFamily:
    """The family of a config.json: its first ``architectures`` entry jaxpaged knows
    (ValueError listing the supported ones when none is), else its ``model_type``."""
    architectures = d.get("architectures") or ()
    for architecture in architectures:
        if architecture in ARCHITECTURES or architecture in _REFUSED:
            family = family_for_architecture(architecture)
            break
    else:
        if architectures:
            family_for_architecture(architectures[0])  # raises, naming the supported ones
        family = family_for_model_type(d.get("model_type"))
    model_type = d.get("model_type")
    if model_type not in family.model_types:  # a variant the family does not know
        if model_type in _REFUSED:
            raise ValueError(_REFUSED[model_type])
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: "
            f"{', '.join(supported_model_types())}"
        )
    return family


def family_of(config: ModelConfig) -> ModelFamily:
    """The family of a parsed config (ValueError for a model of your own)."""
    return family_for_model_type(config.model_type)


def declared_family(config: ModelConfig) -> ModelFamily | None:
    """The family of a parsed config; None for a model of your own (model_type "custom"),
    which declares nothing: no linears, matmul weights or refusals."""
    if config.model_type == CUSTOM_MODEL_TYPE:
        return None
    return family_of(config)


def parse_config(d: Mapping[str, Any]) -> ModelConfig:
    """The ModelConfig of a Hugging Face config.json (transformers 4 or 5), parsed by the
    family that serves it; ValueError naming an architecture, model type or option
    jaxpaged does not run."""
    return family_for_hf_config(d).parse_config(d)


def load_config(folder: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of a model folder's config.json."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in model folder {os.fspath(folder)!r}")
    with open(path) as f:
        return parse_config(json.load(f))


def check_feature(config: ModelConfig, feature: str, setting: str) -> None:
    """ValueError naming ``setting`` when ``config``'s family refuses ``feature``, with the
    reason its declaration gives. A model of your own (model_type "custom") declares
    nothing: the engine checks what it can of it where it uses it."""
    family = declared_family(config)
    if family is None:
        return
    reason = family.refusal(feature, config)
    if reason is not None:
        raise ValueError(
            f"{setting} is not supported for model_type {config.model_type!r} "
            f"({family.name} family): {reason}"
        )
