"""Session fixtures' helpers: tiny model pairs on disk and verifier + draft processes on loopback."""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from specwire.launch import Service, Stack, free_port, scrape_metric


@dataclass
class RunningStack:
    stack: Stack
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
        stack's draft arguments, its own metrics port and `extra`: (the service, its metrics URL)."""
        metrics_port = free_port()
        args = [verifier if verifier and a == self.verifier else a for a in self.draft_args]
        i = args.index("--metrics-port")
        args[i + 1] = str(metrics_port)
        service = self.stack.start(name, [*args, *extra], log_dir=self.log_dir, timeout_s=120, env=self.env)
        return service, f"http://127.0.0.1:{metrics_port}/metrics"

    def stop_service(self, service: Service) -> None:
        service.stop()
        self.stack.services.remove(service)

def start_stack(target_dir: Path, draft_dir: Path, log_dir: Path, *, k: int = 4, dtype: str = "float64",
                block_size: int = 4, env: dict[str, str] | None = None, extra_verifier: list[str] = (),
                extra_draft: list[str] = (), verifier_credentials=None, draft_credentials=None) -> RunningStack:
    stack = Stack()
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
    except Exception:
        stack.stop()
        raise
    return RunningStack(stack, v.address, d.address, f"http://127.0.0.1:{metrics_port}/metrics",
                        f"http://127.0.0.1:{draft_metrics_port}/metrics", target_dir, draft_dir, log_dir,
                        verifier_args, draft_args, env)
