"""The family registry: lookup by config.json ``architectures`` (model_type only without
them), the static table and the families' own declarations agreeing, and refusals that
name the setting, the model type and the family's reason."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

import pytest

from jaxpaged.models.config import ModelConfig
from jaxpaged.models.family import FEATURES
from jaxpaged.models.registry import (
    ARCHITECTURES,
    check_feature,
    families,
    family_for_hf_config,
    family_of,
    parse_config,
    supported_model_types,
)
from jaxpaged.models.testing import tiny_config

# the fields a model type's parser sets beside it: its checkpoint's variant
VARIANT_FIELDS = {
    "gpt2": dict(conv1d_weights=True),
    "phi3": dict(fused_projections=True),
    "mixtral": dict(block_sparse_moe=True),
}


def variant_config(model_type: str) -> ModelConfig:
    """The tiny config of ``model_type`` with the variant fields its parser sets."""
    return tiny_config(model_type=model_type, **VARIANT_FIELDS.get(model_type, {}))


LLAMA_FIELDS = dict(
    vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    num_attention_heads=2,
)  # fmt: skip


def test_table_and_declarations_agree():
    assert isinstance(ARCHITECTURES, MappingProxyType)  # static: no register() to mutate
    declared = {a: f.name for f in families() for a in f.architectures}
    assert declared == dict(ARCHITECTURES)
    types = [t for f in families() for t in f.model_types]
    assert len(types) == len(set(types)) == len(supported_model_types())
    for family in families():
        for model_type in family.model_types:
            config = tiny_config(model_type=model_type)
            assert family_of(config) is family
            assert set(family.refused(config)) <= set(FEATURES), family.name
        for layout in family.gguf:
            assert layout.model_type in family.model_types


def test_lora_layouts_fill_their_sites():
    """Every declared PEFT module fills existing sites: rank blocks the site has, each of
    its output rows a distinct site row (or none), the input width the site's."""
    import numpy as np

    configs = [variant_config(t) for f in families() for t in f.model_types]
    configs.append(dataclasses.replace(variant_config("mixtral"), num_experts=4))
    for config in configs:
        family = family_of(config)
        if family.lora is None:
            continue
        layout = family.lora(config)
        filled = {site: [] for site in layout.sites}
        for name, module in {**layout.modules, **layout.parameters}.items():
            for piece in module.pieces:
                site = layout.sites[piece.site]
                assert 0 <= piece.part < site.parts and module.in_features == site.in_features
                assert module.experts == site.experts, name
                rows = np.arange(module.out_features) if piece.rows is None else piece.rows
                assert rows.shape == (module.out_features,), name
                filled[piece.site] += [(piece.part, r) for r in rows[rows >= 0]]
                assert rows.max() < site.out_features, name
        for site, rows in filled.items():
            assert rows and len(rows) == len(set(rows)), (config.model_type, site)


def test_architectures_decide_and_model_type_is_the_fallback():
    qwen2 = parse_config({**LLAMA_FIELDS, "architectures": ["Qwen2ForCausalLM"],
                          "model_type": "qwen2"})  # fmt: skip
    assert qwen2.qkv_bias and family_of(qwen2).name == "llama"
    # an unknown entry before a known one is skipped, as vLLM tries each
    both = {**LLAMA_FIELDS, "architectures": ["MyWrapper", "LlamaForCausalLM"],
            "model_type": "llama"}  # fmt: skip
    assert family_for_hf_config(both).name == "llama"
    assert parse_config({**LLAMA_FIELDS, "model_type": "mistral"}).model_type == "mistral"
    with pytest.raises(ValueError, match=r"architecture 'GPTNeoXForCausalLM'; supported: Llama"):
        parse_config({**LLAMA_FIELDS, "architectures": ["GPTNeoXForCausalLM"],
                      "model_type": "llama"})  # fmt: skip
    # the architecture's family must accept the model type
    with pytest.raises(ValueError, match=r"model_type 'gemma2'; supported: llama, mistral"):
        parse_config({**LLAMA_FIELDS, "architectures": ["LlamaForCausalLM"],
                      "model_type": "gemma2"})  # fmt: skip
    vl = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"}
    assert family_for_hf_config(vl).name == "gemma3_vl"
    qwen = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl"}
    assert family_for_hf_config(qwen).name == "qwen2_vl"
    with pytest.raises(ValueError, match="qwen2_5_vl config.json needs vision_config"):
        parse_config(qwen)
    with pytest.raises(ValueError, match="needs text_config and vision_config.*gemma3_text"):
        parse_config(vl)
    with pytest.raises(ValueError, match="comes with its own module"):
        family_of(tiny_config(model_type="custom"))


def test_refusals_name_setting_model_type_and_reason():
    check_feature(tiny_config(), "lora", "enable_lora")  # the Llama family: supported
    moe = dataclasses.replace(variant_config("mixtral"), num_experts=4)
    check_feature(moe, "lora", "enable_lora")  # the attention sites
    with pytest.raises(ValueError, match=r"^gguf is not supported for model_type "
                       r"'mixtral' \(llama family\): a mixture-of-experts GGUF"):  # fmt: skip
        check_feature(moe, "gguf_quantized", "gguf")
    # a family that declares no LoRA sites refuses LoRA, saying so
    bare = dataclasses.replace(family_of(tiny_config()), lora=None)
    assert bare.refusal("lora", tiny_config()) == "the family declares no LoRA sites"
    for model_type in ("gpt2", "opt", "bloom", "gemma2", "gemma3_text", "granite", "phi3"):
        check_feature(tiny_config(model_type=model_type), "lora", "enable_lora")
    check_feature(tiny_config(model_type="custom"), "lora", "enable_lora")  # yours: not ours
    with pytest.raises(ValueError, match="unknown feature 'speculative'"):
        family_of(tiny_config()).refusal("speculative", tiny_config())


def test_linears_agree_with_lora_sites_and_partition_metadata():
    """Each family's `Linear` declarations against its other declarations: every declared
    leaf's [L', out, in] view has the widths its LoRA sites declare (one site per product,
    or one site over all of them), its declared split is the partition metadata the module
    puts on the leaf's nnx.Param (what tensor parallelism reads), and the quantization and
    pre-quantized tables list exactly the declared leaves."""
    import math

    import numpy as np

    from jaxpaged.distributed.parallel import split_axes

    gemma = tiny_config(model_type="gemma2", layer_types=("sliding_attention", "full_attention"),
                        sliding_window=4, qkv_bias=False)  # fmt: skip
    configs = [tiny_config(), variant_config("gpt2"), tiny_config(model_type="bloom"),
               dataclasses.replace(variant_config("mixtral"), num_experts=4), gemma]  # fmt: skip
    for config in configs:
        family = family_of(config)
        layers, sites = family.param_shapes(config)["layers"], family.lora(config).sites
        axes = split_axes(config)
        assert axes["embed"] == 0, config.model_type
        declared = [lin for lin in family.linears if lin.leaf in layers]
        assert {lin.leaf for lin in family.linears} - set(layers) <= (
            {"w_gate_up", "w_down"} if config.num_experts else set()
        )
        for lin in declared:
            shape = layers[lin.leaf]
            view = lin.view(np.zeros(shape, np.int8))
            products = view.shape[0] // config.num_layers
            assert view.shape[0] * view.shape[1] * view.shape[2] == math.prod(shape)
            for site in lin.lora:
                assert sites[site].in_features == view.shape[2], (config.model_type, lin.leaf)
                outs = view.shape[1] * (products if len(lin.lora) == 1 else 1)
                assert sites[site].out_features == outs, (config.model_type, lin.leaf)
            assert axes.get(f"layers/{lin.leaf}") == lin.split, (config.model_type, lin.leaf)
        assert dict(family.matmul_weights) == {lin.leaf: lin.in_axes for lin in family.linears}
        assert set(family.prequantized_modules) <= {lin.leaf for lin in family.linears}
