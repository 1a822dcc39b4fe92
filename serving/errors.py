"""The errors a request can end with in the servers, each with its HTTP status, gRPC code
and OpenAI error type, so every route maps them one way."""

from __future__ import annotations

__all__ = [
    "EngineFailure",
    "InvalidRequest",
    "NotFound",
    "Overloaded",
    "ServingError",
    "Unauthenticated",
    "Unavailable",
    "field_of",
]


class ServingError(Exception):
    """A request the server refuses or cannot finish; each subclass has its status codes."""

    http_status = 500
    grpc_code = "INTERNAL"
    error_type = "server_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(ServingError):
    http_status = 400
    grpc_code = "INVALID_ARGUMENT"
    error_type = "invalid_request_error"


class Unauthenticated(ServingError):
    http_status = 401
    grpc_code = "UNAUTHENTICATED"
    error_type = "authentication_error"


class NotFound(ServingError):
    http_status = 404
    grpc_code = "NOT_FOUND"
    error_type = "not_found_error"


class Overloaded(ServingError):
    http_status = 429
    grpc_code = "RESOURCE_EXHAUSTED"
    error_type = "rate_limit_error"


class Unavailable(ServingError):
    http_status = 503
    grpc_code = "UNAVAILABLE"
    error_type = "service_unavailable"


class EngineFailure(ServingError):
    http_status = 500
    grpc_code = "INTERNAL"
    error_type = "server_error"


def field_of(message: str) -> str | None:
    """The field a SamplingParams / prompt ValueError names (its first word), for `param`."""
    word = message.split(" ", 1)[0].strip(":,")
    return word if word.isidentifier() else None
