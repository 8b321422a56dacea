"""A TCP proxy that adds a one-way delay, and optionally a bandwidth cap, in each direction: the network between
a draft and a verifier on other hosts, on one machine (no netem needed). gRPC runs through it unchanged.

    python bench/delay_proxy.py --listen 127.0.0.1:6051 --target 127.0.0.1:50051 --rtt-ms 20
    specwire draft ... --verifier 127.0.0.1:6051

Each chunk read from one side is written to the other `delay` seconds after it arrived, in order. With a
bandwidth cap, chunks also queue behind one another as on a link of that rate: a chunk leaves the link
len*8/rate seconds after the previous one left (or after it arrived, if the link was idle), then travels
`delay`. The round-trip time is twice the one-way delay.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import threading
from dataclasses import dataclass

CHUNK_BYTES = 64 << 10


@dataclass(frozen=True)
class LinkShape:
    delay_s: float = 0.0  # one way
    bandwidth_bps: float | None = None  # bits per second; None: unlimited


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, shape: LinkShape) -> None:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def receive() -> None:
        link_free = 0.0
        while True:
            data = await reader.read(CHUNK_BYTES)
            now = loop.time()
            if shape.bandwidth_bps:
                link_free = max(link_free, now) + len(data) * 8 / shape.bandwidth_bps
                leaves = link_free
            else:
                leaves = now
            queue.put_nowait((leaves + shape.delay_s, data))
            if not data:
                return

    async def deliver() -> None:
        while True:
            due, data = await queue.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:  # the sender half-closed: pass it on
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()

    receiver = asyncio.create_task(receive())
    try:
        await deliver()
    finally:
        receiver.cancel()
        await asyncio.gather(receiver, return_exceptions=True)


class DelayProxy:
    """Listens on `listen_host:listen_port` (0: any free port) and forwards each connection to the target."""

    def __init__(self, target: str, shape: LinkShape, *, listen_host: str = "127.0.0.1",
                 listen_port: int = 0) -> None:
        host, _, port = target.rpartition(":")
        self._target = (host.strip("[]") or "127.0.0.1", int(port))
        self.shape = shape
        self._listen = (listen_host, listen_port)
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task] = set()

    @property
    def address(self) -> str:
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"{host}:{port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, *self._listen)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self._target)
        except OSError:
            client_writer.close()
            self._connections.discard(task)
            return
        try:
            await asyncio.gather(_pipe(client_reader, upstream_writer, self.shape),
                                 _pipe(upstream_reader, client_writer, self.shape))
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            for w in (client_writer, upstream_writer):
                w.close()
            self._connections.discard(task)


class ProxyThread:
    """A DelayProxy on its own event loop thread, for synchronous callers (benchmarks, tests)."""

    def __init__(self, target: str, shape: LinkShape) -> None:
        self._proxy = DelayProxy(target, shape)
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="delay-proxy", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._proxy.start())
        self._started.set()
        self._loop.run_forever()

    def __enter__(self) -> ProxyThread:
        self._thread.start()
        self._started.wait(10)
        return self

    @property
    def address(self) -> str:
        return self._proxy.address

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._proxy.close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to listen on")
    parser.add_argument("--target", required=True, help="HOST:PORT to forward to")
    parser.add_argument("--rtt-ms", type=float, default=0.0, help="added round-trip time (half each way)")
    parser.add_argument("--bandwidth-mbps", type=float, default=None, help="cap each direction (megabits/s)")
    args = parser.parse_args()
    host, _, port = args.listen.rpartition(":")
    shape = LinkShape(args.rtt_ms / 2000, args.bandwidth_mbps * 1e6 if args.bandwidth_mbps else None)

    async def serve() -> None:
        proxy = DelayProxy(args.target, shape, listen_host=host, listen_port=int(port))
        await proxy.start()
        print(f"{proxy.address} -> {args.target}: +{args.rtt_ms:g} ms RTT"
              + (f", {args.bandwidth_mbps:g} Mbit/s" if args.bandwidth_mbps else ""), flush=True)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())


if __name__ == "__main__":
    main()
