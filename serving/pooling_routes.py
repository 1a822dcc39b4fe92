"""The pooling runner over HTTP, as vLLM serves it: ``POST /v1/embeddings`` (OpenAI's
request and response), ``/pooling``, ``/score`` (and ``/v1/score``), ``/rerank`` (and
``/v1/rerank``, ``/v2/rerank``: Jina / Cohere's shape), ``/classify``.

A server whose model generates answers these with a 400 naming its runner, as a pooling
server answers completions and chat (engine/async_pooling.py)."""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Awaitable
from typing import Any, TypeVar

import numpy as np
from fastapi import FastAPI, Request

from jaxpaged.engine.protocol import EngineDeadError, PoolingClient
from jaxpaged.serving.errors import InvalidRequest, ServingError, Unavailable, field_of
from jaxpaged.serving.frontend import Frontend
from jaxpaged.serving.pooling_protocol import (
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from jaxpaged.serving.protocol import parse_body

T = TypeVar("T")

__all__ = ["NotPooling", "add_pooling_routes", "pooling_engine", "run_pooling"]


def _usage(token_ids: list[list[int]]) -> dict[str, int]:
    n = sum(len(t) for t in token_ids)
    return {"prompt_tokens": n, "total_tokens": n}


def _vector(values: list[float], encoding_format: str) -> list[float] | str:
    """OpenAI's two encodings: a list of floats, or base64 of little-endian float32."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode("ascii")
    return values


class NotPooling(ServingError):
    """A pooling call to a server whose model generates."""

    http_status = 400
    grpc_code = "FAILED_PRECONDITION"
    error_type = "invalid_request_error"


def pooling_engine(frontend: Frontend, endpoint: str) -> PoolingClient:
    """The server's pooling engine, once it is ready; NotPooling naming the runner of a
    server whose model generates."""
    frontend.check_ready()
    engine = frontend.engine
    if not isinstance(engine, PoolingClient):
        raise NotPooling(
            f"{endpoint} needs a pooling model (an encoder: `jaxpaged serve MODEL --runner "
            f"pooling`); model {frontend.config.served_model_name!r} runs the generate runner "
            "(completions and chat)"
        )
    return engine


async def run_pooling(frontend: Frontend, call: Awaitable[T]) -> T:
    """Awaits a pooling call: its bad input an InvalidRequest, its failure Unavailable."""
    try:
        return await call
    except EngineDeadError as e:
        frontend.mark_failed(e)
        raise Unavailable(f"server not ready: the engine failed ({e!r})") from e
    except ValueError as e:
        raise InvalidRequest(str(e), param=field_of(str(e))) from e


def add_pooling_routes(app: FastAPI, frontend: Frontend) -> None:
    """Adds the pooling endpoints to the server's app."""
    cfg = frontend.config

    async def admit(request: Request, model: type, endpoint: str) -> tuple[Any, PoolingClient]:
        """(body, the pooling engine): the API key, the body and its model name checked,
        the server ready and serving a pooling model."""
        frontend.check_api_key(request.headers.get("authorization"))
        body = parse_body(model, await request.body())
        names = (cfg.served_model_name, *cfg.served_model_aliases, cfg.model_path)
        if body.model is not None and body.model not in names:
            raise InvalidRequest(
                f"model {body.model!r} does not exist; this server serves "
                f"{cfg.served_model_name!r}",
                param="model",
            )
        return body, pooling_engine(frontend, endpoint)

    async def run(call: Awaitable[T]) -> T:
        return await run_pooling(frontend, call)

    def head(prefix: str) -> dict[str, Any]:
        return {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": cfg.served_model_name,
        }

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> dict:
        body, engine = await admit(request, EmbeddingRequest, "/v1/embeddings")
        outs = await run(
            engine.embed(
                body.inputs(),
                truncate_prompt_tokens=body.truncate_prompt_tokens,
                dimensions=body.dimensions,
                prompt_name=body.prompt_name,
            )
        )
        return {
            **head("embd"),
            "data": [
                {
                    "index": i,
                    "object": "embedding",
                    "embedding": _vector(o.outputs.embedding, body.encoding_format),
                }
                for i, o in enumerate(outs)
            ],
            "usage": _usage([o.prompt_token_ids for o in outs]),
        }

    @app.post("/pooling")
    async def pooling(request: Request) -> dict:
        """The model's pooled output per input: an embedding model's embedding, a
        cross-encoder's class probabilities."""
        body, engine = await admit(request, PoolingRequest, "/pooling")
        truncate = body.truncate_prompt_tokens
        if engine.is_classifier:
            classes = await run(engine.classify(body.inputs(), truncate_prompt_tokens=truncate))
            values, outs = [o.outputs.probs for o in classes], classes
        else:
            vectors = await run(engine.embed(body.inputs(), truncate_prompt_tokens=truncate))
            values, outs = [o.outputs.embedding for o in vectors], vectors
        return {
            **head("pool"),
            "data": [
                {"index": i, "object": "pooling", "data": _vector(v, body.encoding_format)}
                for i, v in enumerate(values)
            ],
            "usage": _usage([o.prompt_token_ids for o in outs]),
        }

    @app.post("/classify")
    async def classify(request: Request) -> dict:
        body, engine = await admit(request, PoolingRequest, "/classify")
        outs = await run(
            engine.classify(body.inputs(), truncate_prompt_tokens=body.truncate_prompt_tokens)
        )
        labels = engine.class_labels
        data = []
        for i, o in enumerate(outs):
            best = int(np.argmax(o.outputs.probs))
            data.append({"index": i, "label": labels[best] if labels else str(best),
                         "probs": o.outputs.probs, "num_classes": o.outputs.num_classes})  # fmt: skip
        return {**head("classify"), "data": data,
                "usage": _usage([o.prompt_token_ids for o in outs])}  # fmt: skip

    async def score(request: Request) -> dict:
        body, engine = await admit(request, ScoreRequest, request.url.path)
        outs = await run(
            engine.score(
                body.text_1, body.text_2, truncate_prompt_tokens=body.truncate_prompt_tokens
            )
        )
        return {
            **head("score"),
            "data": [
                {"index": i, "object": "score", "score": o.outputs.score}
                for i, o in enumerate(outs)
            ],
            "usage": _usage([o.prompt_token_ids for o in outs]),
        }

    async def rerank(request: Request) -> dict:
        body, engine = await admit(request, RerankRequest, request.url.path)
        outs = await run(
            engine.score(
                body.query, body.documents, truncate_prompt_tokens=body.truncate_prompt_tokens
            )
        )
        order = sorted(range(len(outs)), key=lambda i: -outs[i].outputs.score)
        if body.top_n:
            order = order[: body.top_n]
        results = []
        for i in order:
            r: dict[str, Any] = {"index": i, "relevance_score": outs[i].outputs.score}
            if body.return_documents:
                r["document"] = {"text": body.documents[i]}
            results.append(r)
        usage = _usage([o.prompt_token_ids for o in outs])
        return {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": cfg.served_model_name,
            "usage": {"total_tokens": usage["total_tokens"]},
            "results": results,
        }

    for path in ("/score", "/v1/score"):
        app.add_api_route(path, score, methods=["POST"])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.add_api_route(path, rerank, methods=["POST"])
