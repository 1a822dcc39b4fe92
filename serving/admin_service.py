"""The gRPC service `jaxpaged.v1.Admin`: weight updates from a trainer in another process.

Off unless the server runs with ``--enable-weight-updates`` (``ServingConfig``): the service is
then registered beside Generation, behind the same API key; otherwise its calls answer
UNIMPLEMENTED. Status codes: INVALID_ARGUMENT (no path, a checkpoint that cannot be loaded or
whose weights differ in tree, shape or dtype; the engine keeps its weights and keeps serving),
UNAUTHENTICATED, UNAVAILABLE (loading, draining, engine dead), FAILED_PRECONDITION (an engine
that cannot load weights by path).
"""

from __future__ import annotations

import logging
import time

import grpc

from jaxpaged.serving import admin_pb2 as pb
from jaxpaged.serving import admin_pb2_grpc as pb_grpc
from jaxpaged.serving.errors import InvalidRequest, ServingError
from jaxpaged.serving.frontend import Frontend

__all__ = ["ADMIN_SERVICE_NAME", "AdminServicer", "add_admin_service"]

log = logging.getLogger("jaxpaged.serving")

ADMIN_SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Admin"].full_name  # "jaxpaged.v1.Admin"


class AdminServicer(pb_grpc.AdminServicer):
    def __init__(self, frontend: Frontend) -> None:
        self._frontend = frontend

    async def UpdateWeights(
        self, request: pb.UpdateWeightsRequest, context: grpc.aio.ServicerContext
    ) -> pb.UpdateWeightsResponse:
        frontend = self._frontend
        try:
            md = {k.lower(): v for k, v in (context.invocation_metadata() or ())}
            frontend.check_api_key(md.get("authorization"))
            frontend.check_ready()
            if not request.path:
                raise InvalidRequest("path: a checkpoint folder or file is required", param="path")
        except ServingError as e:
            await context.abort(getattr(grpc.StatusCode, e.grpc_code), e.message)
        engine = frontend.engine
        start = time.perf_counter()
        try:
            load_seconds = await engine.update_weights_from(request.path)
        except NotImplementedError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except (ValueError, OSError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{type(e).__name__}: {e}")
        total = time.perf_counter() - start
        log.info("weights updated from %s in %.2f s", request.path, total)
        return pb.UpdateWeightsResponse(
            load_seconds=load_seconds, swap_seconds=total - load_seconds
        )


def add_admin_service(frontend: Frontend, server: grpc.aio.Server) -> str:
    """Registers the Admin service on ``server``; returns its full name (for reflection)."""
    pb_grpc.add_AdminServicer_to_server(AdminServicer(frontend), server)
    return ADMIN_SERVICE_NAME
