"""What the pooling runner returns (vLLM's names): one embedding, score or class vector per
input, with the token ids the model saw."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class EmbeddingOutput:
    embedding: list[float]  # [D] (L2-normalised where the model's pooling says so)

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EmbeddingRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClassificationOutput:
    probs: list[float]  # [C] softmax of a cross-encoder's logits (sigmoid for one label)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClassificationRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScoringOutput:
    score: float  # a cross-encoder's relevance, or the cosine similarity of two embeddings


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScoringRequestOutput:
    request_id: str
    prompt_token_ids: list[int]  # the pair's tokens (a cross-encoder), else the two inputs'
    outputs: ScoringOutput
    finished: bool = True
