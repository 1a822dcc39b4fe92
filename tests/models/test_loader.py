"""load_model: sharded and single safetensors, dtypes, the hub cache, per-leaf placement, and the
clear errors for bad inputs."""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from jaxpaged.models import (
    ModelNotFoundError,
    TensorError,
    compute_logits,
    forward,
    load_model,
    param_shapes,
    put_on_device,
    resolve_model_path,
)
from jaxpaged.models.loader import load_host_params
from jaxpaged.models.registry import load_config, parse_config

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.1,
)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """(HF Qwen2 model with qkv bias, single-file folder, two-shard folder)."""
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY)).eval()
    single = tmp_path_factory.mktemp("single")
    hf.save_pretrained(single)
    total = os.path.getsize(single / "model.safetensors")
    sharded = tmp_path_factory.mktemp("sharded")
    hf.save_pretrained(sharded, max_shard_size=int(total * 0.6))
    return hf, str(single), str(sharded)


def _leaves(params) -> dict[str, np.ndarray]:
    return {
        jax.tree_util.keystr(k): np.asarray(v)
        for k, v in jax.tree_util.tree_leaves_with_path(params)
    }


def test_two_shards_load_like_one_file_and_match_transformers(qwen2):
    hf, single, sharded = qwen2
    shards = sorted(f for f in os.listdir(sharded) if f.endswith(".safetensors"))
    assert len(shards) == 2 and os.path.isfile(
        os.path.join(sharded, "model.safetensors.index.json")
    )
    _, p1 = load_model(single, dtype="float32", progress=False)
    config, p2 = load_model(sharded, dtype="float32", progress=False)
    a, b = _leaves(p1), _leaves(p2)
    assert a.keys() == b.keys() and "['layers']['bqkv']" in a
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    tokens = np.arange(12) * 11 % 256
    hidden, _ = forward(p2, jnp.asarray(tokens, jnp.int32), jnp.arange(12), config=config)
    got = np.asarray(compute_logits(p2, hidden, config=config))
    with torch.no_grad():
        want = hf(torch.tensor(tokens[None])).logits[0].numpy()
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4


def test_fused_layout_matches_hf_tensors(qwen2):
    """Spot-check the documented layout: query head h of wqkv is HF q_proj rows h*hd..(h+1)*hd."""
    hf, single, _ = qwen2
    _, params = load_model(single, dtype="float32", progress=False)
    L = params["layers"]
    hd, g = 16, 2
    attn = hf.model.layers[1].self_attn
    q = attn.q_proj.weight.detach().numpy()  # [Hq * hd, D]
    for h in range(4):
        np.testing.assert_array_equal(L["wqkv"][1, h // g, h % g], q[h * hd : (h + 1) * hd])
    k = attn.k_proj.weight.detach().numpy()
    np.testing.assert_array_equal(L["wqkv"][1, 1, g], k[hd : 2 * hd])
    np.testing.assert_array_equal(L["bqkv"][1, 1, g + 1], attn.v_proj.bias.detach().numpy()[hd:])
    o = attn.o_proj.weight.detach().numpy()  # [D, Hq * hd]
    np.testing.assert_array_equal(L["wo"][1, :, 1, 0], o[:, 2 * hd : 3 * hd])
    mlp = hf.model.layers[0].mlp
    np.testing.assert_array_equal(L["w_gate_up"][0, 1], mlp.up_proj.weight.detach().numpy())
    np.testing.assert_array_equal(L["w_down"][0], mlp.down_proj.weight.detach().numpy())
    np.testing.assert_array_equal(params["lm_head"], hf.lm_head.weight.detach().numpy())


def test_dtypes(qwen2, tmp_path):
    hf, single, _ = qwen2
    for name, want in [("bfloat16", jnp.bfloat16), ("float16", jnp.float16), (None, jnp.float32)]:
        _, params = load_model(single, dtype=name, progress=False)
        assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(want)}, name
    with pytest.raises(ValueError, match="dtype: 'int8' is not one of float32, bfloat16, float16"):
        load_model(single, dtype="int8", progress=False)
    # A bfloat16 checkpoint is read without torch and widens exactly to float32.
    hf.to(torch.bfloat16).save_pretrained(tmp_path)
    hf.to(torch.float32)
    config, params = load_model(tmp_path, progress=False)
    assert config.torch_dtype == "bfloat16" and params["embed"].dtype == jnp.float32
    want = hf.model.embed_tokens.weight.detach().to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(np.asarray(params["embed"]), want)


def test_rope_theta_in_either_config_style():
    base = transformers.LlamaConfig(**TINY).to_dict()
    scaling = dict(
        rope_type="llama3",
        factor=4.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
    )
    old = {k: v for k, v in base.items() if k != "rope_parameters"}
    old.update(rope_theta=500000.0, rope_scaling=scaling)
    new = {k: v for k, v in base.items() if k not in ("rope_theta", "rope_scaling")}
    new["rope_parameters"] = {**scaling, "rope_theta": 500000.0}
    a, b = parse_config(old), parse_config(new)
    assert a == b and a.rope_theta == 500000.0 and a.rope_scaling.factor == 4.0


def test_put_on_device_places_each_leaf_with_its_sharding(qwen2):
    _, single, _ = qwen2
    config = load_config(single)
    host = load_host_params(single, config, np.dtype(np.float32), progress=False)
    device = jax.devices()[0]
    seen = {}

    def sharding_for(path, shape):
        seen[path] = shape
        return jax.sharding.SingleDeviceSharding(device)

    params = put_on_device(host, sharding_for)
    shapes = param_shapes(config)
    expected = {"embed", "final_norm", "lm_head"} | {f"layers/{k}" for k in shapes["layers"]}
    assert set(seen) == expected
    assert seen["layers/wqkv"] == shapes["layers"]["wqkv"] == (2, 2, 4, 16, 64)
    assert all(
        leaf.sharding == jax.sharding.SingleDeviceSharding(device)
        for leaf in jax.tree.leaves(params)
    )
    tree = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(device), host)
    params2 = put_on_device(host, tree)
    assert jax.tree.structure(params2) == jax.tree.structure(params)


def test_progress_bar_goes_to_stderr(qwen2, capsys):
    _, single, _ = qwen2
    load_model(single, dtype="float32")
    captured = capsys.readouterr()
    assert "loading weights" in captured.err and captured.out == ""


# ----------------------------------------------------------------------------- the hub


def _fake_hub_snapshot(cache: str, repo_id: str, src: str) -> str:
    """Lay out `src`'s files the way huggingface_hub caches a downloaded repo."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    os.makedirs(os.path.join(repo, "refs"))
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(commit)
    snapshot = os.path.join(repo, "snapshots", commit)
    shutil.copytree(src, snapshot)
    return snapshot


def test_hub_id_resolves_from_cache_offline(qwen2, tmp_path, monkeypatch):
    hf, single, _ = qwen2
    snapshot = _fake_hub_snapshot(str(tmp_path), "someorg/tiny-qwen2", single)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert os.path.samefile(resolve_model_path("someorg/tiny-qwen2"), snapshot)
    config, params = load_model("someorg/tiny-qwen2", dtype="float32", progress=False)
    assert config.model_type == "qwen2" and params["embed"].shape == (256, 64)


def test_offline_and_not_cached_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(
        ModelNotFoundError, match=r"'someorg/not-cached'.*HF_HUB_OFFLINE=1.*not in the hub cache"
    ):
        load_model("someorg/not-cached", progress=False)


# ----------------------------------------------------------------------------- bad inputs


def test_nonexistent_path_is_named(tmp_path):
    missing = str(tmp_path / "no" / "such-model")
    with pytest.raises(ModelNotFoundError, match=f"path '{missing}' does not exist"):
        load_model(missing)
    with pytest.raises(ValueError, match="'./nope' does not exist"):  # also a ValueError
        load_model("./nope")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path)


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def test_unknown_model_type_lists_supported(qwen2, tmp_path):
    folder = _copy(qwen2[1], tmp_path / "m")
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    cfg["model_type"] = "gpt_neox"
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(
        ValueError, match=r"model_type 'gpt_neox'; supported: llama, mistral, qwen2, qwen3, phi3"
    ):
        load_model(folder)


def _edit_weights(folder: str, edit) -> None:
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_missing_tensor_is_named(qwen2, tmp_path):
    folder = _copy(qwen2[1], tmp_path / "m")
    _edit_weights(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(
        TensorError,
        match=r"missing tensor 'model.layers.1.mlp.up_proj.weight' \(expected shape \(96, 64\)\)",
    ):
        load_model(folder, progress=False)


def test_misshaped_tensor_gives_both_shapes(qwen2, tmp_path):
    folder = _copy(qwen2[1], tmp_path / "m")
    name = "model.layers.0.self_attn.k_proj.weight"

    def shrink(t):
        t[name] = t[name][:16].clone()

    _edit_weights(folder, shrink)
    with pytest.raises(TensorError, match=rf"'{name}' has shape \(16, 64\), expected \(32, 64\)"):
        load_model(folder, progress=False)
