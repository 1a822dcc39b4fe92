"""`python -m jaxpaged.generate`, `jaxpaged chat` and the functional `jaxpaged.generate()` (all
on the paged engine) against Hugging Face generate, on a tiny random Llama with a byte-level
tokenizer and a chat template, saved the way users save models."""

from __future__ import annotations

import argparse
import os
import pty
import re
import select
import subprocess
import sys
import threading
import time

import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

import jaxpaged
from jaxpaged import SamplingParams
from jaxpaged.cli import terminal
from jaxpaged.cli.chat import Conversation
from jaxpaged.cli.generate import main
from jaxpaged.models import load_model

BOS, EOS = 256, 257
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
PROMPT = "The quick brown fox jumps"  # 25 byte tokens: prefill padded to 32, cache of 64
# every engine of the module (the functional entry's, the terminal commands' in this process
# and in their subprocesses) has the terminal commands' shapes: one sequence, a pool of one
# max_model_len, so the persistent compile cache hands each the programs an earlier compiled
MAX_MODEL_LEN = 512


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
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=1,
        num_kv_blocks=MAX_MODEL_LEN // 16,
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
    proc = _run_cli(
        "--model", folder, "--max-model-len", str(MAX_MODEL_LEN), "--max-tokens", "12", "--chat",
        PROMPT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-3000:]
    assert proc.stdout.decode("utf-8") == want + "\n"


def test_cli_main_without_chat(tiny, capsys):
    hf, tokenizer, folder = tiny
    prompt_ids = encode_prompt(tokenizer, PROMPT, chat=False)
    assert prompt_ids == tokenizer(PROMPT)["input_ids"]
    want = tokenizer.decode(_hf_greedy(hf, prompt_ids, 12), skip_special_tokens=True)
    argv = ["--model", folder, "--max-model-len", str(MAX_MODEL_LEN), "--max-tokens", "12"]
    assert main([*argv, PROMPT]) == 0
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


def _tiny_args(folder: str, max_model_len: int) -> argparse.Namespace:
    return argparse.Namespace(
        model=folder, dtype=None, max_model_len=max_model_len, seed=None, verbose=False
    )


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_one_sequence_engine_stops_a_reply_and_reuses_the_prefix_cache(tiny):
    """The terminal commands' engine (one sequence, a pool of one max_model_len): a reply
    stopped mid-way frees its blocks; the next turns give HF's greedy tokens, and each one's
    prefill skips every full block the previous turn computed (the prefix-hit counter)."""
    hf, tokenizer, folder = tiny
    llm = terminal.one_sequence_llm(_tiny_args(folder, MAX_MODEL_LEN), owns_process=False)
    engine = llm.engine
    assert engine.layout.num_blocks == MAX_MODEL_LEN // 16
    greedy = terminal.sampling_params(argparse.Namespace(temperature=0.0, top_p=1.0, seed=None), 40)
    stop = threading.Event()
    pieces: list[str] = []

    def stop_after_two(text: str) -> None:
        pieces.append(text)
        if len(pieces) == 2:
            stop.set()

    chat = Conversation(llm)
    prompt = chat.prompt_for(PROMPT, reserve=1)
    stopped = terminal.stream_reply(engine, "r0", prompt, greedy, stop_after_two, stop)
    assert stopped.finish_reason == "abort" and 2 <= len(stopped.token_ids) < 40
    assert stopped.text == "".join(pieces)
    assert not engine.has_unfinished_requests()
    assert engine.get_stats().num_free_blocks == engine.layout.num_blocks
    chat.add_reply(PROMPT, stopped.text)

    fed: list[int] = []  # the tokens whose K/V the previous turn computed
    for i, text in enumerate(("and then?", "why?")):
        prompt = chat.prompt_for(text, reserve=1)
        stop.clear()
        reply = terminal.stream_reply(engine, f"r{i + 1}", prompt, greedy, lambda _: None, stop)
        assert list(reply.token_ids) == _hf_greedy(hf, prompt, len(reply.token_ids))
        assert reply.finish_reason in ("stop", "length") and reply.prompt_tokens == len(prompt)
        if fed:
            assert reply.prefix_hit_tokens == _common_prefix(fed, prompt) // 16 * 16 > 16
        fed = prompt + list(reply.token_ids[:-1])
        chat.add_reply(text, reply.text)
    assert engine.get_stats().num_free_blocks == engine.layout.num_blocks


def test_conversation_drops_the_oldest_turns_to_fit(tiny):
    """The chat's history through the template, one byte a token: the oldest exchanges go
    (whole, the system message stays) once the next prompt would not leave room for a
    reply; a message that cannot fit alone is a ValueError naming the limit."""
    _, tokenizer, _ = tiny

    class _Llm:  # what Conversation uses of an LLM
        engine = argparse.Namespace(max_model_len=100)

        def apply_chat_template(self, messages):
            return encode_prompt_messages(tokenizer, messages)

    chat = Conversation(_Llm(), system="be brief")
    first = chat.prompt_for("a" * 20, reserve=10)
    assert len(first) == len(encode_prompt_messages(tokenizer, [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "a" * 20}
    ]))  # fmt: skip
    chat.add_reply("a" * 20, "b" * 20)
    second = chat.prompt_for("c" * 20, reserve=10)  # too long with the first exchange
    assert len(second) <= 90 and chat.messages == []
    assert tokenizer.decode(second).count("be brief") == 1 and "a" * 20 not in tokenizer.decode(
        second
    )
    with pytest.raises(ValueError, match="max-model-len 100"):
        chat.prompt_for("d" * 95, reserve=10)


def encode_prompt_messages(tokenizer, messages) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)[
        "input_ids"
    ]


class _Terminal:
    """A command run on a pseudo-terminal that is its controlling terminal (so Ctrl-C is the
    tty's own SIGINT to it)."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.fd, tty = pty.openpty()
        # a new session whose controlling terminal is the pty, then the command itself
        # (a preexec_fn would run Python in a forked copy of this multithreaded process)
        become = (
            "import fcntl, os, sys, termios; os.setsid(); "
            "fcntl.ioctl(0, termios.TIOCSCTTY, 0); os.execv(sys.argv[1], sys.argv[1:])"
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", become, *argv], stdin=tty, stdout=tty, stderr=tty, env=env
        )
        os.close(tty)
        self.buffer = b""

    def _read(self, timeout: float) -> None:
        ready, _, _ = select.select([self.fd], [], [], timeout)
        assert ready, f"no output within {timeout:.0f} s; got {self.buffer[-2000:]!r}"
        self.buffer += os.read(self.fd, 65536)

    def read_until(self, marker: bytes, timeout: float = 240) -> bytes:
        deadline = time.monotonic() + timeout
        while marker not in self.buffer:
            self._read(max(0.0, deadline - time.monotonic()))
        end = self.buffer.index(marker) + len(marker)
        out, self.buffer = self.buffer[:end], self.buffer[end:]
        return out

    def read_some(self, timeout: float = 240) -> bytes:
        if not self.buffer:
            self._read(timeout)
        out, self.buffer = self.buffer, b""
        return out

    def send(self, data: bytes) -> None:
        os.write(self.fd, data)

    def close(self) -> int:
        """The exit status (the command is killed if it has not ended within 60 s)."""
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            os.close(self.fd)


SUMMARY = re.compile(
    rb"\[prompt (\d+) tokens, (\d+) from the prefix cache; (\d+) tokens.*; (\w+)\]"
)


def test_chat_in_a_terminal(tiny):
    """`jaxpaged chat` as a person uses it: a line, the reply streaming, Ctrl-C mid-reply
    stops it and the chat goes on, the next line is answered with the earlier turn's
    blocks from the prefix cache, /exit quits."""
    _, tokenizer, folder = tiny
    env = dict(os.environ, PYTHONIOENCODING="utf-8", JAX_PLATFORMS="cpu")
    argv = [sys.executable, "-m", "jaxpaged", "chat", "-v", "--model", folder]
    term = _Terminal([*argv, "--max-model-len", str(MAX_MODEL_LEN), "--max-tokens", "400"], env)
    try:
        term.read_until(b">>> ")
        line = b"Tell me about the quick brown fox and the lazy dog"
        term.send(line + b"\n")
        term.read_until(line + b"\r\n")  # the terminal's echo
        assert term.read_some()  # the reply's first piece, streamed
        term.send(b"\x03")
        out = term.read_until(b">>> ")
        assert b"[stopped]" in out and b"Traceback" not in out
        first = SUMMARY.search(out)
        assert first is not None and first.group(4) == b"abort", out
        prompt_1, generated_1 = int(first.group(1)), int(first.group(3))
        assert generated_1 < 400

        term.send(b"and then?\n")
        out = term.read_until(b">>> ")
        second = SUMMARY.search(out)
        assert second is not None and second.group(4) in (b"stop", b"length"), out
        prompt_2, hits_2 = int(second.group(1)), int(second.group(2))
        # the full blocks the two turns' prompts share (up to where the template renders the
        # first reply) are not computed again
        turn_1 = [{"role": "user", "content": line.decode()}]
        turn_2 = [*turn_1, {"role": "assistant", "content": "..."}, turn_1[0]]
        ids_1, ids_2 = (
            tokenizer.apply_chat_template(t, add_generation_prompt=True, tokenize=True)
            for t in (turn_1, turn_2)
        )
        assert len(ids_1["input_ids"]) == prompt_1 < prompt_2
        shared = _common_prefix(ids_1["input_ids"], ids_2["input_ids"])
        assert hits_2 >= shared // 16 * 16 >= 32
        term.send(b"/exit\n")
    finally:
        code = term.close()
    assert code == 0
