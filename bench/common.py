"""Shared workload generation and statistics for the benchmarks.

Every system under test gets the very same token ids and output lengths: prompts are built
once (seeded), chat-formatted with the model's own tokenizer, and handed over as id lists, so
tokenization differences can never make one system's job easier than another's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Sequence
from typing import Any

__all__ = [
    "BenchRequest",
    "load_jsonl_workload",
    "make_workload",
    "summarize",
]

_TOPICS = (
    "the history of paged memory in operating systems",
    "how rivers shape mountain valleys",
    "the rules of chess for a beginner",
    "why the sky is blue",
    "how to bake sourdough bread",
    "the life cycle of stars",
    "what a compiler does",
    "how bees communicate",
    "the causes of ocean tides",
    "how to plan a long hike",
    "the basics of linear algebra",
    "the invention of the printing press",
)
_WORDS = (
    "river stone light memory cache block table token batch queue kernel matrix vector "
    "garden market harbor signal orbit planet engine letter window forest bridge music "
    "question answer summary detail example reason history future simple careful quick "
    "small large early late bright quiet heavy gentle sharp warm cold green blue golden"
).split()


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchRequest:
    """One request of a workload: chat messages, their token ids and the tokens to generate."""

    messages: tuple[dict[str, str], ...]
    prompt_token_ids: tuple[int, ...]
    max_tokens: int


def _chat_ids(tokenizer: Any, messages: Sequence[dict[str, str]]) -> list[int]:
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def make_workload(
    tokenizer: Any,
    *,
    num_prompts: int,
    seed: int = 0,
    min_prompt_words: int = 8,
    max_prompt_words: int = 300,
    min_output: int = 16,
    max_output: int = 256,
) -> list[BenchRequest]:
    """``num_prompts`` chat requests with a seeded mix of prompt lengths (a topic plus
    ``min_prompt_words..max_prompt_words`` filler words) and output lengths drawn uniformly
    from ``min_output..max_output``."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if not 1 <= min_output <= max_output:
        raise ValueError(f"output lengths: need 1 <= min_output <= max_output, got "
                         f"{min_output}..{max_output}")  # fmt: skip
    if not 0 <= min_prompt_words <= max_prompt_words:
        raise ValueError(f"prompt words: need 0 <= min <= max, got "
                         f"{min_prompt_words}..{max_prompt_words}")  # fmt: skip
    rng = random.Random(seed)
    out = []
    for _ in range(num_prompts):
        n_words = rng.randint(min_prompt_words, max_prompt_words)
        filler = " ".join(rng.choice(_WORDS) for _ in range(n_words))
        topic = rng.choice(_TOPICS)
        messages = (
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": f"Write a detailed essay about {topic}. Notes: {filler}"},
        )
        out.append(
            BenchRequest(
                messages=messages,
                prompt_token_ids=tuple(_chat_ids(tokenizer, messages)),
                max_tokens=rng.randint(min_output, max_output),
            )
        )
    return out


def load_jsonl_workload(
    path: str, tokenizer: Any, *, seed: int = 0, min_output: int = 16, max_output: int = 256
) -> list[BenchRequest]:
    """Requests from a JSONL file: each line has ``"prompt"`` (a string, sent as one user
    message) or ``"messages"`` (a chat), and optionally ``"max_tokens"`` (else drawn from
    ``min_output..max_output`` with ``seed``)."""
    rng = random.Random(seed)
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON: {e}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: each line must be a JSON object")
            if "messages" in row:
                messages = tuple(dict(m) for m in row["messages"])
            elif isinstance(row.get("prompt"), str):
                messages = ({"role": "user", "content": row["prompt"]},)
            else:
                raise ValueError(f"{path}:{lineno}: needs 'prompt' (string) or 'messages'")
            max_tokens = row.get("max_tokens", rng.randint(min_output, max_output))
            if not isinstance(max_tokens, int) or max_tokens < 1:
                raise ValueError(f"{path}:{lineno}: max_tokens must be a positive int")
            out.append(
                BenchRequest(
                    messages=messages,
                    prompt_token_ids=tuple(_chat_ids(tokenizer, messages)),
                    max_tokens=max_tokens,
                )
            )
    if not out:
        raise ValueError(f"{path}: no requests")
    return out


def _percentile(sorted_xs: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default) of already sorted values."""
    if not sorted_xs:
        return math.nan
    pos = (len(sorted_xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """mean / p50 / p99 / max of a list (NaN for an empty list)."""
    xs = sorted(float(v) for v in values)
    if not xs:
        return {"mean": math.nan, "p50": math.nan, "p99": math.nan, "max": math.nan}
    return {
        "mean": sum(xs) / len(xs),
        "p50": _percentile(xs, 50),
        "p99": _percentile(xs, 99),
        "max": xs[-1],
    }
