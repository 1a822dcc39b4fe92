"""Multi-LoRA on every family against transformers + PEFT, on tiny random models.

Per family, two random PEFT adapters are saved as PEFT saves them: ``all-linear`` (full
module paths) and a few module names limited to one layer (``layers_to_transform``). One
engine batch mixes requests on each adapter and on none; every greedy output must equal
what PEFT's model generates with that adapter (or the base model without one). Mixture-of-
experts models: PEFT's ``all-linear`` there also targets the router's and the experts'
weights (``target_parameters``, as transformers 5 holds them); a parameter jaxpaged does not
map is refused by name.
"""

from __future__ import annotations

import json
import os
import shutil

import peft
import pytest
import torch
import transformers

from jaxpaged import LLM, LoRARequest, SamplingParams
from jaxpaged.engine import LLMEngine
from jaxpaged.models.loader import load_model
from jaxpaged.models.lora import load_peft_adapter

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = [[5, 17, 40, 99, 5, 23, 61, 8, 12, 70, 3], [7, 7, 8, 9]]
_LLAMA_SHAPE = dict(
    vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=128, initializer_range=0.1,
)  # fmt: skip
_GEMMA_SHAPE = dict(
    _LLAMA_SHAPE, num_hidden_layers=3, intermediate_size=96, sliding_window=8,
    query_pre_attn_scalar=24, pad_token_id=0, bos_token_id=2, eos_token_id=1,
)  # fmt: skip
S, F = "sliding_attention", "full_attention"
MOE = ("mixtral", "qwen3_moe")
# family -> (the tiny transformers model, the names of the adapter limited to layer 1)
FAMILIES = {
    # fused qkv_proj and gate_up_proj: one PEFT module fills two sites
    "phi3": (
        lambda: transformers.Phi3ForCausalLM(
            transformers.Phi3Config(**_LLAMA_SHAPE, intermediate_size=96, pad_token_id=0)
        ),
        ["qkv_proj", "gate_up_proj"],
    ),
    # a period (S, F) scanned, then one layer unrolled; soft caps that clip
    "gemma2": (
        lambda: transformers.Gemma2ForCausalLM(
            transformers.Gemma2Config(
                **_GEMMA_SHAPE, attn_logit_softcapping=2.0, final_logit_softcapping=3.0
            )
        ),
        ["q_proj", "down_proj"],
    ),
    "gemma3": (
        lambda: transformers.Gemma3ForCausalLM(
            transformers.Gemma3TextConfig(**_GEMMA_SHAPE, layer_types=[S, F, S])
        ),
        ["v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
    # Conv1D modules (PEFT saves fan_in_fan_out=True); "c_proj" names attn's and mlp's
    "gpt2": (
        lambda: transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                vocab_size=128,
                n_embd=64,
                n_layer=2,
                n_head=4,
                n_positions=128,
                initializer_range=0.1,
                bos_token_id=0,
                eos_token_id=0,
            )
        ),
        ["c_attn", "c_proj"],
    ),  # fmt: skip
    "opt": (
        lambda: transformers.OPTForCausalLM(
            transformers.OPTConfig(
                vocab_size=128,
                hidden_size=64,
                num_hidden_layers=2,
                ffn_dim=96,
                num_attention_heads=4,
                max_position_embeddings=128,
                word_embed_proj_dim=64,
                init_std=0.1,
                pad_token_id=1,
                bos_token_id=2,
                eos_token_id=2,
            )
        ),
        ["v_proj", "fc1"],
    ),  # fmt: skip
    "bloom": (
        lambda: transformers.BloomForCausalLM(
            transformers.BloomConfig(
                vocab_size=128,
                hidden_size=48,
                n_layer=2,
                n_head=6,
                initializer_range=0.2,
                bos_token_id=1,
                eos_token_id=2,
                pad_token_id=3,
            )
        ),
        ["query_key_value", "dense_4h_to_h"],
    ),  # fmt: skip
    "mixtral": (
        lambda: transformers.MixtralForCausalLM(
            transformers.MixtralConfig(
                **_LLAMA_SHAPE, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2
            )
        ),
        ["k_proj", "o_proj"],
    ),
    "qwen3_moe": (
        lambda: transformers.Qwen3MoeForCausalLM(
            transformers.Qwen3MoeConfig(
                **_LLAMA_SHAPE,
                intermediate_size=48,
                moe_intermediate_size=32,
                num_experts=4,
                num_experts_per_tok=2,
                decoder_sparse_step=1,
                mlp_only_layers=[],
            )
        ),
        ["q_proj", "v_proj"],
    ),  # fmt: skip
}


def _peft_greedy(base: str, adapter: str | None, prompt: list[int]) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    return out[0, len(prompt) :].tolist()


def _save_adapter(base: str, out: str, seed: int, **options) -> None:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, **options))
    for name, p in model.named_parameters():
        if "lora_" in name:
            torch.nn.init.normal_(p, std=0.3)
    model.save_pretrained(out)


# Qwen3-MoE's adapters map as Mixtral's do (experts' target_parameters, the router), its
# q/k norms as Qwen3's: JAXPAGED_TEST_FULL=1 runs it (~20 s)
_FULL_ONLY = () if os.environ.get("JAXPAGED_TEST_FULL") == "1" else ("qwen3_moe",)


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(n, marks=pytest.mark.skip(reason="JAXPAGED_TEST_FULL=1 runs it"))
        if n in _FULL_ONLY
        else n
        for n in FAMILIES
    ],
)
def family(request, tmp_path_factory):
    """(name, base folder, adapter name -> folder, (adapter or None, prompt) -> PEFT's tokens)."""
    name = request.param
    make, some = FAMILIES[name]
    root = tmp_path_factory.mktemp(name)
    torch.manual_seed(list(FAMILIES).index(name))
    base = str(root / "base")
    make().save_pretrained(base)
    paths = {"all": str(root / "all"), "some": str(root / "some")}
    _save_adapter(base, paths["all"], 1, target_modules="all-linear")
    _save_adapter(base, paths["some"], 2, target_modules=some, layers_to_transform=[1])
    want = {
        (adapter, i): _peft_greedy(base, paths.get(adapter), p)
        for adapter in (None, *paths)
        for i, p in enumerate(PROMPTS)
    }
    return name, base, paths, want


def test_mixed_batch_equals_peft(family):
    name, base, paths, want = family
    config, params = load_model(base, dtype="float32", progress=False)
    engine = LLMEngine.from_params(
        config, params, max_model_len=64, max_num_seqs=8, num_kv_blocks=24,
        show_progress=False, enforce_eager=True, enable_lora=True, max_loras=2,
        max_lora_rank=8, lora_modules=paths,
    )  # fmt: skip
    try:
        llm = LLM.from_engine(engine)
        cases = [(a, i) for i in range(len(PROMPTS)) for a in (None, *paths)]
        outs = llm.generate(
            [PROMPTS[i] for _, i in cases],
            GREEDY,
            lora_request=[None if a is None else LoRARequest(a, 1 + list(paths).index(a))
                          for a, _ in cases],
            use_tqdm=False,
        )  # fmt: skip
        got = {case: list(o.outputs[0].token_ids) for case, o in zip(cases, outs, strict=True)}
        assert got == {case: want[case] for case in cases}, name
        for adapter in paths:  # each adapter changes something (else the check proves little)
            assert any(want[adapter, i] != want[None, i] for i in range(len(PROMPTS))), adapter
        stats = engine.get_stats()
        assert stats.num_kv_blocks == stats.num_free_blocks
    finally:
        engine.close()


def test_experts_terms_matter_and_unknown_parameter_is_refused(family, tmp_path):
    """The router's and experts' terms change PEFT's output (so the mixed batch above, equal
    to it, computes them); a target parameter jaxpaged does not map is refused by name."""
    name, base, paths, want = family
    if name not in MOE:
        pytest.skip("not a mixture-of-experts model")
    from safetensors.torch import load_file, save_file

    shutil.copytree(paths["all"], tmp_path / "attention")
    weights = load_file(os.path.join(paths["all"], "adapter_model.safetensors"))
    weights = {k: v * 0 if ".mlp." in k else v for k, v in weights.items()}
    save_file(weights, tmp_path / "attention" / "adapter_model.safetensors")
    attention_only = [_peft_greedy(base, str(tmp_path / "attention"), p) for p in PROMPTS]
    assert attention_only != [want["all", i] for i in range(len(PROMPTS))]
    config, _ = load_model(base, dtype="float32", progress=False)
    with open(os.path.join(paths["all"], "adapter_config.json")) as f:
        cfg = json.load(f)
    assert "gate_up_proj" in cfg["target_parameters"]  # PEFT's all-linear targets the experts
    shutil.copytree(paths["all"], tmp_path / "bad")
    cfg["target_parameters"].append("mlp.shared_expert_gate.weight")
    with open(tmp_path / "bad" / "adapter_config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match=r"target_parameters \['mlp.shared_expert_gate.weight'\]"):
        load_peft_adapter(tmp_path / "bad", config, max_rank=4, dtype="float32")
