"""docs/two-hosts.md, followed as written: two network namespaces joined by a veth pair are the two hosts, each
with its own /etc/hosts (`ip netns exec` mounts /etc/netns/NAME/hosts), and the page's blocks run on the host
their `<!-- … -->` tag names, in the page's order:

- `workstation`: in a scratch directory standing for the user's machine (the repository's scripts/ and the
  tiny test models as .models/target and .models/draft);
- `copy`: the page's `ssh HOST mkdir -p` and `scp` lines, carried out as directories and copies in each host's
  home directory, so each host holds exactly the files the page sends it (a copy into a directory the page did
  not make fails, as scp would);
- `serve: HOST`: started in the background in HOST's namespace, in its specwire/ directory;
- `check: HOST`: run until it succeeds (the service it checks is starting), failing if a service exited;
- `run: HOST`: run once, and it must succeed; a `--json` generation must give the target's greedy output;
- `run-python: HOST`: the block as a Python script, run once, and it must succeed;
- `not run: why`: a block the test cannot run (installing), named so; every block of the page has a tag;
- `restart: HOST`: the service HOST serves is stopped and its `serve` block run again.

Only what no page can say comes from the test: the tiny models' float64 dtype, one thread per service and a small
KV pool, as SPECWIRE_* variables (every flag's twin), and PATH to this environment's `specwire`, `python` and
`grpcurl`. Skipped, with the reason, where namespaces cannot be created (not root, no `ip`)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_netns import _ip, _namespaces_available

from tiny_models import greedy_continuation, make_text_pair

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "two-hosts.md"
HOSTS = {"verifier": ("verifier.example.internal", "10.78.0.1"), "draft": ("draft.example.internal", "10.78.0.2")}


@dataclass
class Step:
    tag: str  # workstation, copy, serve, check, run, run-python, restart, not run
    host: str | None
    script: str  # the block's text; "" for restart


def page_steps(text: str) -> list[Step]:
    """The tagged steps of the page, in order: a `<!-- tag[: host] -->` line, then (but for restart) the fenced
    block that follows it."""
    steps = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        m = re.fullmatch(r"<!-- (workstation|copy|serve|check|run|run-python|restart|not run)(?:: ([^>]+?))? -->",
                         lines[i].strip())
        i += 1
        if not m:
            assert not lines[i - 1].startswith("```"), f"line {i}: a block with no tag before it"
            continue
        tag, host = m.group(1), m.group(2)
        if tag == "not run":
            host = None
        if tag == "restart":
            steps.append(Step(tag, host, ""))
            continue
        while not lines[i].startswith("```"):
            i += 1
        end = lines.index("```", i + 1)
        if tag != "not run":
            steps.append(Step(tag, host, "\n".join(lines[i + 1:end])))
        i = end + 1
    return steps


def test_the_page_is_tagged_as_the_test_reads_it():
    """Runs everywhere (no root needed): the page's steps are the ones the namespace test follows."""
    steps = page_steps(PAGE.read_text())
    assert [(s.tag, s.host) for s in steps] == [
        ("workstation", None), ("copy", None), ("serve", "verifier"), ("check", "draft"), ("run", "draft"),
        ("serve", "draft"), ("check", "draft"), ("run", "draft"), ("run-python", "draft"), ("restart", "verifier"),
        ("check", "draft"), ("run", "draft")]
    assert all(s.host in (None, *HOSTS) for s in steps)


def _host_of(name: str) -> str:
    return next(h for h, (host_name, _) in HOSTS.items() if host_name == name)


def _page_dirs(script: str) -> list[tuple[str, list[str]]]:
    """(host, directories) of each `ssh HOST mkdir -p DIR...` line of a block."""
    made = []
    for line in script.replace("\\\n", " ").split("\n"):
        words = shlex.split(line)
        if words[:1] == ["ssh"] and words[2:4] == ["mkdir", "-p"]:
            made.append((_host_of(words[1]), words[4:]))
    return made


def _scp_copies(script: str) -> list[tuple[list[str], str, str, bool]]:
    """(sources, host, destination, recursive) of each `scp` command of a block (continued lines joined)."""
    copies = []
    for line in script.replace("\\\n", " ").split("\n"):
        words = shlex.split(line)
        if not words or words[0] != "scp":
            continue
        recursive = "-r" in words
        args = [w for w in words[1:] if w != "-r"]
        host_name, dest = args[-1].split(":", 1)
        copies.append((args[:-1], _host_of(host_name), dest, recursive))
    return copies


class TwoHosts:
    def __init__(self, tmp: Path) -> None:
        self.tag = f"sw{uuid.uuid4().hex[:5]}"
        self.ns = {host: f"{self.tag}{host[0]}" for host in HOSTS}
        self.homes = {host: tmp / f"{host}-host" for host in HOSTS}
        self.workstation = tmp / "workstation"
        self.logs = tmp / "logs"
        self.served: dict[str, subprocess.Popen] = {}
        bin_dir = str(Path(sys.executable).parent)
        self.env = {**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}", "SPECWIRE_DTYPE": "float64",
                    "SPECWIRE_NUM_THREADS": "1", "SPECWIRE_NUM_BLOCKS": "256", "SPECWIRE_BLOCK_SIZE": "4"}

    def __enter__(self) -> TwoHosts:
        hosts_file = "127.0.0.1 localhost\n" + "".join(f"{ip} {name}\n" for name, ip in HOSTS.values())
        for host, ns in self.ns.items():
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            Path(f"/etc/netns/{ns}").mkdir(parents=True, exist_ok=True)
            Path(f"/etc/netns/{ns}/hosts").write_text(hosts_file)
            (self.homes[host] / "specwire").mkdir(parents=True)
        v, d = f"{self.tag}V", f"{self.tag}D"
        _ip("link", "add", v, "type", "veth", "peer", "name", d)
        for host, end in (("verifier", v), ("draft", d)):
            _ip("link", "set", end, "netns", self.ns[host])
            _ip("-n", self.ns[host], "addr", "add", f"{HOSTS[host][1]}/24", "dev", end)
            _ip("-n", self.ns[host], "link", "set", end, "up")
        self.logs.mkdir()
        return self

    def _command(self, host: str, script: str) -> list[str]:
        cwd = self.homes[host] / "specwire"
        return ["ip", "netns", "exec", self.ns[host], "bash", "-euo", "pipefail", "-c", f"cd {cwd}\n{script}"]

    def serve(self, host: str, script: str) -> None:
        log = open(self.logs / f"{host}.log", "ab")  # noqa: SIM115 - closed with the process
        self.served[host] = subprocess.Popen(self._command(host, f"exec {script}"), stdout=log,
                                             stderr=subprocess.STDOUT, env=self.env)

    def stop(self, host: str) -> None:
        proc = self.served.pop(host)
        proc.terminate()
        proc.wait(30)

    def run(self, host: str, script: str, timeout: float = 180) -> subprocess.CompletedProcess:
        return subprocess.run(self._command(host, script), capture_output=True, text=True, env=self.env,
                              timeout=timeout)

    def check(self, host: str, script: str, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while True:
            for name, proc in self.served.items():
                assert proc.poll() is None, f"{name} exited:\n{self.log(name)}"
            done = self.run(host, script)
            if done.returncode == 0:
                return
            assert time.monotonic() < deadline, f"still failing:\n{done.stderr}\n{self.log('verifier')}"
            time.sleep(0.5)

    def log(self, host: str) -> str:
        path = self.logs / f"{host}.log"
        return path.read_text()[-3000:] if path.exists() else ""

    def copy(self, script: str) -> None:
        for host, dirs in _page_dirs(script):
            for d in dirs:
                (self.homes[host] / d).mkdir(parents=True, exist_ok=True)
        for sources, host, dest, recursive in _scp_copies(script):
            target = self.homes[host] / dest
            assert target.is_dir(), f"scp into {dest} on {host}: the page never made that directory"
            for source in sources:
                src = self.workstation / source
                assert recursive or not src.is_dir(), f"scp without -r of a directory: {source}"
                if src.is_dir():
                    shutil.copytree(src, target / src.name)
                else:
                    shutil.copy(src, target / src.name)

    def __exit__(self, *exc) -> None:
        for proc in self.served.values():
            proc.terminate()
        for proc in self.served.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        for ns in self.ns.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)


# slow profile: 36 s; services on separate network namespaces with TLS and tokens stay in the default run
# (test_netns.py)
@pytest.mark.slow
def test_two_hosts_as_the_page_says(tmp_path):
    reason = _namespaces_available()
    if reason:
        pytest.skip(reason)
    steps = page_steps(PAGE.read_text())
    target, draft = make_text_pair(tmp_path / "models", "qwen2")
    from transformers import AutoTokenizer

    prompt_ids = AutoTokenizer.from_pretrained(target).encode("def quicksort(xs):", add_special_tokens=False)
    expected = greedy_continuation(target, prompt_ids, 24)
    served_scripts: dict[str, str] = {}
    generations = []
    with TwoHosts(tmp_path) as hosts:
        (hosts.workstation / ".models").mkdir(parents=True)
        (hosts.workstation / "scripts").symlink_to(ROOT / "scripts")
        shutil.copytree(target, hosts.workstation / ".models" / "target")
        shutil.copytree(draft, hosts.workstation / ".models" / "draft")
        for step in steps:
            if step.tag == "workstation":
                done = subprocess.run(["bash", "-euo", "pipefail", "-c", step.script], cwd=hosts.workstation,
                                      capture_output=True, text=True, env=hosts.env, timeout=120)
                assert done.returncode == 0, done.stderr
            elif step.tag == "copy":
                hosts.copy(step.script)
            elif step.tag == "serve":
                served_scripts[step.host] = step.script
                hosts.serve(step.host, step.script)
            elif step.tag == "check":
                hosts.check(step.host, step.script)
            elif step.tag == "restart":
                hosts.stop(step.host)
                hosts.serve(step.host, served_scripts[step.host])
            elif step.tag == "run-python":
                done = hosts.run(step.host, f"python - <<'PAGE_PYTHON'\n{step.script}\nPAGE_PYTHON")
                assert done.returncode == 0, f"{step.script}\n{done.stderr}"
            else:
                done = hosts.run(step.host, step.script)
                assert done.returncode == 0, f"{step.script}\n{done.stderr}\n{hosts.log('draft')}"
                if "--json" in step.script:
                    generations.append(json.loads(done.stdout))
                elif "GetInfo" in step.script:
                    assert "tokenizer_fingerprint" in done.stdout or "tokenizerFingerprint" in done.stdout, done.stdout
        verifier_log = (hosts.logs / "verifier.log").read_text()
        draft_log = (hosts.logs / "draft.log").read_text()
    # the page's private keys went only where they serve: the verifier host has no client key
    assert not (hosts.homes["verifier"] / "specwire" / "certs" / "client.key").exists()
    assert len(generations) == 2 and all(g["token_ids"] == expected for g in generations)
    # the draft reached the verifier from the draft host's address, and reconnected after the restart
    assert HOSTS["draft"][1] in verifier_log
    assert verifier_log.count('"verifier_ready"') == 2
    assert draft_log.count('"verifier_connected"') >= 2
