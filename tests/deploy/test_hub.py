"""Hub models, really downloaded: a hub on localhost (fake_hub.FakeHub, HF_ENDPOINT) serves a
tiny sharded Llama (two revisions, one gated copy) and the bundled GGUF; ``huggingface_hub``
downloads them once into the standard cache (HF_HUB_CACHE / HF_HOME) with a progress bar,
finds them there offline, resumes an interrupted download, and every failure says what to
do."""

from __future__ import annotations

import filecmp
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from fake_hub import Cut, FakeHub

from jaxpaged.models import ModelNotFoundError, load_model, resolve
from jaxpaged.models.bundled import bundled_gguf_path
from jaxpaged.models.resolve import resolve_model_folder

TINY = "jaxpaged-test/tiny-llama"
SMOL = "jaxpaged-test/SmolLM2-135M-Instruct"
GGUF = "jaxpaged-test/SmolLM2-135M-Instruct-GGUF"
GATED = "jaxpaged-test/gated-llama"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
CHUNK = 10 * 1024 * 1024  # huggingface_hub writes a download in chunks of this many bytes


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory, bundled_model_path) -> dict[str, Path]:
    """Two revisions of a 2-layer random Llama (hidden 64, SmolLM2's tokenizer) saved in
    shards; the embedding's shard (12.6 MB) is the one a download is cut in."""
    folders = {}
    for ref, seed in (("main", 0), ("v1", 1)):
        torch.manual_seed(seed)
        cfg = transformers.LlamaConfig(
            vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, initializer_range=0.1,
        )  # fmt: skip
        folder = tmp_path_factory.mktemp(f"tiny-{ref}")
        transformers.LlamaForCausalLM(cfg).save_pretrained(folder, max_shard_size="10MB")
        for name in TOKENIZER_FILES:
            src = Path(bundled_model_path) / name
            if src.is_file():
                (folder / name).write_bytes(src.read_bytes())
        folders[ref] = folder
    assert len(list(folders["main"].glob("model-*-of-*.safetensors"))) >= 2
    return folders


@pytest.fixture(scope="module")
def hub(tiny_folders, bundled_model_path):
    hub = FakeHub()
    hub.add(TINY, dict(tiny_folders))
    hub.add(GATED, {"main": tiny_folders["main"]}, token="hf_good")
    hub.add(SMOL, {"main": Path(bundled_model_path)})
    gguf = bundled_gguf_path()
    hub.add(
        GGUF, {"main": {gguf.name: gguf, "README.md": Path(bundled_model_path) / "config.json"}}
    )
    yield hub
    hub.close()


@pytest.fixture
def env(hub, tmp_path, monkeypatch) -> Path:
    """A fresh hub cache (HF_HUB_CACHE); the hub at HF_ENDPOINT."""
    for name in ("HF_TOKEN", "HF_HUB_OFFLINE", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    hub.requests.clear()
    return tmp_path / "hub"


def _same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in Path(a).iterdir())
    assert names == sorted(p.name for p in Path(b).iterdir())
    _, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert not mismatch and not errors


def test_download_once_then_from_the_cache_then_offline(hub, env, tiny_folders, capfd, monkeypatch):
    folder = resolve_model_folder(TINY)
    assert Path(folder).parent.parent == env / "models--jaxpaged-test--tiny-llama"
    _same_files(Path(folder), tiny_folders["main"])
    assert "Fetching" in capfd.readouterr().err  # huggingface_hub's progress bar
    shards = sorted(p.name for p in tiny_folders["main"].glob("*.safetensors"))
    assert all(hub.downloads(name) == [None] for name in shards)
    config, params = load_model(TINY, dtype="float32", progress=False)
    _, want = load_model(str(tiny_folders["main"]), dtype="float32", progress=False)
    np.testing.assert_array_equal(np.asarray(params["embed"]), np.asarray(want["embed"]))

    hub.requests.clear()  # online again: the revision is looked up, nothing downloaded
    assert resolve_model_folder(TINY) == folder
    assert not [r for r in hub.requests if "/resolve/" in r[1]]
    hub.requests.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline: not one request
    assert resolve_model_folder(TINY) == folder
    assert hub.requests == []


def test_hf_home_revision_and_download_dir(hub, env, tiny_folders, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    v1 = resolve_model_folder(TINY, revision="v1")
    assert Path(v1).is_relative_to(tmp_path / "hf-home" / "hub")
    _same_files(Path(v1), tiny_folders["v1"])
    assert any(r[1].endswith("/revision/v1") for r in hub.requests)
    elsewhere = resolve_model_folder(TINY, download_dir=tmp_path / "models")
    assert Path(elsewhere).is_relative_to(tmp_path / "models")
    _same_files(Path(elsewhere), tiny_folders["main"])
    with pytest.raises(ModelNotFoundError, match="has no revision 'v9'"):
        resolve_model_folder(TINY, revision="v9")


def test_gated_repo_needs_the_token_and_gets_it(hub, env, monkeypatch):
    with pytest.raises(ModelNotFoundError, match=r"gated and no token was sent.*HF_TOKEN"):
        resolve_model_folder(GATED)
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(ModelNotFoundError, match=r"gated and the token sent may not read it"):
        resolve_model_folder(GATED)
    monkeypatch.setenv("HF_TOKEN", "hf_good")
    hub.requests.clear()
    assert Path(resolve_model_folder(GATED), "config.json").is_file()
    repo_requests = [r for r in hub.requests if GATED in r[1]]
    assert repo_requests and {r[3] for r in repo_requests} == {"Bearer hf_good"}


def test_missing_repo_file_and_hub_say_so(hub, env, monkeypatch):
    with pytest.raises(ModelNotFoundError, match=r"'jaxpaged-test/nope' is not .* a hub repo"):
        resolve_model_folder("jaxpaged-test/nope")
    with pytest.raises(ModelNotFoundError, match=r"has no config.json .*:Q4_K_M"):
        resolve_model_folder(GGUF)
    with pytest.raises(ModelNotFoundError, match=r"no .gguf file matches 'Q8_0'"):
        resolve_model_folder(f"{GGUF}:Q8_0")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(ModelNotFoundError, match=r"unreachable and it is not in the hub cache"):
        resolve_model_folder(TINY)


def test_gguf_of_a_hub_repo_is_downloaded_and_imported(hub, env, monkeypatch):
    """REPO:QUANT and REPO:FILE.gguf name one file, which goes to the GGUF importer (the
    importer itself, 30 s on the bundled file here, is tested on its own)."""
    gguf = bundled_gguf_path()
    imported: list[Path] = []
    monkeypatch.setattr(resolve, "_import_gguf", lambda p: imported.append(p) or "converted")
    assert resolve_model_folder(f"{GGUF}:Q4_1") == "converted"
    assert resolve_model_folder(f"{GGUF}:{gguf.name}") == "converted"
    assert hub.downloads(gguf.name) == [None]  # once
    assert imported[0] == imported[1] and imported[0].name == gguf.name
    assert filecmp.cmp(imported[0], gguf, shallow=False)
    assert Path(imported[0]).is_relative_to(
        env / "models--jaxpaged-test--SmolLM2-135M-Instruct-GGUF"
    )


def _embedding_shard(folder: Path) -> str:
    return max(folder.glob("*.safetensors"), key=lambda p: p.stat().st_size).name


def test_interrupted_downloads_resume_or_restart_cleanly(hub, env, tiny_folders):
    """A connection dropped after one 10 MiB chunk of a shard: the same call resumes from
    there with an HTTP Range request. A process killed mid-download: the next one downloads
    the file whole (huggingface_hub >= 1.0 writes each download to a file of its own process
    and does not resume another's) and the cache ends up intact either way."""
    shard = _embedding_shard(tiny_folders["main"])
    assert (tiny_folders["main"] / shard).stat().st_size > CHUNK + 4096
    hub.cuts[shard] = Cut(at=CHUNK + 4096, mode="close")
    folder = resolve_model_folder(TINY)
    _same_files(Path(folder), tiny_folders["main"])
    assert hub.downloads(shard) == [None, f"bytes={CHUNK}-"]

    hub.requests.clear()
    hub.cuts[shard] = cut = Cut(at=CHUNK + 1024, mode="stall")
    # an earlier process (huggingface_hub alone: HF_ENDPOINT and HF_HUB_CACHE from the env)
    code = f"from huggingface_hub import snapshot_download as s; s({TINY!r}, revision='v1')"
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.DEVNULL)
    try:
        assert cut.done.wait(120), "the download did not reach the cut"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        cut.release.set()
    folder = resolve_model_folder(TINY, revision="v1")
    _same_files(Path(folder), tiny_folders["v1"])
    assert hub.downloads(shard) == [None, None]


def test_jaxpaged_generate_runs_a_hub_model_offline(hub, env, tiny_folders):
    """The console script on a hub id from the cache, offline: greedy text equals transformers'
    on the same checkpoint."""
    resolve_model_folder(TINY)  # download while online
    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_folders["main"]).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_folders["main"])
    prompt = "The capital of France is"
    ids = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        want = hf.generate(**ids, max_new_tokens=8, do_sample=False, pad_token_id=2)
    text = tokenizer.decode(want[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    hub.requests.clear()
    out = subprocess.run(
        [str(Path(sys.executable).with_name("jaxpaged")), "generate", "--model", TINY,
         "--max-tokens", "8", "--max-model-len", "256", prompt],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout == text + "\n"
    assert hub.requests == []
