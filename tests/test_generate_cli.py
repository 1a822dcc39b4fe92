"""`python -m jaxpaged.generate` and the functional `jaxpaged.generate()` (both on the paged
engine) against Hugging Face generate, on a tiny random Llama with a byte-level tokenizer and a
chat template, saved the way users save models."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

import jaxpaged
from jaxpaged import SamplingParams
from jaxpaged.cli.generate import main
from jaxpaged.models import load_model

BOS, EOS = 256, 257
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
PROMPT = "The quick brown fox jumps"  # 25 byte tokens: prefill padded to 32, cache of 64


def _byte_tokenizer() -> transformers.PreTrainedTokenizerFast:
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({"<s>": BOS, "</s>": EOS})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF model, tokenizer, folder) of a tiny random Llama with tokenizer files."""
    torch.manual_seed(3)
    config = transformers.LlamaConfig(
        vocab_size=258,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=BOS,
        eos_token_id=EOS,
        initializer_range=0.1,
    )
    hf = transformers.LlamaForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("tiny-llama")
    hf.save_pretrained(folder)
    tokenizer = _byte_tokenizer()
    tokenizer.save_pretrained(folder)
    return hf, tokenizer, str(folder)


def _hf_greedy(hf, prompt_ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=EOS,
        )
    return out[0, len(prompt_ids) :].tolist()


def encode_prompt(tokenizer, prompt: str, *, chat: bool) -> list[int]:
    if chat:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
    return tokenizer(prompt)["input_ids"]


def _generate(params, config, tokenizer, prompt_ids, **sampling):
    """The functional entry on params already in memory (as JAX research code holds them)."""
    sampling.setdefault("temperature", 0.0)
    (out,) = jaxpaged.generate(
        [prompt_ids],
        SamplingParams(**sampling),
        params=params,
        config=config,
        tokenizer=tokenizer,
        max_model_len=128,
        num_kv_blocks=16,
        enforce_eager=True,
    )
    return list(out.outputs[0].token_ids)


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONIOENCODING="utf-8", JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "-m", "jaxpaged.generate", *args],
        capture_output=True,
        env=env,
        timeout=300,
    )


@pytest.mark.parametrize("chat", [False, True])
def test_functional_generate_greedy_matches_transformers(tiny, chat):
    hf, tokenizer, folder = tiny
    config, params = load_model(folder, dtype="float32", progress=False)
    prompt_ids = encode_prompt(tokenizer, PROMPT, chat=chat)
    assert len(prompt_ids) > 16  # prefill spans two blocks
    want = _hf_greedy(hf, prompt_ids, 24)
    assert _generate(params, config, tokenizer, prompt_ids, max_tokens=24) == want


def test_cli_subprocess_prints_only_the_generated_text(tiny):
    """The real entry point, as a user runs it: stdout is exactly HF's greedy text."""
    hf, tokenizer, folder = tiny
    prompt_ids = encode_prompt(tokenizer, PROMPT, chat=True)
    assert tokenizer.decode(prompt_ids).endswith("user: " + PROMPT + "\nassistant:")
    want = tokenizer.decode(_hf_greedy(hf, prompt_ids, 12), skip_special_tokens=True)
    proc = _run_cli("--model", folder, "--max-tokens", "12", "--chat", PROMPT)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-3000:]
    assert proc.stdout.decode("utf-8") == want + "\n"


def test_cli_main_without_chat(tiny, capsys):
    hf, tokenizer, folder = tiny
    prompt_ids = encode_prompt(tokenizer, PROMPT, chat=False)
    assert prompt_ids == tokenizer(PROMPT)["input_ids"]
    want = tokenizer.decode(_hf_greedy(hf, prompt_ids, 12), skip_special_tokens=True)
    assert main(["--model", folder, "--max-tokens", "12", PROMPT]) == 0
    assert capsys.readouterr().out == want + "\n"


def test_cli_rejects_bad_arguments(tiny, capsys):
    _, _, folder = tiny
    with pytest.raises(SystemExit) as exc:
        main(["--model", folder, "--max-tokens", "0", "hi"])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert "--max-tokens must be >= 1" in captured.err and captured.out == ""
    with pytest.raises(SystemExit):
        main(["--model", folder, "--temperature", "-0.5", "hi"])
    assert "--temperature must be >= 0" in capsys.readouterr().err
    missing = os.path.join(folder, "nope")
    with pytest.raises(FileNotFoundError, match=f"{missing}.*does not exist"):
        main(["--model", missing, "hi"])
    assert capsys.readouterr().out == ""
    assert main(["--model", folder, "--max-model-len", "8", "a prompt far too long"]) == 2
    captured = capsys.readouterr()
    assert "prompt" in captured.err and captured.out == ""


def test_sampling_is_seeded_and_varies(tiny):
    _, tokenizer, folder = tiny
    config, params = load_model(folder, dtype="float32", progress=False)
    prompt_ids = encode_prompt(tokenizer, PROMPT, chat=False)
    runs = [
        _generate(params, config, tokenizer, prompt_ids, max_tokens=12, temperature=1.5, seed=s)
        for s in (0, 0, 1)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    assert all(0 <= t < config.vocab_size for r in runs for t in r)
    greedy = _generate(params, config, tokenizer, prompt_ids, max_tokens=12)
    assert runs[0] != greedy and runs[2] != greedy
    with pytest.raises(ValueError, match="params and config"):
        jaxpaged.generate([prompt_ids], params=params)


def test_module_stays_callable_after_import():
    import jaxpaged.generate as module

    assert callable(jaxpaged.generate) and callable(module)
