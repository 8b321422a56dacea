"""A service's ports over its life: a second service on a port in use fails to start instead of sharing it, and a
stopped service gives back its gRPC and metrics ports (services on threads of the test process, as the suite runs
them, and as any program that embeds one does)."""

from __future__ import annotations

import os
import socket
import sys

import pytest

from specwire.launch import free_port, scrape_metric

from stacks import InProcessStack


def _verifier_args(target_dir, metrics_port: int) -> list[str]:
    return ["verifier", "--model", str(target_dir), "--dtype", "float64", "--num-blocks", "16", "--block-size", "4",
            "--metrics-port", str(metrics_port)]


def _can_bind(port: int) -> bool:
    """Whether a server could listen on `port` now (SO_REUSEADDR, as servers set: a connection of the old one
    in TIME_WAIT does not count, a socket still listening does)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _listening_here(port: int) -> bool:
    """Whether a socket of this process listens on `port` (Linux: /proc/net/tcp* and this process's descriptors).
    Unlike a test bind, another test's service that took the port once it was free does not count (under xdist a
    `--port 0` service of the other worker may be given the very port a stopped one gave back)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port and inode in inodes:  # 0A: LISTEN
                return True
    return False


def test_a_second_verifier_on_a_port_in_use_fails_to_start(text_stack):
    """gRPC sets SO_REUSEPORT by default, under which both servers would bind the port and the kernel would split
    the drafts' connections between two verifiers; the services turn it off (wire.SERVER_OPTIONS)."""
    port = free_port()
    with InProcessStack() as stack:
        stack.start("first", _verifier_args(text_stack.target_dir, free_port()), port=port)
        # its address answers SERVING already (the first verifier): the start learns from the port file that the
        # second never bound it
        with pytest.raises(RuntimeError, match="before binding its port") as raised:
            stack.start("second", _verifier_args(text_stack.target_dir, free_port()), port=port)
        assert isinstance(raised.value.__cause__, OSError) and "cannot bind" in str(raised.value.__cause__)
        second = stack.services[-1]
        assert not second.thread.is_alive()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_stopped_verifier_gives_back_its_ports(text_stack):
    port, metrics_port = free_port(), free_port()
    with InProcessStack() as stack:
        stack.start("verifier", _verifier_args(text_stack.target_dir, metrics_port), port=port)
        assert scrape_metric(f"http://127.0.0.1:{metrics_port}/metrics", "specwire_kv_blocks_total") == 16
        assert _listening_here(metrics_port) and _listening_here(port)
    assert not _listening_here(metrics_port), "the metrics endpoint still holds its port"
    assert not _listening_here(port), "the gRPC server still holds its port"


def test_verifiers_on_port_0_name_the_ports_they_bound(text_stack):
    """The launchers start services with --port 0 and read the port back from --port-file: a port picked by the
    launcher and bound seconds later by the service could be taken in between (CI once saw a draft's clients
    answered UNIMPLEMENTED by another test's verifier on the port the draft was to bind)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with InProcessStack() as stack:  # no port given: --port 0 and a port file
        services = [stack.start(name, _verifier_args(text_stack.target_dir, free_port())) for name in ("a", "b")]
        ports = [int(s.address.rsplit(":", 1)[1]) for s in services]
        assert 0 not in ports and ports[0] != ports[1]
        for port in ports:
            assert not _can_bind(port)
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service="specwire.v1.Verifier"), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert all(s.error is None for s in services)


def test_a_scraped_sample_is_found_by_its_labels_in_any_order(monkeypatch):
    import io

    from specwire import launch

    page = ('# TYPE t_total counter\nt_total{pipelined="false",shape="branched"} 7.0\n'
            't_total{pipelined="true",shape="branched"} 2.0\nplain_more 4.0\nplain 3.0\n')
    monkeypatch.setattr(launch.urllib.request, "urlopen", lambda url, timeout: io.BytesIO(page.encode()))
    assert scrape_metric("u", "t_total", {"shape": "branched", "pipelined": "false"}) == 7.0
    assert scrape_metric("u", "t_total", {"pipelined": "true", "shape": "branched"}) == 2.0
    assert scrape_metric("u", "t_total", {"shape": "branched"}) is None  # exactly the labels given
    assert scrape_metric("u", "plain") == 3.0
    assert scrape_metric("u", "t_total") is None
