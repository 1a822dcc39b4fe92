"""The pooling runner's inputs: texts through the tokenizer (with its special tokens) or
token ids, each checked (not empty, ids in the vocabulary, no longer than ``max_model_len``
unless ``truncate_prompt_tokens`` truncates it, on the tokenizer's truncation side), and
the text pairs of a score call."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxpaged.engine.protocol import Prompt

__all__ = ["PoolingInputs", "pairs", "prompt_list"]


def _is_token_ids(x: object) -> bool:
    return (
        isinstance(x, Sequence)
        and not isinstance(x, str)
        and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in x)
    )


def prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (a text or token ids) or a list of them, as a list."""
    if isinstance(prompts, str) or (_is_token_ids(prompts) and len(prompts) > 0):
        return [prompts]  # type: ignore[list-item]
    if not isinstance(prompts, Sequence):
        raise ValueError(f"prompts must be a string, token ids, or a list of them, got {prompts!r}")
    return list(prompts)


def pairs(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> tuple[list[str], list[str]]:
    """The (text_1, text_2) pairs of a score call: one text_1 goes with every text_2, else
    they pair in order; ValueError naming an empty or non-text one."""
    a = [text_1] if isinstance(text_1, str) else list(text_1)
    b = [text_2] if isinstance(text_2, str) else list(text_2)
    if not a or not b:
        raise ValueError("score needs at least one text on each side")
    if len(a) == 1:
        a = a * len(b)
    if len(a) != len(b):
        raise ValueError(
            f"score pairs text_1 with text_2: give one text_1, or as many as text_2 "
            f"({len(a)} text_1 for {len(b)} text_2)"
        )
    for side, texts in (("text_1", a), ("text_2", b)):
        for i, t in enumerate(texts):
            if not isinstance(t, str) or not t:
                raise ValueError(f"{side}[{i}] must be a non-empty string")
    return a, b


class PoolingInputs:
    """Tokenizes and checks one model's inputs; counts the tokens it let through."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int) -> None:  # noqa: ANN401
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
        self.prompt_tokens = 0

    def limit(self, truncate_prompt_tokens: int | None) -> int | None:
        """The length inputs are truncated to (None: refused when too long)."""
        t = truncate_prompt_tokens
        if t is None:
            return None
        if isinstance(t, bool) or not isinstance(t, int) or (t < 1 and t != -1):
            raise ValueError(
                f"truncate_prompt_tokens must be -1 (the model's limit) or >= 1, got {t!r}"
            )
        if t > self.max_model_len:
            raise ValueError(
                f"truncate_prompt_tokens ({t}) exceeds this model's maximum input length "
                f"({self.max_model_len} tokens)"
            )
        return self.max_model_len if t == -1 else t

    def _cut(self, ids: list[int], limit: int) -> list[int]:
        if len(ids) <= limit:
            return ids
        left = getattr(self.tokenizer, "truncation_side", "right") == "left"
        return ids[-limit:] if left else ids[:limit]

    def _check_length(self, i: int, n: int) -> None:
        if n > self.max_model_len:
            raise ValueError(
                f"input[{i}] has {n} tokens, more than this model's maximum input length of "
                f"{self.max_model_len} tokens; shorten it or set truncate_prompt_tokens"
            )

    def _check_ids(self, i: int, ids: Sequence[int]) -> list[int]:
        if len(ids) == 0:
            raise ValueError(f"input[{i}] is empty")
        vocab = self.vocab_size
        bad = [t for t in ids if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(
                f"input[{i}] has token id {int(bad[0])} outside this model's vocabulary "
                f"[0, {vocab})"
            )
        return [int(t) for t in ids]

    def tokenize(
        self, prompts: Sequence[Prompt], truncate_prompt_tokens: int | None = None
    ) -> list[list[int]]:
        """Token ids of each input (text through the tokenizer, with its special tokens);
        ValueError naming the first bad one."""
        if len(prompts) == 0:
            raise ValueError("input must not be empty")
        limit = self.limit(truncate_prompt_tokens)
        texts = {}
        out: list[list[int] | None] = [None] * len(prompts)
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if not p:
                    raise ValueError(f"input[{i}] is an empty string")
                texts[i] = p
            elif _is_token_ids(p):
                ids = self._check_ids(i, p)
                out[i] = ids if limit is None else self._cut(ids, limit)
            else:
                raise ValueError(f"input[{i}] must be a string or a list of token ids")
        if texts:
            kwargs = {} if limit is None else {"truncation": True, "max_length": limit}
            enc = self.tokenizer(list(texts.values()), **kwargs)["input_ids"]
            for i, ids in zip(texts, enc, strict=True):
                out[i] = list(ids)
        for i, ids in enumerate(out):
            self._check_length(i, len(ids))
        self.prompt_tokens += sum(len(ids) for ids in out)
        return out  # type: ignore[return-value]

    def pair_tokens(
        self, a: list[str], b: list[str], truncate_prompt_tokens: int | None
    ) -> tuple[list[list[int]], list[list[int]] | None]:
        """A cross-encoder's inputs: each pair as one sequence, with its segment ids."""
        limit = self.limit(truncate_prompt_tokens)
        kwargs = {} if limit is None else {"truncation": True, "max_length": limit}
        enc = self.tokenizer(a, b, **kwargs)
        ids = [list(x) for x in enc["input_ids"]]
        types = enc.get("token_type_ids")
        for i, x in enumerate(ids):
            self._check_length(i, len(x))
        self.prompt_tokens += sum(len(x) for x in ids)
        return ids, None if types is None else [list(t) for t in types]
