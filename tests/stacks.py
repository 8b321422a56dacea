"""Session fixtures' helpers: a verifier and a draft service on loopback, as child processes or on threads of the
test process.

Child processes (`Stack`) are what users run: the tests that kill, restart or pin a service, or read its logs or
its process environment, need them. Every other test needs only the protocol, and gets the same services, their
real gRPC servers and metrics endpoints, on threads of this process (`InProcessStack`): starting one costs no
interpreter, torch or transformers import, and no model module import after the first.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from specwire.launch import Service, Stack, free_port, port_file_for, scrape_metric, wait_started


@dataclass
class InProcessService:
    """A verifier or draft service running `serve(config, stop=...)` on its own event loop and thread."""

    name: str
    address: str
    thread: threading.Thread
    loop: asyncio.AbstractEventLoop | None = None
    stop_event: asyncio.Event | None = None
    error: BaseException | None = None
    proc: None = None  # no process to signal: kill and restart need a process stack

    def stop(self, timeout_s: float = 15.0) -> int:
        if self.loop is not None and self.stop_event is not None and self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.stop_event.set)
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise RuntimeError(f"{self.name} did not stop within {timeout_s:g}s")
        return 0

    def poll(self) -> int | None:
        """As Popen.poll for launch.wait_serving: None while it runs, else 1."""
        return None if self.thread.is_alive() else 1

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def log_text(self) -> str:
        # its logs go to the test process's own output: a check on them would pass vacuously
        raise NotImplementedError(f"{self.name} runs in the test process and has no log of its own: use a process "
                                  "stack to read a service's log")


def _serve_function(command: str):
    if command == "verifier":
        from verifier_service.config import VerifierConfig
        from verifier_service.server import serve
        return VerifierConfig, serve
    if command == "draft":
        from draft_service.config import DraftConfig
        from draft_service.server import serve
        return DraftConfig, serve
    raise ValueError(f"an in-process stack runs verifiers and drafts, not {command!r}")


@dataclass
class InProcessStack:
    """`Stack`'s interface for services on threads of this process, parsed from the same command lines."""

    services: list[InProcessService] = field(default_factory=list)

    def start(self, name: str, args: list[str], *, log_dir: Path | None = None, port: int | None = None,
              timeout_s: float = 120.0, env: dict[str, str] | None = None,
              credentials: grpc.ChannelCredentials | None = None) -> InProcessService:
        from common.config import config_from_args
        from specwire.cli import build_parser

        if env:
            raise ValueError("an in-process service shares the test process's environment: use a process stack")
        config_cls, serve = _serve_function(args[0])
        with port_file_for(args, port) as (port_args, port_file):
            parsed = build_parser().parse_args([*args, "--host", "127.0.0.1", *port_args])
            service = self._start_thread(name, config_from_args(config_cls, parsed), serve)
            try:
                service.address = wait_started(port_file, port, timeout_s, service, credentials)
            except Exception as err:
                raise RuntimeError(f"{name} failed to start: {err}") from service.error or err
        return service

    def _start_thread(self, name: str, config, serve) -> InProcessService:
        ready = threading.Event()
        service = InProcessService(name, "127.0.0.1:0", threading.Thread())

        async def main() -> None:
            service.loop, service.stop_event = asyncio.get_running_loop(), asyncio.Event()
            ready.set()
            await serve(config, stop=service.stop_event)

        def run() -> None:
            try:
                asyncio.run(main())
            except BaseException as err:  # noqa: BLE001 - reported by start() or seen as a dead service
                service.error = err
            finally:
                ready.set()

        service.thread = threading.Thread(target=run, name=f"in-process-{name}", daemon=True)
        service.thread.start()
        ready.wait()
        self.services.append(service)
        return service

    def stop(self) -> None:
        """Stop every service, the last started first, even when one fails to stop (the first failure is raised
        after the others have stopped)."""
        errors = []
        for service in reversed(self.services):
            try:
                service.stop()
            except Exception as err:  # noqa: BLE001 - raised below, once the rest are stopped
                errors.append(err)
        self.services.clear()
        if errors:
            raise errors[0]

    def __enter__(self) -> InProcessStack:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()



@dataclass
class RunningStack:
    stack: Stack | InProcessStack
    verifier: str
    draft: str
    metrics_url: str
    draft_metrics_url: str
    target_dir: Path
    draft_dir: Path
    log_dir: Path
    verifier_args: list[str] = field(default_factory=list)
    draft_args: list[str] = field(default_factory=list)
    env: dict[str, str] | None = None

    def service(self, name: str):
        return next(s for s in reversed(self.stack.services) if s.name == name)

    def kill(self, name: str) -> None:
        """SIGKILL: no graceful shutdown, no goodbye on any stream."""
        proc = self.service(name).proc
        assert proc is not None, "kill needs a process stack (start_stack(..., in_process=False))"
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def restart(self, name: str) -> None:
        """Start `name` again on its address, with its arguments (after kill)."""
        address = self.verifier if name == "verifier" else self.draft
        args = self.verifier_args if name == "verifier" else self.draft_args
        self.stack.start(name, args, log_dir=self.log_dir / f"{name}-restart-{time.monotonic_ns()}",
                         port=int(address.rsplit(":", 1)[1]), timeout_s=120, env=self.env)

    def wait_for_metric(self, name: str, value: float, *, draft: bool = False, timeout_s: float = 10.0) -> None:
        """Poll until the metric has `value` (a stream's teardown frees its blocks a moment after it ends)."""
        deadline = time.monotonic() + timeout_s
        while self.metric(name, draft=draft) != value and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.metric(name, draft=draft) == value, f"{name} stayed at {self.metric(name, draft=draft)}"

    def metric(self, name: str, *, draft: bool = False) -> float:
        value = scrape_metric(self.draft_metrics_url if draft else self.metrics_url, name)
        assert value is not None, f"{name} not in metrics"
        return value

    def start_draft(self, name: str, extra: list[str] = (), *, verifier: str | None = None) -> tuple[Service, str]:
        """Another draft service on this stack's verifier (or on `verifier`, a proxy in front of it), with the
        stack's draft arguments, its own metrics port and `extra`: (the service, its metrics URL). One that fails
        to start is stopped and leaves the stack, so a module's later tests do not run beside it."""
        metrics_port = free_port()
        args = [verifier if verifier and a == self.verifier else a for a in self.draft_args]
        i = args.index("--metrics-port")
        args[i + 1] = str(metrics_port)
        before = list(self.stack.services)
        try:
            service = self.stack.start(name, [*args, *extra], log_dir=self.log_dir, timeout_s=120, env=self.env)
        except Exception:
            for started in [s for s in self.stack.services if s not in before]:
                self.stop_service(started)
            raise
        return service, f"http://127.0.0.1:{metrics_port}/metrics"

    def stop_service(self, service: Service) -> None:
        service.stop()
        self.stack.services.remove(service)

def start_stack(target_dir: Path, draft_dir: Path, log_dir: Path, *, k: int = 4, dtype: str = "float64",
                block_size: int = 4, env: dict[str, str] | None = None, extra_verifier: list[str] = (),
                extra_draft: list[str] = (), verifier_credentials=None, draft_credentials=None,
                in_process: bool = False) -> RunningStack:
    """A verifier and a draft of the tiny pair; `in_process`: on threads of this process (see InProcessStack)."""
    stack = InProcessStack() if in_process else Stack()
    metrics_port, draft_metrics_port = free_port(), free_port()
    verifier_args = ["verifier", "--model", str(target_dir), "--dtype", dtype, "--max-draft-tokens", "8",
                     "--metrics-port", str(metrics_port), "--num-blocks", "256", "--block-size", str(block_size),
                     *extra_verifier]
    try:
        v = stack.start("verifier", verifier_args, log_dir=log_dir, timeout_s=120, env=env,
                        credentials=verifier_credentials)
        draft_args = ["draft", "--model", str(draft_dir), "--dtype", dtype, "--verifier", v.address,
                      "--num-speculative-tokens", str(k), "--block-size", str(block_size),
                      "--metrics-port", str(draft_metrics_port), *extra_draft]
        d = stack.start("draft", draft_args, log_dir=log_dir, timeout_s=120, env=env, credentials=draft_credentials)
    except Exception as start_error:
        try:
            stack.stop()
        except Exception as stop_error:  # noqa: BLE001 - the start failure is the one to report
            start_error.add_note(f"stopping the other services failed too: {stop_error!r}")
        raise
    return RunningStack(stack, v.address, d.address, f"http://127.0.0.1:{metrics_port}/metrics",
                        f"http://127.0.0.1:{draft_metrics_port}/metrics", target_dir, draft_dir, log_dir,
                        verifier_args, draft_args, env)
