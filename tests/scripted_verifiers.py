"""Helpers for tests that drive the draft's verifier link against scripted in-process verifiers."""

from __future__ import annotations

import asyncio
import time

import grpc

from specwire.v1 import verifier_pb2_grpc


async def serve_scripted(servicer: verifier_pb2_grpc.VerifierServicer) -> tuple[grpc.aio.Server, str]:
    """A gRPC server on a free loopback port with `servicer` as its Verifier: (server, address)."""
    server = grpc.aio.server()
    verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)
