"""vLLM's development endpoints for sleep mode, served only when the environment variable
``VLLM_SERVER_DEV_MODE`` is true (as vLLM): ``POST /sleep?level=1`` frees the KV cache (level
2 also drops the weights) so a trainer can use the accelerator, ``POST /wake_up`` restores it
(reloading the weights after level 2), ``GET /is_sleeping`` says which. While asleep,
generation requests are refused with 503; sleeping is refused (400) while requests run."""

from __future__ import annotations

import os

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from jaxpaged.serving.errors import InvalidRequest
from jaxpaged.serving.frontend import Frontend

__all__ = ["add_dev_routes", "dev_mode"]


def dev_mode() -> bool:
    return os.environ.get("VLLM_SERVER_DEV_MODE", "").lower() in ("1", "true")


def add_dev_routes(app: FastAPI, frontend: Frontend) -> None:
    """The sleep-mode endpoints, in dev mode only (otherwise they do not exist: 404)."""
    if not dev_mode():
        return

    @app.post("/sleep")
    async def sleep(request: Request) -> Response:
        frontend.check_api_key(request.headers.get("authorization"))
        frontend.check_ready()
        level = request.query_params.get("level", "1")
        if level not in ("1", "2"):
            raise InvalidRequest(f"level must be 1 or 2, got {level!r}", param="level")
        try:
            await frontend.engine.sleep(int(level))
        except (RuntimeError, ValueError) as e:
            raise InvalidRequest(str(e)) from e
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(request: Request) -> Response:
        frontend.check_api_key(request.headers.get("authorization"))
        frontend.check_ready()
        try:
            await frontend.engine.wake_up()
        except (RuntimeError, ValueError) as e:
            raise InvalidRequest(str(e)) from e
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping(request: Request) -> JSONResponse:
        frontend.check_api_key(request.headers.get("authorization"))
        frontend.check_ready()
        return JSONResponse({"is_sleeping": frontend.engine.is_sleeping})
