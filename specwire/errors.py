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
    """The request is malformed or out of range (an empty prompt, `top_p` outside (0, 1], `max_tokens` < 1, a
    prompt as long as the target's context, an unknown `wire_mode`). Fix the request; retrying does not help."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPreconditionError(SpecwireError):
    """The services cannot serve this request as configured: the draft and the target do not share a tokenizer,
    a resumed sequence's verifier now runs another model, or the verifier lacks a feature the request needs
    (`coupled`, `cache_salt`). Fix the deployment; retrying does not help."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhaustedError(SpecwireError):
    """A limit was reached: the verifier's `--max-streams`, `--max-sequences` or `--max-waiting-tokens`, or a
    prompt that can never fit the KV pool. The message names the flag. Retry later, or raise the limit."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class NotFoundError(SpecwireError):
    """The service does not know what the request names (a sequence that already ended)."""

    code = grpc.StatusCode.NOT_FOUND


class UnavailableError(SpecwireError):
    """Nothing answered: the draft service is not reachable within `connect_timeout`, or its verifier could
    not be reached (or a sequence resumed) within the draft's `--verifier-retry-deadline`. Safe to retry."""

    code = grpc.StatusCode.UNAVAILABLE


class UnauthenticatedError(SpecwireError):
    """The service refused the call's bearer token (missing, wrong, or not listed in its `--auth-token-file`),
    before any work was done."""

    code = grpc.StatusCode.UNAUTHENTICATED


_BY_CODE = {cls.code: cls for cls in (InvalidArgumentError, FailedPreconditionError, ResourceExhaustedError,
                                      NotFoundError, UnavailableError, UnauthenticatedError)}


def from_rpc_error(err: grpc.RpcError) -> SpecwireError:
    code = err.code()
    cls = _BY_CODE.get(code, SpecwireError)
    return cls(err.details() or code.name, code=code)
