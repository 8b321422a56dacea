"""specwire: lossless speculative decoding split across the network.

The client SDK needs only grpcio, grpcio-health-checking and protobuf:

    import specwire
    with specwire.Client("127.0.0.1:50052") as client:
        result = client.generate("def fib(n):", max_tokens=64, temperature=0)
"""

from specwire.client import AsyncClient, Chunk, Client, Result, Stats
from specwire.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    SpecwireError,
    UnauthenticatedError,
    UnavailableError,
)

__all__ = [
    "AsyncClient", "Chunk", "Client", "Result", "Stats", "SpecwireError", "InvalidArgumentError",
    "FailedPreconditionError", "ResourceExhaustedError", "NotFoundError", "UnavailableError", "UnauthenticatedError",
]
__version__ = "0.1.0"
