"""Packaging contracts: fresh generated stubs, transformers not fooled by our `kernels`, an SDK without torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_stubs_are_fresh(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from gen_protos import generate
    finally:
        sys.path.pop(0)
    for fresh in generate(tmp_path):
        committed = ROOT / fresh.relative_to(tmp_path)
        assert committed.exists(), f"{committed} is missing: run python scripts/gen_protos.py"
        assert committed.read_text() == fresh.read_text(), f"{committed} is stale: run python scripts/gen_protos.py"


def test_transformers_does_not_believe_hf_kernels_is_installed():
    code = ("import importlib.util, transformers.utils.import_utils as iu; "
            "assert importlib.util.find_spec('kernels') is not None; "
            "print(iu.is_kernels_available())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_client_sdk_imports_without_torch():
    code = "import sys, specwire, specwire.client, specwire.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_layers_run_one_way():
    """kernels/ and common/ import no service; neither service imports the other nor the SDK/CLI."""
    forbidden = {
        "kernels": ("common", "draft_service", "verifier_service", "specwire."),
        "common": ("draft_service", "verifier_service", "specwire."),
        "draft_service": ("verifier_service", "specwire.client", "specwire.cli"),
        "verifier_service": ("draft_service", "specwire.client", "specwire.cli"),
    }
    for package, bad in forbidden.items():
        for path in (ROOT / package).rglob("*.py"):
            for line in path.read_text().splitlines():
                stripped = line.strip()
                if stripped.startswith(("import ", "from ")):
                    module = stripped.split()[1]
                    assert not module.startswith(bad), f"{path.relative_to(ROOT)} imports {module}"


def test_wire_module_stays_a_leaf():
    """specwire/v1 (stubs and wire.py) imports only itself and the torch-free dataclasses of common/."""
    allowed = ("specwire.v1", "common.errors", "common.sampling", "common.generation_stats", "__future__", "grpc",
               "google.protobuf", "warnings", "collections", "dataclasses", "typing", "builtins")
    for path in (ROOT / "specwire" / "v1").glob("*.py"):
        for line in path.read_text().splitlines():
            if line.startswith(("import ", "from ")):
                module = line.split()[1]
                assert module.startswith(allowed), f"{path.relative_to(ROOT)} imports {module}"


def test_ruff_clean():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", str(ROOT)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:]


def test_both_clients_take_the_one_keyword_surface():
    """Client and AsyncClient, stream and generate: the keywords of build_request, defined once, visible in their
    signatures; an unknown keyword is a TypeError, as from any Python function."""
    import asyncio
    import inspect

    import pytest

    from specwire.client import AsyncClient, Client, build_request

    surface = [p for name, p in inspect.signature(build_request).parameters.items() if name != "prompt"]
    assert {p.name for p in surface} >= {"prompt_token_ids", "max_tokens", "temperature", "seed", "wire_mode",
                                         "cache_salt"}
    for cls in (Client, AsyncClient):
        for method in (cls.stream, cls.generate):
            params = list(inspect.signature(method).parameters.values())
            assert [p.name for p in params[:2]] == ["self", "prompt"]
            assert params[2:2 + len(surface)] == surface, (cls.__name__, method.__name__)
    assert "wire_mode" in Client.stream.__doc__ and "cache_salt" in AsyncClient.generate.__doc__
    with Client("127.0.0.1:1", connect_timeout=0.01) as client:
        with pytest.raises(TypeError, match="max_token"):
            client.generate("hi", max_token=3)
        with pytest.raises(TypeError, match=r"Client.stream\(\).*max_token"):  # at the call, not the first chunk
            client.stream("hi", max_token=3)

    async def unknown_keyword() -> None:
        async with AsyncClient("127.0.0.1:1", connect_timeout=0.01) as client:
            with pytest.raises(TypeError, match="temprature"):
                client.stream("hi", temprature=0.5)
            await client.generate("hi", temprature=0.5)

    with pytest.raises(TypeError, match="temprature"):
        asyncio.run(unknown_keyword())
