"""Errors that cross internal boundaries carry a status name; the gRPC edge maps it to a grpc.StatusCode."""

from __future__ import annotations

import enum


class ErrorCode(enum.Enum):
    """The subset of gRPC status codes the services answer with (same names as grpc.StatusCode)."""

    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    INTERNAL = 13
    UNAVAILABLE = 14
    CANCELLED = 1
    PERMISSION_DENIED = 7
    UNAUTHENTICATED = 16


class ServiceError(Exception):
    """A request-level failure inside the services, with a status code and a message meant for the caller.

    The gRPC edge turns it into a status (or a SequenceError on the Verify stream). The SDK's public
    `specwire.SpecwireError` is the client-side twin, built from the status that reaches the client.
    """

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"ServiceError({self.code.name}, {self.message!r})"


def invalid_argument(message: str) -> ServiceError:
    return ServiceError(ErrorCode.INVALID_ARGUMENT, message)
