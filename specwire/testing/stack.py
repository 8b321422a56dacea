"""A verifier and a draft service (and optionally the OpenAI gateway) as child processes on loopback."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from specwire.client import AsyncClient, Client
from specwire.launch import Service, Stack, free_port, scrape_metric


@dataclass
class LocalStack:
    """Started by `LocalStack.start`; a context manager that stops every process it started."""

    target_dir: Path
    draft_dir: Path
    verifier: str  # HOST:PORT
    draft: str  # HOST:PORT: what Client connects to
    log_dir: Path | None = None
    verifier_metrics_url: str = ""  # Prometheus pages of both services
    draft_metrics_url: str = ""
    gateway_url: str | None = None  # http://HOST:PORT once start_gateway ran
    stack: Stack = field(default_factory=Stack)
    args: dict[str, list[str]] = field(default_factory=dict)  # each service's command line, for restart()

    @classmethod
    def start(cls, target_dir: Path, draft_dir: Path, *, log_dir: Path | None = None, k: int = 4,
              dtype: str = "float32", verifier_args: tuple[str, ...] = (), draft_args: tuple[str, ...] = (),
              timeout_s: float = 120.0) -> LocalStack:
        """Both services for these model directories; `k` draft tokens per round. Extra flags go to each."""
        stack = Stack()
        vm, dm = free_port(), free_port()
        args = {"verifier": ["verifier", "--model", str(target_dir), "--dtype", dtype, "--num-blocks", "512",
                             "--block-size", "16", "--metrics-port", str(vm), *verifier_args]}
        try:
            v = stack.start("verifier", args["verifier"], log_dir=log_dir, timeout_s=timeout_s)
            args["draft"] = ["draft", "--model", str(draft_dir), "--dtype", dtype, "--verifier", v.address,
                             "--num-speculative-tokens", str(k), "--metrics-port", str(dm), *draft_args]
            d = stack.start("draft", args["draft"], log_dir=log_dir, timeout_s=timeout_s)
        except Exception:
            stack.stop()
            raise
        return cls(Path(target_dir), Path(draft_dir), v.address, d.address, log_dir, f"http://127.0.0.1:{vm}/metrics",
                   f"http://127.0.0.1:{dm}/metrics", stack=stack, args=args)

    def kill(self, name: str) -> None:
        """SIGKILL "verifier" or "draft": no goodbye on any stream, as a crash or a lost host."""
        proc = self.service(name).proc
        proc.kill()
        proc.wait()

    def restart(self, name: str, timeout_s: float = 120.0) -> None:
        """Start "verifier" or "draft" again on its address with its arguments (after kill). A draft service
        reconnects to a restarted verifier by itself and resumes its sequences."""
        old = self.service(name)
        self.stack.services.remove(old)
        self.stack.start(name, self.args[name], log_dir=self.log_dir, timeout_s=timeout_s,
                         port=int(old.address.rsplit(":", 1)[1]))

    def metric(self, name: str, labels: dict[str, str] | None = None, *, draft: bool = False) -> float | None:
        """One Prometheus sample of the verifier (or, with draft, the draft service); None when absent."""
        return scrape_metric(self.draft_metrics_url if draft else self.verifier_metrics_url, name, labels)

    def wait_idle(self, timeout_s: float = 10.0) -> None:
        """Until no generation runs on the draft service and the verifier holds no KV block (a cancelled stream
        is torn down a moment after it ends). AssertionError naming what stayed busy."""
        deadline = time.monotonic() + timeout_s
        while True:
            active = self.metric("specwire_draft_active_generations", draft=True)
            blocks = self.metric("specwire_kv_blocks_used")
            if active == 0 and blocks == 0:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"still busy after {timeout_s:g}s: {active} active generations on the draft "
                                     f"service, {blocks} KV blocks used on the verifier")
            time.sleep(0.05)

    def client(self, **kwargs) -> Client:
        """A `specwire.Client` of the draft service; keyword arguments go to the client."""
        return Client(self.draft, **kwargs)

    def async_client(self, **kwargs) -> AsyncClient:
        """A `specwire.AsyncClient` of the draft service; keyword arguments go to the client."""
        return AsyncClient(self.draft, **kwargs)

    def service(self, name: str) -> Service:
        """The running "verifier", "draft" or "gateway" process: its address and `proc`."""
        return next(s for s in reversed(self.stack.services) if s.name == name)

    def start_gateway(self, *args: str, timeout_s: float = 60.0) -> str:
        """`specwire gateway` in front of the draft service, with the target's tokenizer (and chat template);
        returns its base URL (the OpenAI API is under /v1). Extra flags go to the gateway."""
        gateway = self.stack.start_gateway(self.draft, tokenizer=self.target_dir, args=args, log_dir=self.log_dir,
                                           timeout_s=timeout_s)
        self.gateway_url = gateway.address
        return gateway.address

    def stop(self) -> None:
        """Stop every process this stack started (the context manager does it on exit)."""
        self.stack.stop()

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
