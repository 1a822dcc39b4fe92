"""PoolingEngine on the paged engine: a decoder's embeddings and scores (``runner="pooling"``
with last-token pooling) computed by pooling requests (engine/pooled_requests.py) in a
generation engine's steps, instead of the dense pooling runner (worker/pooling_runner.py).
A classifier's head (a ``*ForSequenceClassification`` score head, or an original
Qwen3-Reranker's "yes" less "no" vocabulary rows) is applied on the host to the hidden
states read back."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxpaged.args import EngineArgs
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.outputs import RequestOutput
from jaxpaged.worker.pooling_runner import PoolingModelInfo

__all__ = ["PagedPoolingWorker", "paged_pooling_worker"]


def paged_pooling_worker(
    args: EngineArgs,
    *,
    model_config: Any = None,  # noqa: ANN401 - with params: a decoder classifier's body
    params: Any = None,  # noqa: ANN401
    tokenizer: Any = None,  # noqa: ANN401
    head: Any = None,  # noqa: ANN401 - [C, D] the classifier head (None: embeddings)
) -> PagedPoolingWorker:
    """A paged engine over ``args.model`` (or over ``params`` already loaded, a classifier's
    body) and its worker; the engine warms up as a generation engine does."""
    # the checkpoint runs as the decoder it is (hf_overrides decided the head, given here)
    gen = dataclasses.replace(args, runner="generate", hf_overrides=None)
    if params is None:
        engine = LLMEngine.from_engine_args(gen)
    else:
        engine = LLMEngine.from_engine_args(
            dataclasses.replace(gen, model=None),
            model_config=model_config,
            params=params,
            tokenizer=tokenizer,
        )
    info = None
    if head is not None:
        head = np.asarray(jax.device_get(head), np.float32)
        info = PoolingModelInfo(classifier=True, num_labels=int(head.shape[0]))
    return PagedPoolingWorker(engine, head=head, info=info)


class PagedPoolingWorker:
    """PoolingEngine's worker on a paged engine: ``run`` adds every sequence as a pooling
    request, steps the engine until they are all done and returns their rows (the hidden
    state, or a classifier's logits through ``head``). Generation requests in the same
    engine advance in those steps; their outputs are kept in ``other_outputs``."""

    def __init__(
        self,
        engine: LLMEngine,
        *,
        head: np.ndarray | None = None,  # float32 [C, D] a classifier's head on the hidden state
        info: PoolingModelInfo | None = None,
    ) -> None:
        self.engine = engine
        self.head = None if head is None else np.asarray(head, np.float32)
        self.info = info or PoolingModelInfo()
        self.other_outputs: list[RequestOutput] = []
        self._ids = itertools.count()

    @property
    def params(self) -> Any:  # noqa: ANN401 - the engine's params tree
        return self.engine.runner.params

    @property
    def output_size(self) -> int:
        if self.head is not None:
            return int(self.head.shape[0])
        return self.engine.model_config.hidden_size

    @property
    def warmup_compilations(self) -> int:
        return self.engine.warmup_programs

    @property
    def num_compilations(self) -> int:
        return self.engine.get_stats().num_compilations

    @property
    def compilations_after_warmup(self) -> int:
        return self.engine.get_stats().num_compilations_after_warmup

    def run(
        self,
        sequences: Sequence[Sequence[int]],
        token_types: Sequence[Sequence[int] | None] | None = None,  # unused: one segment
    ) -> np.ndarray:  # float32 [N, output_size], in the order given
        del token_types
        engine = self.engine
        ids: list[str] = []
        try:
            for seq in sequences:
                rid = f"pool-{next(self._ids)}"
                engine.add_pooling_request(rid, list(seq))
                ids.append(rid)
        except Exception:
            for rid in ids:
                engine.abort(rid)
            raise
        rows: dict[str, np.ndarray] = {}
        while len(rows) < len(ids):
            self.other_outputs += engine.step()
            for rid in ids:
                if rid in rows:
                    continue
                done = engine.take_pooled(rid)
                if done is None:
                    continue
                if done.hidden is None:
                    for other in ids:
                        if other not in rows and other != rid:
                            engine.abort(other)
                            engine.take_pooled(other)
                    raise RuntimeError(f"pooling request {rid} failed: {done.error}")
                rows[rid] = done.hidden
        out = np.stack([rows[r] for r in ids]) if ids else np.zeros((0, self.output_size))
        if self.head is not None:
            out = out @ self.head.T
        return out.astype(np.float32)

    def close(self) -> None:
        self.engine.close()
