"""Pooling requests on the paged engine (the engine side; engine/paged_pooling.py runs
PoolingEngine on them): a decoder used as an embedder (last-token pooling,
as Qwen3-Embedding and e5-mistral) or as a reranker (a score head on the last token) runs
its inputs as prefills in the generation engine's own steps.

A pooling request is a prompt with ``max_tokens=1``: it is scheduled, chunked, prefix-cached
and batched with generation requests exactly like one, and its final prefill chunk's step
returns, beside the sampled token (dropped), the final hidden state at the last prompt token
(``StepOutput.pooled``, read back only for such steps: no other program, no compilation).
The request then finishes as a one-token generation does, so its blocks go back to the
pool at once (the prefix cache may keep its full prompt blocks, as for any prompt).

:class:`PooledResults` keeps the engine's pooling requests apart from its generation
outputs (``LLMEngine.add_pooling_request`` / ``take_pooled``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container

import numpy as np

from jaxpaged.engine.core import EngineRequest
from jaxpaged.engine.input_processor import InputProcessor
from jaxpaged.engine.protocol import Prompt
from jaxpaged.outputs import RequestOutput, RequestOutputKind
from jaxpaged.sampling_params import SamplingParams

__all__ = ["PooledOutput", "PooledResults", "pooling_request"]

# one greedy token: the request finishes after its prompt (the token is never shown)
POOLING_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


def pooling_request(
    inputs: InputProcessor, request_id: str, prompt: Prompt, in_use: Container[str]
) -> EngineRequest:
    """A validated pooling request (ValueError naming the problem: an empty prompt, token
    ids outside the vocabulary, more than ``max_model_len - 1`` tokens)."""
    req = inputs.process(
        request_id,
        prompt,
        POOLING_PARAMS,
        output_kind=RequestOutputKind.FINAL_ONLY,
        in_use=in_use,
    )
    return dataclasses.replace(req, pooling=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PooledOutput:
    """A finished pooling request: its final hidden state at the last prompt token, or the
    error that ended it (aborted, or the engine failed)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    hidden: np.ndarray | None  # float32 [D]; None when it did not complete
    error: str | None = None


class PooledResults:
    """The engine's pooling requests: ids while they run, results once finished (until
    taken). Their step outputs never reach the engine's callers."""

    def __init__(self) -> None:
        self.running: set[str] = set()
        self.finished: dict[str, PooledOutput] = {}

    def add(self, request_id: str) -> None:
        self.running.add(request_id)

    def split(
        self, outputs: list[RequestOutput], hidden: dict[str, np.ndarray]
    ) -> list[RequestOutput]:
        """The generation outputs of a step; the pooling ones become results (their hidden
        states taken out of ``hidden``, the core's store)."""
        if not self.running:
            return outputs
        keep = []
        for out in outputs:
            rid = out.request_id
            if rid not in self.running:
                keep.append(out)
                continue
            if not out.finished:
                continue
            self.running.discard(rid)
            h = hidden.pop(rid, None)
            reason = out.outputs[0].finish_reason if out.outputs else None
            error = None
            if h is None or reason in ("abort", "error"):
                h, error = None, out.error or f"pooling request ended: {reason}"
            self.finished[rid] = PooledOutput(
                request_id=rid, prompt_token_ids=out.prompt_token_ids, hidden=h, error=error
            )
        return keep

    def forget(self, request_id: str, hidden: dict[str, np.ndarray]) -> None:
        """Drops an aborted request (and any hidden state it left in the core's store)."""
        self.running.discard(request_id)
        self.finished.pop(request_id, None)
        hidden.pop(request_id, None)

    def take(self, request_id: str) -> PooledOutput | None:
        """A finished request's result (once), None while it runs or if unknown."""
        return self.finished.pop(request_id, None)
