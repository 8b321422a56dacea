"""Typed client errors: each keeps the gRPC status code and the server's message."""

from __future__ import annotations

import grpc


class SpecwireError(Exception):
    """A failed call: `code` is the gRPC status, `message` the server's readable explanation.

    Each status the services answer with has a subclass, so callers can catch `InvalidArgumentError` and the
    like. The code is keyword-only: only the base class needs it, for statuses without a subclass.
    """

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, *, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class InvalidArgumentError(SpecwireError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPreconditionError(SpecwireError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhaustedError(SpecwireError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class NotFoundError(SpecwireError):
    code = grpc.StatusCode.NOT_FOUND


class UnavailableError(SpecwireError):
    code = grpc.StatusCode.UNAVAILABLE


class UnauthenticatedError(SpecwireError):
    code = grpc.StatusCode.UNAUTHENTICATED


_BY_CODE = {cls.code: cls for cls in (InvalidArgumentError, FailedPreconditionError, ResourceExhaustedError,
                                      NotFoundError, UnavailableError, UnauthenticatedError)}


def from_rpc_error(err: grpc.RpcError) -> SpecwireError:
    code = err.code()
    cls = _BY_CODE.get(code, SpecwireError)
    return cls(err.details() or code.name, code=code)
