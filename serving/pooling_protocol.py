"""Request bodies of the pooling APIs, as vLLM names them: ``/v1/embeddings`` (OpenAI's
shape), ``/pooling``, ``/score`` and ``/rerank`` (Jina / Cohere's shape). Parsed strictly, as
the generation bodies are (serving/protocol.py): a wrong type or an unknown field is a 400
naming it."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = [
    "MAX_INPUTS",
    "EmbeddingRequest",
    "PoolingRequest",
    "RerankRequest",
    "ScoreRequest",
]

# the most inputs one request may carry (OpenAI's limit for /v1/embeddings)
MAX_INPUTS = 2048

# a single input: text or token ids; or a list of either
Input = str | list[str] | list[int] | list[list[int]]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    truncate_prompt_tokens: int | None = None  # -1: the model's limit; k: the first k tokens
    user: str | None = None  # kept for the caller's own records (no effect)


def _count(n: int, field: str) -> None:
    if n == 0:
        raise ValueError(f"{field} must not be empty")
    if n > MAX_INPUTS:
        raise ValueError(f"{field} has {n} items; at most {MAX_INPUTS} per request")


class _InputBody(_Body):
    input: Input
    encoding_format: Literal["float", "base64"] = "float"

    @field_validator("input")
    @classmethod
    def _inputs_in_bounds(cls, value: Input) -> Input:
        if isinstance(value, list):
            _count(len(value), "input")
        return value

    def inputs(self) -> list[str | list[int]]:
        """The inputs as a list: one string, one list of token ids, or a list of either."""
        v = self.input
        if isinstance(v, str) or (v and isinstance(v[0], int)):
            return [v]
        return list(v)


class EmbeddingRequest(_InputBody):
    dimensions: int | None = Field(default=None, strict=True)
    # one of the model's sentence-transformers prompts, put before each text input
    prompt_name: str | None = Field(default=None, strict=True)


class PoolingRequest(_InputBody):
    pass


class ScoreRequest(_Body):
    text_1: str | list[str]
    text_2: str | list[str]

    @field_validator("text_1", "text_2")
    @classmethod
    def _texts_in_bounds(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list):
            _count(len(value), "text")
        return value


class RerankRequest(_Body):
    query: str
    documents: list[str]
    top_n: int | None = None  # None or 0: every document
    return_documents: bool = True

    @field_validator("documents")
    @classmethod
    def _documents_in_bounds(cls, value: list[str]) -> list[str]:
        _count(len(value), "documents")
        return value

    @field_validator("top_n")
    @classmethod
    def _top_n_not_negative(cls, value: int | None) -> int | None:
        if value is not None and value < 0:
            raise ValueError(f"top_n must be >= 0, got {value}")
        return value
