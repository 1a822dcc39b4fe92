"""The gRPC ``Embed`` call (jaxpaged.v1.Generation): the pooling runner's embeddings, with
the same checks as ``/v1/embeddings`` (serving/pooling_routes.py)."""

from __future__ import annotations

from jaxpaged.serving import generation_pb2 as pb
from jaxpaged.serving.errors import InvalidRequest
from jaxpaged.serving.frontend import Frontend
from jaxpaged.serving.pooling_protocol import MAX_INPUTS
from jaxpaged.serving.pooling_routes import pooling_engine, run_pooling

__all__ = ["embed"]


async def embed(frontend: Frontend, request: pb.EmbedRequest) -> pb.EmbedResponse:
    """The embeddings of ``request.inputs``; ServingError (InvalidRequest, NotPooling,
    Unavailable) for what the server refuses."""
    engine = pooling_engine(frontend, "Embed")
    n = len(request.inputs)
    if n == 0 or n > MAX_INPUTS:
        raise InvalidRequest(f"inputs: give 1 to {MAX_INPUTS} inputs, got {n}", param="inputs")
    prompts: list[str | list[int]] = []
    for i, item in enumerate(request.inputs):
        kind = item.WhichOneof("input")
        if kind is None:
            raise InvalidRequest(f"inputs[{i}]: one of text or token_ids is required")
        prompts.append(item.text if kind == "text" else list(item.token_ids.ids))
    truncate = (
        request.truncate_prompt_tokens if request.HasField("truncate_prompt_tokens") else None
    )
    dimensions = request.dimensions if request.HasField("dimensions") else None
    outs = await run_pooling(
        frontend,
        engine.embed(prompts, truncate_prompt_tokens=truncate, dimensions=dimensions),
    )
    return pb.EmbedResponse(
        embeddings=[
            pb.Embedding(values=o.outputs.embedding, prompt_tokens=len(o.prompt_token_ids))
            for o in outs
        ],
        prompt_tokens=sum(len(o.prompt_token_ids) for o in outs),
    )
