"""Multi-LoRA against transformers + PEFT, on a tiny random Llama.

Random PEFT adapters of several ranks and target sets (lora_B drawn non-zero, so each changes
the outputs) are saved with ``save_pretrained``, in each form PEFT saves ``target_modules``:
module names, full module paths (an ``all-linear`` adapter, with a ``rank_pattern``), names
with ``layers_to_transform``, and a regex string. Requests with different adapters and none
share one engine batch, and every greedy output must equal what PEFT's model generates with
that adapter. More adapters than ``max_loras`` are in flight at once (requests wait for a
slot); loading and unloading adapters compiles nothing; prefix-cache keys include the
adapter; unsupported PEFT options are refused naming them.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import peft
import pytest
import torch
import transformers

from jaxpaged import LLM, LoRARequest, SamplingParams
from jaxpaged.engine import LLMEngine
from jaxpaged.models.loader import load_model
from jaxpaged.sched.lora_slots import LoraSlots

HF_CONFIG = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.1,
    max_position_embeddings=128,
)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> peft.LoraConfig options (lora_alpha: twice the rank)
ADAPTERS = {
    "r2qv": dict(r=2, target_modules=["q_proj", "v_proj"]),
    "r4all": dict(r=4, target_modules=ALL),
    "r8mlp": dict(
        r=8, target_modules=["o_proj", "gate_proj", "down_proj", "k_proj"], use_rslora=True
    ),
    # saved as the full paths of every linear ("model.layers.0.mlp.up_proj", ...)
    "linear": dict(r=4, target_modules="all-linear", rank_pattern={"down_proj": 2}),
    "layer1": dict(r=3, target_modules=["q_proj", "up_proj", "down_proj"], layers_to_transform=[1]),
    "regex": dict(r=2, target_modules=r"model\.layers\.0\.(self_attn\.[ko]_proj|mlp\.gate_proj)"),
}
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = [
    [3, 17, 40, 99, 5],
    list(range(20, 56)),  # 36 tokens: two full blocks of 16, prefix-cached
    [7, 7, 8, 9],
    [100, 2, 64, 31, 12, 1],
]


def _save_adapter(base: str, out: str, options: dict, seed: int):
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM.from_pretrained(base)
    config = peft.LoraConfig(lora_alpha=2 * options["r"], **options)
    model = peft.get_peft_model(model, config)
    for name, p in model.named_parameters():
        if "lora_" in name:
            torch.nn.init.normal_(p, std=0.3)
    model.save_pretrained(out)


def _peft_greedy(base: str, adapter: str | None, prompt: list[int]) -> list[int]:
    model = transformers.LlamaForCausalLM.from_pretrained(base).eval()
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


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(base model folder, adapter name -> folder, (adapter or None, prompt index) -> PEFT's
    greedy tokens)."""
    root = tmp_path_factory.mktemp("lora")
    torch.manual_seed(0)
    base = str(root / "base")
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_CONFIG)).save_pretrained(base)
    paths = {}
    for i, (name, options) in enumerate(ADAPTERS.items()):
        paths[name] = str(root / name)
        _save_adapter(base, paths[name], options, seed=i + 1)
    with open(os.path.join(paths["linear"], "adapter_config.json")) as f:
        saved = json.load(f)["target_modules"]
    assert "model.layers.0.mlp.up_proj" in saved and len(saved) == 14  # full paths
    want = {
        (name, i): _peft_greedy(base, None if name is None else paths[name], p)
        for name in [None, *ADAPTERS]
        for i, p in enumerate(PROMPTS)
    }
    return base, paths, want


@pytest.fixture(scope="module")
def llm(folders):
    base, paths, _ = folders
    config, params = load_model(base, progress=False)
    engine = LLMEngine.from_params(
        config,
        params,
        max_model_len=64,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        num_kv_blocks=48,
        show_progress=False,
        enable_lora=True,
        max_loras=2,  # three adapters: some requests must wait for a slot
        max_lora_rank=8,
        lora_modules={"r2qv": paths["r2qv"]},
    )
    yield LLM.from_engine(engine)
    engine.close()


def _request(paths, name):
    return None if name is None else LoRARequest(name, 1 + list(ADAPTERS).index(name), paths[name])


def _every_adapter_on_every_prompt(llm, paths):
    """Every adapter and none on every prompt, all in one generate call (one batch):
    (the (adapter, prompt index) cases, each case's greedy tokens)."""
    cases = [(name, i) for i in range(len(PROMPTS)) for name in [None, *ADAPTERS]]
    outs = llm.generate(
        [PROMPTS[i] for _, i in cases],
        GREEDY,
        lora_request=[_request(paths, name) for name, _ in cases],
        use_tqdm=False,
    )
    return cases, {case: list(o.outputs[0].token_ids) for case, o in zip(cases, outs, strict=True)}


def test_mixed_batch_equals_peft_and_compiles_nothing(llm, folders):
    _, paths, want = folders
    cases, got = _every_adapter_on_every_prompt(llm, paths)
    assert got == {case: want[case] for case in cases}
    # the adapters really change the outputs (otherwise the comparison proves little)
    for name in ADAPTERS:
        assert any(want[name, i] != want[None, i] for i in range(len(PROMPTS))), name
    stats = llm.engine.get_stats()
    assert stats.num_compilations_after_warmup == 0
    assert stats.num_kv_blocks == stats.num_free_blocks  # nothing leaked
    assert llm.engine.scheduler.lora_slots.num_holders("r4all") == 0


def test_prefix_cache_is_keyed_by_adapter(llm, folders):
    _, paths, want = folders
    llm.reset_prefix_cache()
    long = 1  # PROMPTS[1] has two full blocks
    # only the second r4all request finds its blocks: the others ran other adapters
    order = [("r4all", 0), (None, 0), ("r2qv", 0), ("r4all", 32)]
    for name, want_hits in order:
        hits = llm.engine.get_stats().prefix_cache_hits
        out = llm.generate(
            [PROMPTS[long]], GREEDY, lora_request=_request(paths, name), use_tqdm=False
        )
        assert list(out[0].outputs[0].token_ids) == want[name, long], name
        gained = llm.engine.get_stats().prefix_cache_hits - hits
        assert gained == want_hits, (name, gained)


def test_load_and_unload_at_run_time(llm, folders):
    base, paths, want = folders
    engine = llm.engine
    compiles = engine.get_stats().num_compilations
    new = LoRARequest("again", 7, paths["r8mlp"])
    assert engine.add_lora(new) is True
    assert engine.add_lora(new) is False  # the same name and folder: nothing to do
    with pytest.raises(ValueError, match="already loaded"):
        engine.add_lora(LoRARequest("again", 7, paths["r4all"]))
    out = llm.generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest("again", 7))
    assert list(out[0].outputs[0].token_ids) == want["r8mlp", 0]
    engine.remove_lora("again")
    assert "again" not in engine.list_loras()
    with pytest.raises(ValueError, match="not loaded"):
        engine.remove_lora("again")
    with pytest.raises(ValueError, match="no lora_path"):
        llm.generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest("again", 7))
    # in use: refused while a request with it is unfinished
    engine.add_request("busy", PROMPTS[0], GREEDY, lora_request=_request(paths, "r4all"))
    with pytest.raises(ValueError, match="in use"):
        engine.remove_lora("r4all")
    engine.abort("busy")
    assert engine.get_stats().num_compilations == compiles


def _edit_config(src: str, dst, **changes) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "adapter_config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(path, "w") as f:
        json.dump(cfg, f)
    return str(dst)


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        (dict(use_dora=True), "use_dora"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save"),
        (dict(bias="all"), "bias='all'"),
        (dict(target_modules=["q_proj", "lm_head"]), "lm_head"),
        (dict(r=32), "max_lora_rank=8"),
        (dict(target_parameters=["mlp.experts.gate_up_proj"]), "target_parameters"),
        (dict(fan_in_fan_out=True), "fan_in_fan_out=True"),
        (dict(target_modules=r"model\.layers\.7\..*"), "matches none of"),
        (dict(target_modules=["model.layers.0.mlp.up_proj", "model.embed_tokens"]), "embed_tokens"),
    ],
)
def test_unsupported_adapters_are_refused_by_name(llm, folders, tmp_path, changes, named):
    _, paths, _ = folders
    bad = _edit_config(paths["r4all"], tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=named.replace("[", r"\[")):
        llm.engine.add_lora(LoRARequest("bad", 9, bad))
    assert "bad" not in llm.engine.list_loras()


def test_lora_off_refuses_adapters_and_unsupported_settings(folders):
    base, paths, _ = folders
    config, params = load_model(base, progress=False)
    small = dict(max_model_len=32, num_kv_blocks=8, show_progress=False, enforce_eager=True)
    engine = LLMEngine.from_params(config, params, **small)
    try:
        with pytest.raises(ValueError, match="LoRA is not enabled"):
            engine.add_request("x", [1, 2], GREEDY, lora_request=_request(paths, "r2qv"))
    finally:
        engine.close()
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLMEngine.from_params(config, params, enable_lora=True, tensor_parallel_size=2, **small)
    with pytest.raises(ValueError, match="enable_lora"):
        LLMEngine.from_params(config, params, lora_modules=["a=" + paths["r2qv"]], **small)


def test_slots_lru_and_waiting():
    slots = LoraSlots(2)
    assert slots.acquire("a") == (1, True)
    assert slots.acquire("b") == (2, True)
    assert slots.acquire("a") == (1, False)  # resident: no load
    assert not slots.can_acquire("c")  # both held
    slots.release(1)
    assert not slots.can_acquire("c")  # "a" still has a holder
    slots.release(1)
    slots.release(2)  # now both idle; "a" went idle first
    assert slots.acquire("c") == (1, True)  # the least recently used idle slot
    assert slots.slot_of("a") is None and slots.slot_of("b") == 2
    assert slots.acquire("b") == (2, False)
    with pytest.raises(ValueError, match="in use"):
        slots.forget("b")
    slots.release(2)
    slots.forget("b")
    assert slots.resident == {"c": 1}


def test_dense_numpy_reference_of_the_fused_qkv(folders):
    """The fused q/k/v term equals PEFT's separate products (a numpy check of the layout)."""
    base, paths, _ = folders
    from safetensors.numpy import load_file

    from jaxpaged.models.lora import load_peft_adapter

    config, _ = load_model(base, progress=False)
    w = load_peft_adapter(paths["r4all"], config, max_rank=8, dtype=np.float32)
    raw = load_file(os.path.join(paths["r4all"], "adapter_model.safetensors"))
    x = np.random.default_rng(0).normal(size=(3, config.hidden_size)).astype(np.float32)
    a, b = w.sites["qkv"]
    fused = (x @ a[1].T @ b[1].T).reshape(3, config.num_kv_heads, -1, config.head_dim)
    prefix = "base_model.model.model.layers.1.self_attn."
    scale = 2.0  # lora_alpha / r

    def term(m):
        return x @ raw[prefix + m + ".lora_A.weight"].T @ raw[prefix + m + ".lora_B.weight"].T

    g = config.queries_per_kv
    q = fused[:, :, :g].reshape(3, -1)
    np.testing.assert_allclose(q, scale * term("q_proj"), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(fused[:, :, g].reshape(3, -1), scale * term("k_proj"), atol=1e-5)
    np.testing.assert_allclose(fused[:, :, g + 1].reshape(3, -1), scale * term("v_proj"), atol=1e-5)


@pytest.mark.skipif(
    os.environ.get("JAXPAGED_TEST_FULL") != "1",
    reason="an engine of its own (~45 s cold); JAXPAGED_TEST_FULL=1 runs it",
)
def test_adapters_with_ngram_speculation_equal_peft(folders):
    """Drafts verified under each row's adapter: a mixed batch of adapters with n-gram
    speculative decoding still gives PEFT's greedy tokens (last in the module: its engine's
    warm-up would count as the module engine's compilations)."""
    base, paths, want = folders
    config, params = load_model(base, progress=False)
    engine = LLMEngine.from_params(
        config, params, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
        num_kv_blocks=48, show_progress=False, enable_lora=True, max_loras=2, max_lora_rank=8,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                            "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                            "disable_by_batch_size": 8},
    )  # fmt: skip
    try:
        cases, got = _every_adapter_on_every_prompt(LLM.from_engine(engine), paths)
        assert got == {case: want[case] for case in cases}
        stats = engine.get_stats()
        assert stats.spec_decode_num_drafts > 0 and stats.num_compilations_after_warmup == 0
        assert stats.num_kv_blocks == stats.num_free_blocks
    finally:
        engine.close()
