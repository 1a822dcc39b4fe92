"""The tokenizer of a GGUF file, rebuilt with `tokenizers` from the vocabulary, merges and
token types in its metadata (byte-level BPE as GPT-2, or SentencePiece BPE), equal to the
tokenizer.json the file was converted from.

``g`` below is models/gguf.py's parsed file: ``g.metadata`` (key -> value) and ``g.path``.
"""

from __future__ import annotations

from typing import Any

# llama.cpp token types (llama_token_type).
_TOKEN_UNKNOWN = 2
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# Pre-tokenizer split patterns, keyed by `tokenizer.ggml.pre` (the names llama.cpp uses). Each
# reproduces the Hugging Face tokenizer.json the GGUF was converted from.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx", "pixtral")
_QWEN2_PRE = ("qwen2", "deepseek-r1-qwen", "megrez")
_GPT2_PRE = ("default", "gpt-2", "gpt2", "smollm", "starcoder", "refact")


def _scalar(g: Any, key: str, *, required: bool = True, default: Any = None) -> Any:
    if key in g.metadata:
        return g.metadata[key]
    if required:
        raise ValueError(f"GGUF file {g.path} lacks metadata key {key!r}")
    return default


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet of byte-level BPE vocabularies)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, (chr(c) for c in chars), strict=True))


def _byte_level_bpe(g: Any, tokens: list[str], types: list[int]) -> Any:
    """GPT-2 style byte-level BPE ('gpt2' in GGUF): SmolLM, Llama 3, Qwen2."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    merges = [tuple(m.split(" ", 1)) for m in _scalar(g, "tokenizer.ggml.merges")]
    pre = _scalar(g, "tokenizer.ggml.pre", required=False, default="default")
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        if types[i] not in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED) and not set(tok) <= alphabet:
            tok = "".join(spelling[b] for b in tok.encode("utf-8"))
        vocab.setdefault(tok, i)

    llama3_like = pre in _LLAMA3_PRE
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, ignore_merges=llama3_like, fuse_unk=False)
    )
    if llama3_like or pre in _QWEN2_PRE:
        split = _LLAMA3_SPLIT if llama3_like else _QWEN2_SPLIT
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(
                    add_prefix_space=False, trim_offsets=False, use_regex=False
                ),
            ]
        )
        if pre in _QWEN2_PRE:
            tok.normalizer = normalizers.NFC()
    elif pre in _GPT2_PRE:
        steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        if pre == "smollm":  # SmolLM's tokenizer splits every digit on its own first
            steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
        tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    else:
        raise ValueError(
            f"GGUF pre-tokenizer {pre!r} is not supported; supported: "
            f"{', '.join(sorted(_GPT2_PRE + _LLAMA3_PRE + _QWEN2_PRE))}"
        )
    tok.decoder = decoders.ByteLevel()
    return tok


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two vocab
    pieces, best-scored result first (what `sentencepiece` itself would merge)."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] == 1}
    found = []
    for tok, i in vocab.items():
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in vocab and right in vocab:
                found.append((-scores[i], vocab[left], vocab[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _sentencepiece_bpe(g: Any, tokens: list[str], types: list[int]) -> Any:
    """SentencePiece BPE with byte fallback ('llama' in GGUF): Llama 2, Mistral, TinyLlama.
    Like llama.cpp (and those models' own tokenizer.json), a space is prefixed to the text and to
    each piece that follows a special token."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    if "tokenizer.ggml.merges" in g.metadata:
        merges = [tuple(m.split(" ", 1)) for m in g.metadata["tokenizer.ggml.merges"]]
    else:
        scores = list(_scalar(g, "tokenizer.ggml.scores"))
        merges = _spm_merges(tokens, scores, types)
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    unk_id = _scalar(g, "tokenizer.ggml.unknown_token_id", required=False)
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            unk_token=tokens[unk_id] if unk_id is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    prefix = bool(_scalar(g, "tokenizer.ggml.add_space_prefix", required=False, default=True))
    steps = [normalizers.Replace(" ", "\u2581")]
    decode = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.insert(0, normalizers.Prepend("\u2581"))
        decode.append(decoders.Strip(" ", 1, 0))
    tok.normalizer = normalizers.Sequence(steps)
    tok.decoder = decoders.Sequence(decode)
    return tok


def build_tokenizer(g: Any) -> tuple[Any, dict[str, Any]]:
    """A `tokenizers.Tokenizer` equal to the one the GGUF was made from, and the names of its
    special tokens (for tokenizer_config.json)."""
    from tokenizers import AddedToken, processors

    kind = _scalar(g, "tokenizer.ggml.model")
    tokens: list[str] = list(_scalar(g, "tokenizer.ggml.tokens"))
    types = list(_scalar(g, "tokenizer.ggml.token_type", required=False, default=[1] * len(tokens)))
    if kind == "gpt2":
        tok = _byte_level_bpe(g, tokens, types)
        vocab = tok.get_vocab()
    elif kind == "llama":
        tok = _sentencepiece_bpe(g, tokens, types)
        vocab = tok.get_vocab()
    else:
        raise ValueError(
            f"GGUF tokenizer model {kind!r} is not supported; supported: 'gpt2' (byte-level "
            "BPE), 'llama' (SentencePiece BPE)"
        )
    # llama.cpp adds BOS for SentencePiece vocabularies unless the file says otherwise
    default_bos = kind == "llama"

    def name_of(key: str) -> str | None:
        idx = _scalar(g, f"tokenizer.ggml.{key}", required=False)
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    special = {
        "bos_token": name_of("bos_token_id"),
        "eos_token": name_of("eos_token_id"),
        "unk_token": name_of("unknown_token_id"),
        "pad_token": name_of("padding_token_id"),
    }
    added = [
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, types, strict=True)
        if ty in (_TOKEN_CONTROL, _TOKEN_UNKNOWN)
    ]
    tok.add_special_tokens(added)
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty == _TOKEN_USER_DEFINED
        ]
    )

    add_bos = bool(_scalar(g, "tokenizer.ggml.add_bos_token", required=False, default=default_bos))
    add_eos = bool(_scalar(g, "tokenizer.ggml.add_eos_token", required=False, default=False))
    bos, eos = special["bos_token"], special["eos_token"]
    if (add_bos and bos) or (add_eos and eos):

        def seq(piece: str, type_id: int) -> str:
            parts = [f"{bos}:{type_id}"] if add_bos and bos else []
            parts.append(f"{piece}:{type_id}")
            parts += [f"{eos}:{type_id}"] if add_eos and eos else []
            return " ".join(parts)

        used = {t: vocab[t] for t, on in ((bos, add_bos), (eos, add_eos)) if on and t}
        tok.post_processor = processors.TemplateProcessing(
            single=seq("$A", 0),
            pair=f"{seq('$A', 0)} {seq('$B', 1)}",
            special_tokens=list(used.items()),
        )
    elif kind == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    special["add_bos_token"] = add_bos
    special["add_eos_token"] = add_eos
    return tok, special


def eos_ids(g: Any) -> list[int]:
    """End-of-generation ids: eos plus llama.cpp's end-of-turn / end-of-message tokens."""
    ids = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        idx = _scalar(g, f"tokenizer.ggml.{key}", required=False)
        if idx is not None and idx not in ids:
            ids.append(int(idx))
    return ids
