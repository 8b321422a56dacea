"""Session fixtures' helpers: tiny model pairs on disk and verifier + draft processes on loopback."""

from __future__ import annotations

import re
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from specwire.launch import Stack, free_port


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

    def wait_for_metric(self, name: str, value: float, *, draft: bool = False, timeout_s: float = 10.0) -> None:
        """Poll until the metric has `value` (a stream's teardown frees its blocks a moment after it ends)."""
        deadline = time.monotonic() + timeout_s
        while self.metric(name, draft=draft) != value and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.metric(name, draft=draft) == value, f"{name} stayed at {self.metric(name, draft=draft)}"

    def metric(self, name: str, *, draft: bool = False) -> float:
        url = self.draft_metrics_url if draft else self.metrics_url
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
        assert m, f"{name} not in metrics"
        return float(m.group(1))


def start_stack(target_dir: Path, draft_dir: Path, log_dir: Path, *, k: int = 4, dtype: str = "float64",
                block_size: int = 4, env: dict[str, str] | None = None, extra_verifier: list[str] = (),
                extra_draft: list[str] = ()) -> RunningStack:
    stack = Stack()
    metrics_port, draft_metrics_port = free_port(), free_port()
    try:
        v = stack.start("verifier", ["verifier", "--model", str(target_dir), "--dtype", dtype, "--max-draft-tokens",
                                     "8", "--metrics-port", str(metrics_port), "--num-blocks", "256",
                                     "--block-size", str(block_size), *extra_verifier], log_dir=log_dir, timeout_s=120,
                        env=env)
        d = stack.start("draft", ["draft", "--model", str(draft_dir), "--dtype", dtype, "--verifier", v.address,
                                  "--num-speculative-tokens", str(k), "--block-size", str(block_size),
                                  "--metrics-port", str(draft_metrics_port), *extra_draft],
                        log_dir=log_dir, timeout_s=120, env=env)
    except Exception:
        stack.stop()
        raise
    return RunningStack(stack, v.address, d.address, f"http://127.0.0.1:{metrics_port}/metrics",
                        f"http://127.0.0.1:{draft_metrics_port}/metrics", target_dir, draft_dir, log_dir)
