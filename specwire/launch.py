"""Start specwire services as child processes on loopback and wait until their health service says SERVING (for
the HTTP gateway: until its /health says ok). Used by `specwire demo`, the benchmarks, specwire.testing and the
end-to-end tests."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

# NOTE: services started here share one host. OpenMP threads of an idle process spin-wait by default and take
# the cores the busy one needs: measured on 2 cores, a 0.5B draft token cost 280 ms beside an idle verifier
# against 142 ms alone; passive waiting brought it to 213 ms. Passive waiting also slows the busy process: the
# served 0.5B int4 step took 27.8-31.4 ms passive against 18.6-18.7 ms with GOMP_SPINCOUNT=10000. That short spin
# made the whole test suite, which runs many stacks side by side, take 820 s of wall and 16 min of CPU against
# 756 s and 13.6 min, so passive waiting stays the default here; set GOMP_SPINCOUNT for a benchmark. On top of
# that, a verifier and a draft started here without pinning split the cores (colocated_threads: --num-threads of
# each, together no more than the cores), so neither's OpenMP team waits for cores the other one holds.
_COLOCATED_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
_MODEL_SERVICES = ("verifier", "draft")  # the commands that take --num-threads


def colocated_threads(num_cores: int) -> dict[str, int]:
    """--num-threads of a verifier and a draft sharing `num_cores` cores: together no more than the cores (except
    on one core, where each still needs a thread). The draft gets a quarter (at least one): its steps are one or two
    tokens of the small model; the verifier, the rest: it runs k + 1 tokens of the large one per sequence."""
    draft = max(1, num_cores // 4)
    return {"verifier": max(1, num_cores - draft), "draft": draft}


def _thread_args(args: list[str], threads: int | None, child_env: dict[str, str]) -> list[str]:
    """`--num-threads` for a verifier or draft command: `threads` when given; else its colocated share of the
    cores this process may run on (each draft of a stack gets the draft's share), unless the command line or the
    child's environment already sets a count."""
    if not args or args[0] not in _MODEL_SERVICES:
        return []
    if threads is None:
        if any(a == "--num-threads" or a.startswith("--num-threads=") for a in args) or (
                {"SPECWIRE_NUM_THREADS", "OMP_NUM_THREADS"} & child_env.keys()):
            return []
        threads = colocated_threads(len(os.sched_getaffinity(0)))[args[0]]
    return ["--num-threads", str(threads)]


_random = random.Random()  # seeded from os.urandom: processes started alike draw differently


def _ephemeral_low() -> int:
    """The lowest port the OS hands out for port 0 and outgoing connections (Linux: ip_local_port_range)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port free now, for a server that binds it later (a metrics endpoint, a gateway): drawn at random below the
    range the OS hands out for port 0 and outgoing connections, so that neither a server started with --port 0
    nor a client's connection takes it in the meantime (two draws meet about once in 10,000)."""
    low = _ephemeral_low()
    if low > 12_000:
        for _ in range(64):
            port = _random.randrange(low - 10_000, low)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def port_file_for(args: list[str], port: int | None) -> Iterator[tuple[list[str], Path | None]]:
    """(port flags, port file) for a verifier or draft command: the service names the port it bound in the file
    (removed at the end), so that the launcher knows it is this service that listens there. With no port given it
    binds one the OS chooses: a port picked by the launcher and bound seconds later, once the model is loaded, can
    be taken in between by another process, whose server would then answer this one's clients. Other commands:
    ([], None)."""
    if not args or args[0] not in _MODEL_SERVICES:
        yield [], None
        return
    port_dir = Path(tempfile.mkdtemp(prefix="specwire-port-"))
    try:
        path = port_dir / "port"
        yield ["--port", str(port or 0), "--port-file", str(path)], path
    finally:
        shutil.rmtree(port_dir, ignore_errors=True)


def wait_port_file(path: Path, timeout_s: float, proc=None, *, expected: int | None = None) -> int:
    """The port a service started with `--port-file path` bound, once it has written it (`expected`: the one it was
    asked for, if any). `proc`: its Popen, or anything with poll() and returncode."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = path.read_text().strip() if path.exists() else ""
        if text:
            if expected and int(text) != expected:
                raise RuntimeError(f"the service bound port {text}, not {expected}")
            return int(text)
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the service exited with code {proc.returncode} before binding its port")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no port in {path} after {timeout_s:g}s")
        time.sleep(0.05)


def wait_started(address_or_port_file: str | Path, port: int | None, timeout_s: float, proc,
                 credentials: grpc.ChannelCredentials | None = None) -> str:
    """The address of a service once it serves: read from its port file (a Path, from port_file_for; `port`: the
    one it was asked for, if any), or given; then until its health service says SERVING, all within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    address = address_or_port_file
    if isinstance(address, Path):
        address = f"127.0.0.1:{wait_port_file(address, timeout_s, proc, expected=port)}"
    wait_serving(address, max(1.0, deadline - time.monotonic()), proc, credentials)
    return address


def scrape_samples(url: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of `name` on a Prometheus /metrics page, as (labels, value), from one fetch."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return [(dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(1) or "")), float(m.group(2)))
            for m in re.finditer(rf"^{re.escape(name)}(?:\{{(.*)\}})? ([0-9.e+-]+)$", text, re.M)]


def scrape_metric(url: str, name: str, labels: dict[str, str] | None = None) -> float | None:
    """One sample of a Prometheus /metrics page: `name` with exactly `labels`, in any order (None: absent)."""
    want = {k: str(v) for k, v in (labels or {}).items()}
    return next((value for got, value in scrape_samples(url, name) if got == want), None)


def wait_serving(address: str, timeout_s: float, proc: subprocess.Popen | None = None,
                 credentials: grpc.ChannelCredentials | None = None, *, service: str = "",
                 server_name: str | None = None) -> None:
    """Until the health service says SERVING for `service` ("" is the process; "specwire.v1.Draft" follows a
    draft's verifier link). `credentials` for a TLS server; `server_name`: the name its certificate is checked
    against, when that is not the address's host (a probe dialling 127.0.0.1 of a server named otherwise)."""
    deadline = time.monotonic() + timeout_s
    options = [("grpc.ssl_target_name_override", server_name)] if server_name and credentials else []
    channel = (grpc.secure_channel(address, credentials, options=options) if credentials
               else grpc.insecure_channel(address))
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"service for {address} exited with code {proc.returncode}")
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{address} not SERVING after {timeout_s}s")


@dataclass
class Service:
    name: str
    address: str
    proc: subprocess.Popen
    log_path: Path | None = None

    def stop(self, timeout_s: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""


def _log_file(log_dir: Path | None, name: str):
    """(path, writable file) for a child's output in log_dir, or (None, DEVNULL)."""
    if log_dir is None:
        return None, subprocess.DEVNULL
    log_dir.mkdir(parents=True, exist_ok=True)
    return log_dir / name, open(log_dir / name, "wb")  # noqa: SIM115 - closed when the process ends


@dataclass
class Stack:
    services: list[Service] = field(default_factory=list)

    def start(self, name: str, args: list[str], *, log_dir: Path | None = None, port: int | None = None,
              timeout_s: float = 300.0, env: dict[str, str] | None = None,
              credentials: grpc.ChannelCredentials | None = None, cpus: set[int] | None = None,
              threads: int | None = None) -> Service:
        """`cpus`: pin the process to these cores (and as many OpenMP threads), as if it had a host of its own.
        `threads`: a verifier's or draft's --num-threads; default: len(cpus) when pinned, else its share of this
        host's cores beside the other (colocated_threads), unless `args` or the environment set a count."""
        with port_file_for(args, port) as (port_args, port_file):
            if port_file is None:
                port = port or free_port()
                port_args = ["--port", str(port)]
            log_path, out = _log_file(log_dir, f"{name}.log")
            pinned = {"OMP_NUM_THREADS": str(len(cpus))} if cpus else {}
            child_env = {**_COLOCATED_ENV, **os.environ, **pinned, **(env or {})}
            if cpus and threads is None:
                threads = len(cpus)
            proc = subprocess.Popen([sys.executable, "-m", "specwire.cli", *args,
                                     *_thread_args(args, threads, child_env), "--host", "127.0.0.1", *port_args],
                                    stdout=out, stderr=subprocess.STDOUT, env=child_env,
                                    preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
            service = Service(name, f"127.0.0.1:{port or 0}", proc, log_path)
            self.services.append(service)
            try:
                service.address = wait_started(port_file or service.address, port, timeout_s, proc, credentials)
            except Exception as err:
                raise RuntimeError(f"{name} failed to start: {err}\n{service.log_text()[-4000:]}") from err
        return service

    def start_gateway(self, server: str, *, tokenizer: Path | None = None, args: tuple[str, ...] = (),
                      log_dir: Path | None = None, timeout_s: float = 60.0) -> Service:
        """`specwire gateway` in front of the draft service at `server`; the Service's address is its base URL."""
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log_path, out = _log_file(log_dir, f"gateway-{port}.log")
        cmd = [sys.executable, "-m", "specwire.cli", "gateway", "--server", server, "--host", "127.0.0.1", "--port",
               str(port), *(["--tokenizer", str(tokenizer)] if tokenizer else []), *args]
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**_COLOCATED_ENV, **os.environ})
        service = Service("gateway", url, proc, log_path)
        self.services.append(service)
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the gateway exited with code {proc.returncode}\n{service.log_text()[-4000:]}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as reply:
                    if json.load(reply).get("status") == "ok":
                        return service
            except (OSError, ValueError):  # not listening yet, or 503 while the draft connects
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not become healthy within {timeout_s:g}s\n"
                                   f"{service.log_text()[-4000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        for service in reversed(self.services):
            service.stop()
        self.services.clear()

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
