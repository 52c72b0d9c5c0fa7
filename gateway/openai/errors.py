"""Errors in OpenAI's JSON shape: ``{"error": {"message", "type", "param", "code"}}``, with the
HTTP status the OpenAI reference (and the ``openai`` SDK's exception classes) give them."""
from __future__ import annotations

import grpc

# a gRPC status of the pipeline -> (HTTP status, OpenAI error type)
_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}


class ApiError(Exception):
    """A request that ends with an HTTP error status and an OpenAI error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code = param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def from_status(code: grpc.StatusCode, message: str) -> ApiError:
    """The ApiError of a pipeline's gRPC status (INTERNAL and anything unlisted: 500)."""
    status, kind = _BY_CODE.get(code, (500, "internal_error"))
    return ApiError(status, message, kind, code=code.name.lower())


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)
