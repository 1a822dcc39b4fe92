"""LoRA adapters over HTTP, as vLLM serves them: a request picks an adapter by its ``model``
name, ``/v1/models`` lists the adapters (``parent``: the base model), and, when runtime
updating is allowed (``--allow-runtime-lora-updating`` or the environment variable
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=true``), ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter`` take ``{"lora_name": ..., "lora_path": ...}``."""

from __future__ import annotations

import json
import os
import time

from fastapi import FastAPI, Request
from fastapi.responses import Response

from jaxpaged.lora_request import LoRARequest
from jaxpaged.serving.errors import InvalidRequest, NotFound
from jaxpaged.serving.frontend import Frontend

__all__ = ["add_lora_routes", "lora_model_cards", "lora_of", "runtime_updates_allowed"]


def _loras(frontend: Frontend) -> dict[str, str]:
    """Registered adapter name -> folder ({} before the engine is attached, or with LoRA
    off)."""
    return {} if frontend.engine is None else dict(frontend.engine.list_loras())


def lora_of(frontend: Frontend, model: str | None) -> str | None:
    """The adapter a request's ``model`` names, or None (the base model, or an unknown
    name: the caller's model check refuses those)."""
    return model if model is not None and model in _loras(frontend) else None


def lora_model_cards(frontend: Frontend) -> list[dict]:
    """/v1/models entries of the registered adapters."""
    cfg = frontend.config
    return [
        {
            "id": name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "jaxpaged",
            "root": path,
            "parent": cfg.served_model_name,
        }
        for name, path in _loras(frontend).items()
    ]


def runtime_updates_allowed(frontend: Frontend) -> bool:
    env = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true")
    return frontend.config.allow_runtime_lora_updating or env


async def _body(request: Request, *, need_path: bool) -> tuple[str, str]:
    try:
        body = json.loads(await request.body() or b"{}")
    except ValueError as e:
        raise InvalidRequest(f"the body is not JSON: {e}") from e
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    name, path = body.get("lora_name"), body.get("lora_path", "")
    if not isinstance(name, str) or not name:
        raise InvalidRequest("lora_name: a non-empty string is required", param="lora_name")
    if need_path and (not isinstance(path, str) or not path):
        raise InvalidRequest("lora_path: a non-empty string is required", param="lora_path")
    return name, path


def add_lora_routes(app: FastAPI, frontend: Frontend) -> None:
    """The runtime load / unload endpoints, if allowed (otherwise they do not exist: 404)."""
    if not runtime_updates_allowed(frontend):
        return

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        frontend.check_api_key(request.headers.get("authorization"))
        name, path = await _body(request, need_path=True)
        frontend.check_ready()
        if name in _loras(frontend):
            raise InvalidRequest(f"The lora adapter '{name}' has already been loaded.")
        try:
            await frontend.engine.add_lora(LoRARequest(name, len(_loras(frontend)) + 1, path))
        except ValueError as e:
            raise InvalidRequest(str(e), param="lora_path") from e
        return Response(f"Success: LoRA adapter '{name}' added successfully.", status_code=200)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        frontend.check_api_key(request.headers.get("authorization"))
        name, _ = await _body(request, need_path=False)
        frontend.check_ready()
        if name not in _loras(frontend):
            raise NotFound(f"The lora adapter '{name}' cannot be found.", param="lora_name")
        try:
            await frontend.engine.remove_lora(name)
        except ValueError as e:
            raise InvalidRequest(str(e), param="lora_name") from e
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", status_code=200)
