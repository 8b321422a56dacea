"""Drafts on other hosts, for real: the verifier and two draft services run as separate processes in separate
network namespaces, joined by veth pairs (each draft reaches the verifier at its own address), with mutual TLS
and bearer tokens on. A client in each draft's namespace generates through it; both get the target's greedy
output. Skipped, with the reason, where namespaces cannot be created (not root, no `ip`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tiny_models import greedy_continuation, make_text_pair

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "def fibonacci(n):"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _namespaces_available() -> str | None:
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"swprobe{uuid.uuid4().hex[:6]}"
    try:
        _ip("netns", "add", probe)
        _ip("netns", "del", probe)
    except subprocess.CalledProcessError as err:
        return f"`ip netns add` failed: {err.stderr.decode().strip()}"
    return None


class Hosts:
    """Namespaces `<tag>v` (verifier), `<tag>a` and `<tag>b` (drafts); veth pairs 10.77.1.0/24 (verifier-a)
    and 10.77.2.0/24 (verifier-b)."""

    def __init__(self) -> None:
        self.tag = f"sw{uuid.uuid4().hex[:5]}"
        self.procs: list[subprocess.Popen] = []
        self.names = [self.tag + s for s in "vab"]

    def __enter__(self) -> Hosts:
        for name in self.names:
            _ip("netns", "add", name)
            _ip("-n", name, "link", "set", "lo", "up")
        v = self.names[0]
        for i, draft in enumerate(self.names[1:], start=1):
            near, far = f"{self.tag}{i}v", f"{self.tag}{i}d"
            _ip("link", "add", near, "type", "veth", "peer", "name", far)
            _ip("link", "set", near, "netns", v)
            _ip("link", "set", far, "netns", draft)
            _ip("-n", v, "addr", "add", f"10.77.{i}.1/24", "dev", near)
            _ip("-n", draft, "addr", "add", f"10.77.{i}.2/24", "dev", far)
            _ip("-n", v, "link", "set", near, "up")
            _ip("-n", draft, "link", "set", far, "up")
        return self

    def run(self, host: str, args: list[str], log: Path | None = None) -> subprocess.Popen:
        out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(["ip", "netns", "exec", self.tag + host, sys.executable, *args], stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
        self.procs.append(proc)
        return proc

    def wait_healthy(self, host: str, address: str, tls: list[str], proc: subprocess.Popen, log: Path) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"service in {host} exited:\n{log.read_text()[-3000:]}"
            check = subprocess.run(["ip", "netns", "exec", self.tag + host, sys.executable, "-m",
                                    "specwire.healthcheck", address, "2", *tls], capture_output=True)
            if check.returncode == 0:
                return
            time.sleep(0.5)
        raise TimeoutError(f"service in {host} not healthy:\n{log.read_text()[-3000:]}")

    def __exit__(self, *exc) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        for name in self.names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)  # removes its veth ends too


def test_verifier_and_two_drafts_on_separate_hosts_with_tls_and_tokens(tmp_path):
    reason = _namespaces_available()
    if reason:
        pytest.skip(reason)
    certs = tmp_path / "certs"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_dev_certs.py"), str(certs), "--host", "10.77.1.1",
                    "--host", "10.77.2.1"], check=True, capture_output=True)
    target, draft = make_text_pair(tmp_path, "qwen2")
    c = {n: str(certs / n) for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key",
                                     "verifier.tokens", "draft.tokens")}
    server_tls = ["--tls-cert", c["server.pem"], "--tls-key", c["server.key"]]
    with Hosts() as hosts:
        vlog = tmp_path / "verifier.log"
        verifier = hosts.run("v", ["-m", "specwire.cli", "verifier", "--model", str(target), "--dtype", "float64",
                                   "--host", "0.0.0.0", "--port", "50051", "--num-blocks", "256", "--block-size", "4",
                                   *server_tls, "--tls-client-ca", c["ca.pem"], "--auth-token-file",
                                   c["verifier.tokens"]], vlog)
        hosts.wait_healthy("v", "127.0.0.1:50051", ["--ca", c["ca.pem"], "--cert", c["client.pem"], "--key",
                                                    c["client.key"]], verifier, vlog)
        for i, host in enumerate("ab", start=1):
            dlog = tmp_path / f"draft-{host}.log"
            proc = hosts.run(host, ["-m", "specwire.cli", "draft", "--model", str(draft), "--dtype", "float64",
                                    "--host", "127.0.0.1", "--port", "50052", "--block-size", "4",
                                    "--verifier", f"10.77.{i}.1:50051", *server_tls, "--auth-token-file",
                                    c["draft.tokens"], "--verifier-tls-ca", c["ca.pem"], "--verifier-tls-cert",
                                    c["client.pem"], "--verifier-tls-key", c["client.key"], "--verifier-token-file",
                                    c["verifier.tokens"]], dlog)
            hosts.wait_healthy(host, "127.0.0.1:50052", ["--ca", c["ca.pem"]], proc, dlog)
        outputs = {}
        for host in "ab":
            run = subprocess.run(["ip", "netns", "exec", hosts.tag + host, sys.executable, "-m", "specwire.cli",
                                  "generate", PROMPT, "--server", "127.0.0.1:50052", "--root-certificates",
                                  c["ca.pem"], "--token-file", c["draft.tokens"], "--max-tokens", "12",
                                  "--temperature", "0", "--json"], capture_output=True, text=True, timeout=120)
            assert run.returncode == 0, run.stderr
            outputs[host] = json.loads(run.stdout)
        # a draft is not reachable from the other draft's host: the namespaces are separate hosts
        cross = subprocess.run(["ip", "netns", "exec", hosts.tag + "a", sys.executable, "-m",
                                "specwire.healthcheck", "10.77.2.2:50052", "1", "--ca", c["ca.pem"]],
                               capture_output=True)
        assert cross.returncode == 1
    from transformers import AutoTokenizer

    prompt_ids = AutoTokenizer.from_pretrained(target).encode(PROMPT, add_special_tokens=False)
    expected = greedy_continuation(target, prompt_ids, 12)
    assert outputs["a"]["token_ids"] == outputs["b"]["token_ids"] == expected
    assert "verify_stream_open" in vlog.read_text() and "10.77.1.2" in vlog.read_text() \
        and "10.77.2.2" in vlog.read_text()
