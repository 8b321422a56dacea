"""The gateway's errors in OpenAI's JSON shape, and the mapping from gRPC status codes to HTTP statuses."""

from __future__ import annotations

import grpc


class ApiError(Exception):
    """An OpenAI-style error: HTTP status, `type`, message, and the offending parameter when there is one."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        # NOTE: a message may quote the caller's input; a lone surrogate in it would fail the UTF-8 encoding of
        # the JSON answer (a 500), so it is written as its escape.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        param = param.encode("utf-8", "backslashreplace").decode("utf-8") if param else param
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


# gRPC status -> (HTTP status, OpenAI error type)
_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
}


def from_grpc(code: grpc.StatusCode, message: str) -> ApiError:
    """The draft service's answer as the HTTP client sees it: its message, under the status its code maps to
    (500 server_error for the rest). 401 from the draft service is the gateway's own credentials' fault: 503."""
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return ApiError(503, f"the gateway's credentials were refused by the draft service: {message}",
                        type="service_unavailable_error")
    status, kind = _STATUS.get(code, (500, "server_error"))
    return ApiError(status, message, type=kind, code=code.name.lower())
