"""bench/delay_proxy.py: bytes arrive intact and in order, no earlier than the configured one-way delay, no
faster than the bandwidth cap, and a half-close is passed on; gRPC runs through it."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent / "bench"))  # last: bench/kernels.py must not shadow kernels/

from delay_proxy import DelayProxy, LinkShape  # noqa: E402


async def _echo_server() -> asyncio.Server:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
        writer.write_eof()  # the client half-closed: so does the server, once everything is echoed
        writer.close()

    return await asyncio.start_server(echo, "127.0.0.1", 0)


async def _through_proxy(shape: LinkShape, payload_chunks: list[bytes]) -> tuple[bytes, float, float]:
    """(everything echoed back, seconds to the first echoed byte, seconds to the end)."""
    server = await _echo_server()
    port = server.sockets[0].getsockname()[1]
    proxy = DelayProxy(f"127.0.0.1:{port}", shape)
    await proxy.start()
    try:
        reader, writer = await asyncio.open_connection(*proxy.address.split(":"))
        t0 = time.perf_counter()
        for chunk in payload_chunks:
            writer.write(chunk)
        await writer.drain()
        writer.write_eof()
        first = await reader.read(1)
        t_first = time.perf_counter() - t0
        rest = await reader.read()  # until the echo server's EOF comes back through the proxy
        t_end = time.perf_counter() - t0
        writer.close()
        return first + rest, t_first, t_end
    finally:
        await proxy.close()
        server.close()


def test_bytes_arrive_intact_in_order_and_no_earlier_than_the_round_trip():
    chunks = [os.urandom(n) for n in (1, 7, 1000, 70_000, 3)]
    echoed, t_first, _ = asyncio.run(_through_proxy(LinkShape(delay_s=0.05), chunks))
    assert echoed == b"".join(chunks)
    assert t_first >= 0.1  # one way there, one way back


def test_the_bandwidth_cap_paces_the_bytes():
    payload = [os.urandom(200_000)]
    # 8 Mbit/s each way: 200 kB take 0.2 s to cross (the echo streams back while the rest still goes out)
    echoed, _, t_end = asyncio.run(_through_proxy(LinkShape(bandwidth_bps=8e6), payload))
    assert echoed == payload[0]
    assert t_end >= 0.2


def test_grpc_runs_through_the_proxy():
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    async def run() -> int:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        proxy = DelayProxy(f"127.0.0.1:{port}", LinkShape(delay_s=0.02))
        await proxy.start()
        try:
            async with grpc.aio.insecure_channel(proxy.address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)  # connection set up
                t0 = time.perf_counter()
                reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert time.perf_counter() - t0 >= 0.04
                return reply.status
        finally:
            await proxy.close()
            await server.stop(0)

    assert asyncio.run(run()) == 1  # SERVING
